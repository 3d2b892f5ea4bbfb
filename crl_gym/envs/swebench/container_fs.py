"""The editor's file system inside a running sandbox container (commands run as the agent).

:class:`ContainerFS` needs three things of its sandbox, named by the :class:`Sandbox` protocol:
the work directory, ``run`` and ``stage`` (and ``run_python`` where the sandbox has it: the file API
then runs without an interpreter start per call). It does not import
:mod:`~crl_gym.envs.swebench.sandbox` (which imports this module to build ``DockerSandbox.fs``),
so the two modules do not import each other, and any object with those members will do.

Reads and writes of file contents go through :data:`FILE_API`, a small program run inside the
container as the agent's uid. It resolves the path there, refuses it unless it lies in the work
tree, then walks it from the work tree's root one component at a time with ``O_NOFOLLOW``. A
symlink swapped in after the editor's path check (or after this program's own check) makes the
walk fail instead of leading it out of the tree, and the write has no more rights than the agent
has in ``execute_bash``. The data to write is staged by the sandbox where only root can write and
copied from there by the agent's uid, so the engine's root-side copy never meets a path the agent
controls.
"""

from __future__ import annotations

from typing import Any, Protocol

from crl_gym.envs.swebench.tools import ToolCallError

STAGE_DIR = "/run/crl-stage"
"""The sandbox's staging directory for the editor's writes: a root-owned tmpfs of its own."""

# Exit codes of FILE_API: 0 done, 1 an OSError (message on stderr), 3 refused (message on stderr).
_REFUSED = 3
FILE_API = (
    r"""
import errno, os, stat, sys

def refuse(msg):
    sys.stderr.write("Refused: " + msg + "\n")
    sys.exit(3)

def main(op, root, path, stage):
    root = os.path.realpath(root)
    real = os.path.realpath(path)
    if real != root and not real.startswith(root.rstrip("/") + "/"):
        refuse("%r is outside the work tree %s." % (path, root))
    parts = [p for p in real[len(root):].split("/") if p]
    if not parts:
        refuse("%r is not a regular file." % path)
    walk = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in parts[:-1]:
            try:
                nxt = os.open(name, walk, dir_fd=fd)
            except FileNotFoundError:
                if op != "write":
                    raise
                try:
                    os.mkdir(name, 0o777, dir_fd=fd)
                except FileExistsError:
                    pass
                nxt = os.open(name, walk, dir_fd=fd)
            os.close(fd)
            fd = nxt
        if op == "read":
            f = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        else:
            s = os.open(stage, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(s, "rb") as staged:
                data = staged.read()
            f = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK,"""
    r""" 0o666, dir_fd=fd)
        if not stat.S_ISREG(os.fstat(f).st_mode):
            os.close(f)
            refuse("%r is not a regular file." % path)
        if op == "read":
            with os.fdopen(f, "rb") as fh:
                sys.stdout.buffer.write(fh.read())
            return
        os.ftruncate(f, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(f, view):]
        os.close(f)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            refuse("%r changed while it was used (a component is now a symlink or not a"""
    r""" directory)." % path)
        sys.stderr.write("%s: %s\n" % (path, exc.strerror))
        sys.exit(1)
    finally:
        os.close(fd)

main(*sys.argv[1:5])
"""
)
"""Reads (``read ROOT PATH -``) and writes (``write ROOT PATH STAGED``) of the work tree's files."""

# realpath -m and stat -L -c %F, for a sandbox that runs Python in-process (no program start
# per call).
_REALPATH = "import os, sys\nsys.stdout.write(os.path.realpath(sys.argv[1]))\n"
_KIND = (
    "import os, stat, sys\ntry:\n    m = os.stat(sys.argv[1]).st_mode\nexcept OSError:\n    "
    "sys.exit(1)\nsys.stdout.write('file' if stat.S_ISREG(m) else 'dir' if stat.S_ISDIR(m) "
    "else 'other')\n"
)

# -I: no PYTHON* variables, user site or current directory (the agent controls $HOME=/tmp);
# -S: no site module. Only the root-owned standard library is imported.
_PYTHON = (
    'command -v python3 >/dev/null && exec python3 -I -S -c "$0" "$@"; exec '
    '/opt/miniconda3/bin/python3 -I -S -c "$0" "$@"'
)


class _Workdir(Protocol):
    @property
    def workdir(self) -> str:
        """The repository's directory inside the container."""
        ...


class Sandbox(Protocol):
    """What :class:`ContainerFS` uses of a sandbox
    (:class:`~crl_gym.envs.swebench.sandbox.DockerSandbox` has it)."""

    @property
    def config(self) -> _Workdir:
        """Its limits; only ``workdir`` is read here."""
        ...

    def run(self, argv: list[str], *, timeout: float = ...) -> tuple[int | None, bytes]:
        """Run a short command as the agent: ``(exit_code, output)``, exit code None on timeout."""
        ...

    def stage(self, data: bytes) -> str:
        """Put ``data`` where the agent's uid can read it but nothing of the agent's can change
        it; the path."""
        ...


class ContainerFS:
    """The editor's :class:`~crl_gym.envs.swebench.editor.FileSystem` inside a sandbox (one edit
    at a time)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self.root = sandbox.config.workdir

    def _in_process(self) -> Any:
        """The sandbox's ``run_python`` when it runs Python without a program start
        (persistent shell)."""
        return (
            getattr(self.sandbox, "run_python", None)
            if getattr(self.sandbox, "persistent", False)
            else None
        )

    def _ok(
        self, argv: list[str], *, refusable: bool = False, python: list[str] | None = None
    ) -> bytes:
        runner = getattr(self.sandbox, "run_python", None)
        if (
            python is not None and runner is not None
        ):  # in-process in the sandbox's shell: no interpreter start
            code, out = runner(FILE_API, python, timeout=30.0)
        else:
            code, out = self.sandbox.run(argv, timeout=30.0)
        if refusable and code == _REFUSED:  # the agent sees why, as for the editor's own path check
            raise ToolCallError(out.decode("utf-8", "replace").strip())
        if code != 0:
            raise OSError(
                out.decode("utf-8", "replace").strip() or f"{argv[0]} failed with exit {code}"
            )
        return out

    def _file_api(self, op: str, path: str, staged: str = "-") -> bytes:
        return self._ok(
            ["sh", "-c", _PYTHON, FILE_API, op, self.root, path, staged],
            refusable=True,
            python=[op, self.root, path, staged],
        )

    def realpath(self, path: str) -> str:
        runner = self._in_process()
        if runner is not None:
            code, out = runner(_REALPATH, [path], timeout=30.0)
            if code != 0:
                raise OSError(
                    out.decode("utf-8", "replace").strip() or f"realpath failed with exit {code}"
                )
            return str(out.decode())
        return self._ok(["realpath", "-m", "--", path]).decode().strip()

    def kind(self, path: str) -> str:
        runner = self._in_process()
        if runner is not None:
            code, out = runner(_KIND, [path], timeout=30.0)
            return "missing" if code != 0 else out.decode().strip()
        code, out = self.sandbox.run(["stat", "-L", "-c", "%F", "--", path], timeout=30.0)
        if code != 0:
            return "missing"
        text = out.decode().strip()
        return {"regular file": "file", "regular empty file": "file", "directory": "dir"}.get(
            text, "other"
        )

    def read_text(self, path: str) -> str:
        return self._file_api("read", path).decode("utf-8", "replace")

    def write_text(self, path: str, text: str) -> None:
        """Write ``path`` (missing parents are created); an existing file keeps its mode."""
        self._file_api("write", path, self.sandbox.stage(text.encode("utf-8")))

    def list_dir(self, path: str, depth: int = 2) -> list[str]:
        out = self._ok(
            ["find", path, "-mindepth", "1", "-maxdepth", str(depth), "-not", "-path", "*/.*"]
        )
        return sorted(line for line in out.decode("utf-8", "replace").splitlines() if line)
