"""Grading with swebench's parsers and report functions: pure log checks, then real containers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crl_gym.envs.swebench.grading import (
    eval_script,
    grade_log,
    grade_patch,
    log_parser_name,
    make_spec,
    patch_files,
)
from crl_gym.envs.swebench.image import instance_image
from crl_gym.envs.swebench.testing import make_demo_instance, require_docker

FIX = (
    "diff --git a/calc/ops.py b/calc/ops.py\n--- a/calc/ops.py\n+++ b/calc/ops.py\n"
    "@@ -3,4 +3,4 @@ def add(a, b):\n \n \n def mul(a, b):\n-    return a + b\n+    return a * b\n"
)


@pytest.fixture(scope="module")
def instance(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return make_demo_instance(tmp_path_factory.mktemp("grading"))


def _log(body: str) -> str:
    return f"+ : '>>>>> Start Test Output'\n{body}\n+ : '>>>>> End Test Output'\n"


def test_eval_script_has_swebench_shape(instance: dict[str, Any]) -> None:
    script = eval_script(instance)
    assert patch_files(instance["test_patch"]) == ["tests/test_ops.py"]
    assert f"git checkout {instance['base_commit']} -- tests/test_ops.py" in script
    assert script.index("git apply -v -") < script.index(">>>>> Start Test Output") < script.index(instance["test_cmd"])
    spec = make_spec(instance, "img")
    # make_test_spec records the test command's exit status right after it
    assert any("SWEBENCH_TEST_EXIT_CODE=$?" in line for line in spec.eval_script_list)
    assert log_parser_name(instance) == "parse_log_pytest"
    assert log_parser_name({"repo": "django/django"}) == "parse_log_django"
    with pytest.raises(ValueError, match="test command"):
        eval_script({**instance, "test_cmd": None})


def test_grade_log_resolved_and_not(instance: dict[str, Any]) -> None:
    spec = make_spec(instance, "img")
    good = grade_log(spec, _log("PASSED tests/test_ops.py::test_add\nPASSED tests/test_ops.py::test_mul"), FIX)
    assert good["resolved"] and good["patch_successfully_applied"]
    bad = grade_log(spec, _log("PASSED tests/test_ops.py::test_add\nFAILED tests/test_ops.py::test_mul - assert 5 == 6"), FIX)
    assert not bad["resolved"]
    assert bad["tests_status"]["FAIL_TO_PASS"]["failure"] == ["tests/test_ops.py::test_mul"]
    broke_p2p = grade_log(spec, _log("FAILED tests/test_ops.py::test_add\nPASSED tests/test_ops.py::test_mul"), FIX)
    assert not broke_p2p["resolved"]
    no_markers = grade_log(spec, "PASSED tests/test_ops.py::test_add\nPASSED tests/test_ops.py::test_mul", FIX)
    assert not no_markers["resolved"] and not no_markers["patch_successfully_applied"]


@pytest.fixture(scope="module")
def client() -> Any:
    return require_docker()


@pytest.fixture(scope="module")
def image(client: Any, instance: dict[str, Any]) -> Iterator[str]:
    choice = instance_image(client, instance)
    assert choice.kind == "built"
    yield choice.name
    client.images.remove(choice.name, force=True)


@pytest.mark.docker
def test_correct_patch_is_resolved(instance: dict[str, Any], image: str, client: Any) -> None:
    result = grade_patch(instance, FIX, image, client=client, timeout=120)
    assert result.resolved and result.reward == 1.0, result.log
    assert result.report["tests_status"]["FAIL_TO_PASS"]["success"] == ["tests/test_ops.py::test_mul"]


@pytest.mark.docker
def test_wrong_empty_and_broken_patches_get_zero(instance: dict[str, Any], image: str, client: Any) -> None:
    wrong = FIX.replace("a * b", "a ** b")  # 2 ** 3 = 8, not 6
    result = grade_patch(instance, wrong, image, client=client, timeout=120)
    assert not result.resolved and result.reward == 0.0
    assert "FAIL_TO_PASS" in result.reason and result.report["patch_successfully_applied"]
    empty = grade_patch(instance, "  \n", image, client=client)
    assert empty.reward == 0.0 and "empty patch" in empty.reason
    broken = grade_patch(instance, FIX.replace("return a + b", "return a - b"), image, client=client)
    assert broken.reward == 0.0 and broken.reason.startswith("patch does not apply")
    assert broken.report["patch_successfully_applied"] is False


@pytest.mark.docker
def test_repository_history_stops_at_base_commit(instance: dict[str, Any], image: str, client: Any) -> None:
    from crl_gym.envs.swebench.sandbox import DockerSandbox, SandboxConfig

    with DockerSandbox(image, SandboxConfig(), client).start() as sb:
        res = sb.exec("git rev-parse HEAD; git log --all --oneline | wc -l; git status --porcelain | wc -l")
    head, n_commits, dirty = res.output.split()
    assert head == instance["base_commit"] and n_commits == "1" and dirty == "0"


def test_test_files_of_multi_file_patch() -> None:
    patch = "diff --git a/t/a.py b/t/a.py\n+x\ndiff --git a/t/b.py b/t/b.py\n+y\ndiff --git a/t/a.py b/t/a.py\n"
    assert patch_files(patch) == ["t/a.py", "t/b.py"]
    assert Path("t/a.py").name == "a.py"
