"""The editor's file system inside a running sandbox container (commands run as the agent)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from crl_gym.envs.swebench.sandbox import DockerSandbox


class ContainerFS:
    """The editor's :class:`~crl_gym.envs.swebench.editor.FileSystem` inside a sandbox."""

    def __init__(self, sandbox: DockerSandbox) -> None:
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
