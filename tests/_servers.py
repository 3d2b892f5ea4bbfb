"""Helpers for tests that start a real ``crl-experience serve`` subprocess."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

from crl_gym.clients import RemoteClient


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(client: RemoteClient, proc: subprocess.Popen[bytes], timeout: float = 300.0) -> None:
    """Return once the server answers ``/health`` with ok; fail if it exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited early with {proc.returncode}"
        try:
            if client.health().status == "ok":
                return
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.5)
    raise AssertionError("crl-experience serve did not answer /health in time")


def stop_server(proc: subprocess.Popen[bytes], client: RemoteClient) -> bytes:
    """SIGTERM the server (SIGKILL after 60 s), close ``client``; returns the server's stderr."""
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    client.close()
    return err or b""
