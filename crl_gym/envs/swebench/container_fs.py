"""The editor's file system inside a running sandbox container (commands run as the agent).

:class:`ContainerFS` needs three things of its sandbox, named by the :class:`Sandbox` protocol:
the work directory, ``run`` and ``put_file``. It does not import
:mod:`~crl_gym.envs.swebench.sandbox` (which imports this module to build ``DockerSandbox.fs``),
so the two modules do not import each other, and any object with those members will do.
"""

from __future__ import annotations

import os
from typing import Protocol


class _Workdir(Protocol):
    @property
    def workdir(self) -> str:
        """The repository's directory inside the container."""
        ...


class Sandbox(Protocol):
    """What :class:`ContainerFS` uses of a sandbox (:class:`~crl_gym.envs.swebench.sandbox.DockerSandbox` has it)."""

    @property
    def config(self) -> _Workdir:
        """Its limits; only ``workdir`` is read here."""
        ...

    def run(self, argv: list[str], *, timeout: float = ...) -> tuple[int | None, bytes]:
        """Run a short command as the agent: ``(exit_code, output)``, exit code None on timeout."""
        ...

    def put_file(self, path: str, data: bytes, mode: int = ...) -> None:
        """Write a file (its parent exists), owned by the agent."""
        ...


class ContainerFS:
    """The editor's :class:`~crl_gym.envs.swebench.editor.FileSystem` inside a sandbox."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self.root = sandbox.config.workdir

    def _ok(self, argv: list[str]) -> bytes:
        code, out = self.sandbox.run(argv, timeout=30.0)
        if code != 0:
            raise OSError(out.decode("utf-8", "replace").strip() or f"{argv[0]} failed with exit {code}")
        return out

    def realpath(self, path: str) -> str:
        return self._ok(["realpath", "-m", "--", path]).decode().strip()

    def kind(self, path: str) -> str:
        code, out = self.sandbox.run(["stat", "-L", "-c", "%F", "--", path], timeout=30.0)
        if code != 0:
            return "missing"
        text = out.decode().strip()
        return {"regular file": "file", "regular empty file": "file", "directory": "dir"}.get(text, "other")

    def read_text(self, path: str) -> str:
        return self._ok(["cat", "--", path]).decode("utf-8", "replace")

    def write_text(self, path: str, text: str) -> None:
        parent = os.path.dirname(path)
        self._ok(["mkdir", "-p", "--", parent])
        code, out = self.sandbox.run(["stat", "-c", "%a", "--", path], timeout=30.0)
        mode = int(out.decode().strip(), 8) if code == 0 else 0o644
        self.sandbox.put_file(path, text.encode("utf-8"), mode)

    def list_dir(self, path: str, depth: int = 2) -> list[str]:
        out = self._ok(["find", path, "-mindepth", "1", "-maxdepth", str(depth), "-not", "-path", "*/.*"])
        return sorted(line for line in out.decode("utf-8", "replace").splitlines() if line)
