"""Helpers for tests that start a real ``crl-experience serve`` subprocess."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from crl_gym.clients import RemoteClient
from crl_gym.envs.recall import task_name, task_secret
from crl_gym.experience.pinning import UNPINNED_TAG
from crl_gym.protocol import AddOp

TINY_PRESET = Path(__file__).parents[1] / "configs" / "tiny.yaml"


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


def start_extractor_server(tmp_path: Path, *, env_ids: list[str] | None = None,
                           env_kwargs: Mapping[str, Any] | None = None, timeout: float = 60.0,
                           wait: bool = True) -> tuple[subprocess.Popen[bytes], RemoteClient]:
    """``crl-experience serve --extractor`` with the tiny preset (a real subprocess, bank under
    ``tmp_path``) and its client. A small B_phi (buffer 2, no cooldown, no merges) and a short
    distillation linger, so a few episodes reach a CISPO update; no seed entries. ``env_ids`` /
    ``env_kwargs`` replace the preset's envs. Returns once ``/health`` answers, unless ``wait`` is
    False (then call :func:`wait_healthy`); stop it with :func:`stop_server`."""
    preset = yaml.safe_load(TINY_PRESET.read_text())
    if env_ids is not None:
        preset["env"]["ids"] = list(env_ids)
    if env_kwargs is not None:
        preset["env"]["kwargs"] = dict(env_kwargs)
    preset["algo"].update({"buffer_size": 2, "cooldown": 0, "merge_every": 0})
    preset["experience"].update({"distill_linger_s": 0.1, "seed_entries": []})
    config = tmp_path / "extractor.yaml"
    config.write_text(yaml.safe_dump(preset))
    port = free_port()
    cmd = [sys.executable, "-m", "crl_gym.cli", "serve", "--bank", str(tmp_path / "bank"), "--port", str(port),
           "--extractor", str(config)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    client = RemoteClient(f"http://127.0.0.1:{port}", timeout=timeout)
    if wait:
        try:
            wait_healthy(client, proc)
        except BaseException:
            stop_server(proc, client)
            raise
    return proc, client


def seed_recall_secrets(client: RemoteClient, num_tasks: int = 4, length: int = 2, num_actions: int = 2) -> None:
    """One entry per ``crl/Recall-v0`` task that names its secret sequence (what a guided episode is shown)."""
    # unpinned: the extractor's Updates rewrite them in place, so the episodes they guide credit its samples
    client.apply_ops([AddOp(f"In task {task_name(i)} play {' then '.join(task_secret(i, length, num_actions))}.",
                            tags=(UNPINNED_TAG,)) for i in range(num_tasks)])
