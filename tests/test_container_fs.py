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
