"""The in-container end of the persistent shell: a small root process that runs the
agent's commands.

This file is NOT imported by the host. :mod:`~crl_gym.envs.swebench.shell` sends its source to the
container's own Python (``python3 -I -S -c SOURCE UID GID STAGE_DIR``, as root, over one
``docker exec -i``) and talks to it through that exec's stdin and stdout. It uses only the
standard library and runs on any Python >= 3.7.

Why a root process of its own and not a bash loop: the agent's commands run as the agent's uid and
may do anything that uid can (kill every process of the uid, open ``/proc/PID/fd/1`` of a
same-uid process, read its memory). The server runs as another uid (root, with only the
capabilities the container grants root), so no agent process can signal it, read its pipes or
write into them; every frame on its stdout is the server's own.

Framing, host to server: ``<n>\\n`` then ``n`` bytes of a JSON request with an ``id`` (a fresh
random nonce per request). Server to host: one JSON line with the same ``id`` and ``n`` (the
payload's length), then ``n`` raw bytes. A command's output never reaches this stream directly:
it goes to an unlinked file the server opened, and the server copies (head and tail of) it into
the payload after the command ended, so no output can look like a frame.

Each request forks a child that leaves the server's session, drops to the agent's uid and groups
(which also clears its capabilities), gets ``/dev/null`` as stdin, the output file as stdout and
stderr, and the file-size limit, then ``exec``s the command (``exec``/``run``) or runs a given
Python function source in-process (``py``: the editor's file API, no interpreter start per call).
When the child returns or its time is up, every process of the agent's uid is killed with one
``kill(-1, SIGKILL)`` issued with the agent's uid as real and effective uid, so it reaches those
processes and nothing else; the server keeps its saved uid 0 and takes it back right after. A
process with a pending SIGKILL cannot fork, so one pass leaves none (two are sent anyway).
"""

from __future__ import annotations

import base64
import json
import os
import resource
import select
import signal
import sys
import time
import traceback
from typing import Any


def _read_exact(fd: int, n: int) -> bytes:
    chunks = []
    while n > 0:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError("host closed the stream")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _read_line(fd: int) -> bytes:
    out = b""
    while not out.endswith(b"\n"):
        ch = os.read(fd, 1)
        if not ch:
            raise EOFError("host closed the stream")
        out += ch
        if len(out) > 32:
            raise ValueError("bad frame header")
    return out


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Server:
    def __init__(self, uid: int, gid: int, stage_dir: str) -> None:
        self.uid, self.gid, self.stage_dir = uid, gid, stage_dir
        self.null = os.open("/dev/null", os.O_RDWR)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wake-up fd gets a byte
        self.seq = 0

    # -- the agent's processes ------------------------------------------------------------
    def kill_agent(self) -> None:
        """SIGKILL every process of the agent's uid: kill(-1) with real and effective uid
        = agent."""
        os.setresuid(self.uid, self.uid, 0)
        try:
            for _ in range(2):
                try:
                    os.kill(-1, signal.SIGKILL)
                except ProcessLookupError:  # none left
                    break
        finally:
            os.setresuid(0, 0, 0)

    def wait_gone(self, timeout: float = 5.0) -> None:
        """Until init has reaped them, killed processes still hold their pid (and the next command
        could meet the pids limit): wait for the last one to be gone."""
        deadline = time.monotonic() + timeout
        while self.agent_pids() and time.monotonic() < deadline:
            time.sleep(0.001)

    def agent_pids(self) -> list[int]:
        """Pids of the agent's uid still in the process table (zombies included)."""
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if os.stat("/proc/" + name).st_uid == self.uid:
                        found.append(int(name))
                except OSError:  # gone meanwhile
                    pass
        return found

    def child(self, req: dict[str, Any], out_fd: int) -> None:
        """In the forked child: become the agent with the request's limits, then run it.
        Never returns."""
        try:
            os.setsid()
            for sig in (signal.SIGPIPE, signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
            os.dup2(self.null, 0)
            os.dup2(out_fd, 1)
            os.dup2(out_fd, 2)
            os.closerange(3, 1024)
            fsize = int(req.get("fsize", -1))
            if fsize >= 0:
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
            os.setgroups([])
            os.setgid(self.gid)
            os.setuid(self.uid)
            os.chdir(req.get("cwd") or "/")
            env = dict(os.environ)  # the container's environment, as a docker exec gets it
            env.update(req.get("env") or {})
            if req["op"] == "py":
                sys.argv = ["crl"] + list(req.get("args", []))
                code = 0
                try:
                    exec(compile(req["code"], "<crl>", "exec"), {"__name__": "__main__"})
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
            argv = req["argv"]
            os.execvpe(argv[0], argv, env)
        except BaseException as exc:  # exec failed: say why, as a shell would
            try:
                os.write(2, f"{req.get('argv', ['?'])[0]}: {exc}\n".encode())
            finally:
                os._exit(127)

    def wait(self, pid: int, timeout: float) -> int | None:
        """The child's exit status, or None when ``timeout`` passed first (the child still runs)."""
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            select.select([self.wake_r], [], [], left)
            try:
                while os.read(self.wake_r, 512):
                    pass
            except BlockingIOError:
                pass

    # -- requests -------------------------------------------------------------------------
    def run(self, req: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        """exec / run / py: a child as the agent, its output, its status; every agent process
        dies after."""
        self.seq += 1
        path = f"{self.stage_dir}/.out-{os.getpid()}-{self.seq}"
        out_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.unlink(path)  # no name left to swap; the server reads through its own descriptor
        try:
            t0 = time.monotonic()
            pid = os.fork()
            if pid == 0:
                self.child(req, out_fd)
            status = self.wait(pid, float(req.get("timeout", 60.0)))
            timed_out = status is None
            self.kill_agent()
            if status is None:
                _, status = os.waitpid(pid, 0)
            self.wait_gone()
            duration = time.monotonic() - t0
            if os.WIFEXITED(status):
                rc = os.WEXITSTATUS(status)
            else:
                rc = 128 + os.WTERMSIG(status)
            size = os.fstat(out_fd).st_size
            limit = int(req.get("limit", -1))
            head = int(req.get("head", 0))
            if limit < 0 or size <= limit:
                shown, head_len = os.pread(out_fd, size, 0), size
            else:
                tail = limit - head
                first = os.pread(out_fd, head, 0)
                shown, head_len = first + os.pread(out_fd, tail, size - tail), len(first)
        finally:
            os.close(out_fd)
        return {
            "rc": rc,
            "timed_out": timed_out,
            "size": size,
            "head_len": head_len,
            "duration": duration,
        }, shown

    def stage(self, req: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        """Write a file in the root-only staging directory (the editor's next write,
        the prelude)."""
        name = req["name"]
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"bad staging name {name!r}")
        data = base64.b64decode(req["data"])
        fd = os.open(
            f"{self.stage_dir}/{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644
        )
        try:
            os.fchmod(fd, 0o644)
            _write_all(fd, data)
        finally:
            os.close(fd)
        return {"path": f"{self.stage_dir}/{name}"}, b""

    def serve(self) -> None:
        _write_all(
            1,
            (
                json.dumps(
                    {
                        "hello": True,
                        "pid": os.getpid(),
                        "python": "{}.{}".format(*sys.version_info[:2]),
                    }
                )
                + "\n"
            ).encode(),
        )
        while True:
            try:
                n = int(_read_line(0))
                req = json.loads(_read_exact(0, n).decode("utf-8"))
            except EOFError:
                return
            op = req.get("op")
            try:
                if op in ("exec", "run", "py"):
                    head, payload = self.run(req)
                elif op == "stage":
                    head, payload = self.stage(req)
                elif op == "ping":
                    head, payload = {}, b""
                else:
                    raise ValueError(f"unknown op {op!r}")
            except Exception as exc:  # reported to the host, never a dead server
                where = traceback.extract_tb(exc.__traceback__)[-1]
                head, payload = {"error": f"{type(exc).__name__}: {exc} (line {where.lineno})"}, b""
            head["id"] = req.get("id")
            head["n"] = len(payload)
            _write_all(1, (json.dumps(head) + "\n").encode() + payload)


if __name__ == "__main__":
    os.chdir("/")
    Server(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]).serve()
