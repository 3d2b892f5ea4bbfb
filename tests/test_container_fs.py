"""Tests of crl_gym.envs.swebench.container_fs: the editor's file system inside a real container."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from crl_gym.envs.swebench.container_fs import ContainerFS
from crl_gym.envs.swebench.image import BASE_IMAGE
from crl_gym.envs.swebench.sandbox import DockerSandbox, SandboxConfig
from crl_gym.envs.swebench.testing import require_docker


@pytest.fixture(scope="module")
def fs() -> Iterator[ContainerFS]:
    client: Any = require_docker()
    cfg = SandboxConfig(workdir="/tmp", mem_limit="256m", pids_limit=64)
    with DockerSandbox(BASE_IMAGE, cfg, client).start() as sb:
        yield sb.fs


@pytest.mark.docker
def test_write_read_kind_and_listing(fs: ContainerFS) -> None:
    assert fs.root == "/tmp"
    fs.write_text("/tmp/pkg/sub/mod.py", "x = 'é'\n")  # parents are created
    fs.write_text("/tmp/pkg/.hidden", "secret")
    assert fs.read_text("/tmp/pkg/sub/mod.py") == "x = 'é'\n"
    assert (fs.kind("/tmp/pkg/sub/mod.py"), fs.kind("/tmp/pkg"), fs.kind("/tmp/nope")) == ("file", "dir", "missing")
    assert fs.list_dir("/tmp/pkg") == ["/tmp/pkg/sub", "/tmp/pkg/sub/mod.py"]  # hidden files left out
    assert fs.realpath("/tmp/pkg/sub/../sub/./mod.py") == "/tmp/pkg/sub/mod.py"


@pytest.mark.docker
def test_rewrite_keeps_the_mode_and_errors_are_oserrors(fs: ContainerFS) -> None:
    fs.write_text("/tmp/run.sh", "echo 1\n")
    code, _ = fs.sandbox.run(["chmod", "755", "/tmp/run.sh"])
    assert code == 0
    fs.write_text("/tmp/run.sh", "echo 2\n")
    code, out = fs.sandbox.run(["stat", "-c", "%a", "/tmp/run.sh"])
    assert (code, out.decode().strip()) == (0, "755")
    with pytest.raises(OSError, match="No such file"):
        fs.read_text("/tmp/absent.txt")


def test_container_fs_does_not_import_the_sandbox_module() -> None:
    # sandbox.py imports container_fs (DockerSandbox.fs); the reverse import would close a circle,
    # even one only under TYPE_CHECKING.
    import ast
    from pathlib import Path

    import crl_gym.envs.swebench.container_fs as mod

    tree = ast.parse(Path(mod.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m and "sandbox" in m}, imported


class LocalSandbox:
    """A :class:`~crl_gym.envs.swebench.container_fs.Sandbox` on this machine's file system."""

    class config:  # noqa: N801 - mirrors SandboxConfig.workdir
        workdir = "/tmp"

    def __init__(self) -> None:
        self.modes: list[int] = []

    def run(self, argv: list[str], *, timeout: float = 60.0) -> tuple[int | None, bytes]:
        import subprocess

        res = subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
        return res.returncode, res.stdout + res.stderr

    def put_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        import os

        self.modes.append(mode)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, mode)


def test_any_object_with_the_protocol_is_a_sandbox(tmp_path: Any) -> None:
    sb = LocalSandbox()
    fs = ContainerFS(sb)
    target = str(tmp_path / "pkg" / "mod.py")
    fs.write_text(target, "x = 'é'\n")
    assert fs.read_text(target) == "x = 'é'\n" and fs.kind(target) == "file" and sb.modes == [0o644]
    (tmp_path / "pkg" / "mod.py").chmod(0o755)
    fs.write_text(target, "x = 2\n")  # a rewrite keeps the mode
    assert sb.modes[-1] == 0o755 and fs.list_dir(str(tmp_path / "pkg")) == [target]
    with pytest.raises(OSError, match="No such file"):
        fs.read_text(str(tmp_path / "absent.txt"))
