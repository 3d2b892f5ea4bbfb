"""Tests of crl_gym.envs.swebench.container_fs: the editor's file system inside a real container."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from crl_gym.envs.swebench.container_fs import ContainerFS
from crl_gym.envs.swebench.editor import Editor
from crl_gym.envs.swebench.image import BASE_IMAGE
from crl_gym.envs.swebench.sandbox import DockerSandbox, SandboxConfig
from crl_gym.envs.swebench.testing import require_docker
from crl_gym.envs.swebench.tools import ToolCallError


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

    def __init__(self, workdir: str, stage_dir: str) -> None:
        from types import SimpleNamespace

        self.config = SimpleNamespace(workdir=workdir)  # mirrors SandboxConfig.workdir
        self.stage_dir = stage_dir
        self.staged: list[bytes] = []

    def run(self, argv: list[str], *, timeout: float = 60.0) -> tuple[int | None, bytes]:
        import subprocess

        res = subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
        return res.returncode, res.stdout + res.stderr

    def stage(self, data: bytes) -> str:
        import os

        self.staged.append(data)
        path = os.path.join(self.stage_dir, "edit")
        with open(path, "wb") as f:
            f.write(data)
        return path


def test_any_object_with_the_protocol_is_a_sandbox(tmp_path: Any) -> None:
    import os

    (tmp_path / "stage").mkdir()
    (tmp_path / "tree").mkdir()
    sb = LocalSandbox(str(tmp_path / "tree"), str(tmp_path / "stage"))
    fs = ContainerFS(sb)
    target = str(tmp_path / "tree" / "pkg" / "mod.py")
    fs.write_text(target, "x = 'é'\n")  # parents are created
    assert fs.read_text(target) == "x = 'é'\n" and fs.kind(target) == "file" and sb.staged == ["x = 'é'\n".encode()]
    umask = os.umask(0o022)
    os.umask(umask)
    assert (tmp_path / "tree" / "pkg" / "mod.py").stat().st_mode & 0o777 == 0o666 & ~umask  # a new file: 0644
    (tmp_path / "tree" / "pkg" / "mod.py").chmod(0o755)
    fs.write_text(target, "x = 2\n")  # a rewrite keeps the mode
    assert (tmp_path / "tree" / "pkg" / "mod.py").stat().st_mode & 0o777 == 0o755
    assert fs.list_dir(str(tmp_path / "tree" / "pkg")) == [target]
    with pytest.raises(OSError, match="No such file"):
        fs.read_text(str(tmp_path / "tree" / "absent.txt"))
    with pytest.raises(ToolCallError, match="outside the work tree"):
        fs.write_text(str(tmp_path / "outside.py"), "x")
    assert not (tmp_path / "outside.py").exists()


# -- the editor's writes stay in the work tree, even when a path is swapped under it ------------
@pytest.fixture()
def tree() -> Iterator[DockerSandbox]:
    """A fresh sandbox whose work tree is /testbed, with a root-owned directory outside it."""
    client: Any = require_docker()
    with DockerSandbox(BASE_IMAGE, SandboxConfig(mem_limit="256m", pids_limit=64), client).start() as sb:
        code, out = sb.run(["bash", "-c", "mkdir -m 755 /tmp/rootonly && echo 'x = 1' > /tmp/rootonly/mod.py"],
                           user="root")
        assert code == 0, out
        assert sb.exec("mkdir pkg && echo 'x = 1' > pkg/mod.py && echo ok").output.strip() == "ok"
        yield sb


def _outside(sb: DockerSandbox) -> str:
    """The root-owned directory outside the work tree, as root sees it: names, owners, contents."""
    code, out = sb.run(["bash", "-c", "cd /tmp/rootonly && stat -c '%n %U' * && cat *"], user="root")
    return out.decode()


@pytest.mark.docker
@pytest.mark.parametrize("params", [
    {"command": "create", "path": "pkg/evil.py", "file_text": "owned = True\n"},
    {"command": "str_replace", "path": "pkg/mod.py", "old_str": "x = 1", "new_str": "owned = True"},
    {"command": "insert", "path": "pkg/mod.py", "insert_line": "0", "new_str": "owned = True"},
])
def test_a_symlink_swapped_after_the_path_check_does_not_redirect_the_write(
        tree: DockerSandbox, monkeypatch: pytest.MonkeyPatch, params: dict[str, str]) -> None:
    checked = Editor.resolve

    def check_then_swap(self: Editor, path: str) -> str:
        resolved = checked(self, path)
        # the agent's own process swaps the checked directory for a link out of the work tree
        assert tree.exec("mv pkg pkg.moved && ln -s /tmp/rootonly pkg && echo swapped").output.strip() == "swapped"
        return resolved

    monkeypatch.setattr(Editor, "resolve", check_then_swap)
    before = _outside(tree)
    try:
        shown = Editor(tree.fs).run(params)
    except ToolCallError as exc:
        shown = f"ERROR: {exc}"
    assert _outside(tree) == before, "the editor wrote outside the work tree"
    assert "owned" not in before and "mod.py root" in before
    assert shown.startswith("ERROR: Refused"), shown


@pytest.mark.docker
def test_the_file_api_itself_refuses_links_out_of_the_work_tree(tree: DockerSandbox) -> None:
    assert tree.exec("ln -s /tmp/rootonly out && ln -s /etc etc && echo ok").output.strip() == "ok"
    before = _outside(tree)
    with pytest.raises(ToolCallError, match="outside the work tree"):
        tree.fs.write_text("/testbed/out/evil.py", "owned = True\n")
    with pytest.raises(ToolCallError, match="outside the work tree"):
        tree.fs.write_text("/testbed/out/mod.py", "owned = True\n")
    with pytest.raises(ToolCallError, match="outside the work tree"):
        tree.fs.read_text("/testbed/etc/hostname")
    assert _outside(tree) == before


@pytest.mark.docker
def test_links_inside_the_work_tree_are_written_through_and_kept(tree: DockerSandbox) -> None:
    assert tree.exec("ln -s pkg/mod.py alias.py && ln -s pkg dir && echo ok").output.strip() == "ok"
    tree.fs.write_text("/testbed/alias.py", "y = 2\n")
    tree.fs.write_text("/testbed/dir/new.py", "z = 3\n")
    res = tree.exec("cat pkg/mod.py pkg/new.py; stat -c '%F %U' alias.py dir pkg/new.py")
    assert res.output.splitlines() == ["y = 2", "z = 3", "symbolic link agent", "symbolic link agent",
                                      "regular file agent"]
    assert tree.fs.read_text("/testbed/alias.py") == "y = 2\n"
