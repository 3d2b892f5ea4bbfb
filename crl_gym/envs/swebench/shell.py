"""The host end of a sandbox's persistent shell: one ``docker exec -i`` per container, kept open.

The in-container end is :mod:`~crl_gym.envs.swebench.shell_server` (its source is sent as the
``-c`` program of the container's Python, as root). Requests and answers travel over the exec's
attach socket, which the engine multiplexes (8-byte headers: stream, size); the server's stdout
carries the framed answers, its stderr is kept for diagnostics only.

Each request carries a fresh random ``id``; an answer whose ``id`` differs, a closed stream or an
answer later than the request's deadline raise :class:`ShellDiedError`, and the sandbox then
replaces the server. A command cannot spoof an answer: it never writes to this stream (its output
goes to a file the server reads back) and, running as another uid, it cannot reach the server's
pipes, signal it or read its memory.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import struct
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from docker import DockerClient

log = logging.getLogger(__name__)

SERVER_SOURCE = (Path(__file__).parent / "shell_server.py").read_text()
# The container's Python, as the editor's file API finds it (python3 on PATH, else
# sweb.eval's conda).
_PYTHON = (
    'command -v python3 >/dev/null && exec python3 -I -S -c "$0" "$@"; exec '
    '/opt/miniconda3/bin/python3 -I -S -c "$0" "$@"'
)
_MAX_STDERR = 8192


class ShellDiedError(RuntimeError):
    """The shell's server is gone, hung or out of step; the sandbox replaces it."""


class PersistentShell:
    """One server process inside one container, and the socket to it."""

    def __init__(
        self, client: DockerClient, container_id: str, uid: int, gid: int, stage_dir: str
    ) -> None:
        self.client = client
        self.container_id = container_id
        self.uid, self.gid, self.stage_dir = uid, gid, stage_dir
        self.pid: int | None = None
        """The server's pid inside the container (from its hello)."""
        self.python = ""
        self._sock: socket.socket | None = None
        self._raw: Any = None
        self._buf = bytearray()  # demultiplexed stdout not yet consumed
        self.stderr = bytearray()

    # -- life cycle ----------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> PersistentShell:
        api = self.client.api
        exec_id = api.exec_create(
            self.container_id,
            ["sh", "-c", _PYTHON, SERVER_SOURCE, str(self.uid), str(self.gid), self.stage_dir],
            stdin=True,
            stdout=True,
            stderr=True,
            tty=False,
            user="0",
            workdir="/",
        )["Id"]
        raw = api.exec_start(exec_id, socket=True)
        self._raw = raw
        self._sock = getattr(raw, "_sock", raw)
        hello = json.loads(self._line(time.monotonic() + timeout))
        if not hello.get("hello"):
            raise ShellDiedError(f"the shell did not start: {hello!r}")
        self.pid, self.python = int(hello["pid"]), str(hello.get("python", ""))
        return self

    def close(self) -> None:
        """Close the stream; the server sees end-of-file and exits (the container's removal ends
        it anyway)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                sock.close()
            except OSError:
                pass
            if self._raw is not None and self._raw is not sock:
                try:
                    self._raw.close()
                except OSError:
                    pass

    @property
    def alive(self) -> bool:
        return self._sock is not None

    # -- requests ------------------------------------------------------------------------
    def request(self, req: dict[str, Any], timeout: float) -> tuple[dict[str, Any], bytes]:
        """Send one request; its answer header and payload. :class:`ShellDiedError` on any break."""
        if self._sock is None:
            raise ShellDiedError("the shell is closed")
        nonce = os.urandom(12).hex()
        body = json.dumps({**req, "id": nonce}).encode("utf-8")
        deadline = time.monotonic() + timeout
        try:
            self._sock.settimeout(timeout)
            self._sock.sendall(b"%d\n" % len(body) + body)
            head = json.loads(self._line(deadline))
        except (OSError, ValueError) as exc:
            raise self._died(f"{type(exc).__name__}: {exc}") from exc
        if head.get("id") != nonce:
            raise self._died(f"answer out of step (id {head.get('id')!r})")
        payload = self._exact(int(head.get("n", 0)), deadline)
        if "error" in head:
            raise RuntimeError(f"shell request {req.get('op')!r} failed: {head['error']}")
        return head, payload

    def stage(self, name: str, data: bytes, timeout: float = 30.0) -> str:
        """Write ``data`` as root into the staging directory; its path."""
        head, _ = self.request(
            {"op": "stage", "name": name, "data": base64.b64encode(data).decode()}, timeout
        )
        return str(head["path"])

    def _died(self, why: str) -> ShellDiedError:
        err = self.stderr.decode("utf-8", "replace").strip()[-500:]
        self.close()
        return ShellDiedError(why + (f" (server stderr: {err})" if err else ""))

    # -- the multiplexed stream ----------------------------------------------------------
    def _fill(self, deadline: float) -> None:
        """Read one frame of the attach stream into the stdout buffer (or stderr)."""
        header = self._recv(8, deadline)
        stream, size = header[0], struct.unpack(">I", header[4:])[0]
        data = self._recv(size, deadline)
        if stream == 2:
            self.stderr += data
            del self.stderr[:-_MAX_STDERR]
        else:
            self._buf += data

    def _recv(self, n: int, deadline: float) -> bytes:
        assert self._sock is not None
        out = bytearray()
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer before the deadline")
            self._sock.settimeout(left)
            chunk = self._sock.recv(n - len(out))
            if not chunk:
                raise EOFError("the shell's stream closed")
            out += chunk
        return bytes(out)

    def _line(self, deadline: float) -> bytes:
        try:
            while b"\n" not in self._buf:
                self._fill(deadline)
        except (OSError, EOFError) as exc:
            raise self._died(f"{type(exc).__name__}: {exc}") from exc
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        return line

    def _exact(self, n: int, deadline: float) -> bytes:
        try:
            while len(self._buf) < n:
                self._fill(deadline)
        except (OSError, EOFError) as exc:
            raise self._died(f"{type(exc).__name__}: {exc}") from exc
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out
