"""Helpers for tests, benchmarks and docs: a tiny SWE-bench instance and the Docker gate.

:func:`make_demo_instance` writes a small Python package with a bug (``mul`` adds), commits it
with git, and returns a SWE-bench instance dict for it: the ``test_patch`` adds the failing test
``test_mul`` (FAIL_TO_PASS) next to the passing ``test_add`` (PASS_TO_PASS), ``repo_path``
points at the checkout and ``test_cmd`` is the registered test command.

:func:`require_docker` is the gate of the Docker tests: without an engine they skip with the
reason locally, and FAIL when the ``CI`` environment variable is set, so CI never passes by
skipping them.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from crl_gym.envs.swebench.tools import format_tool_call
from crl_gym.json_types import JSONDict

if TYPE_CHECKING:
    from docker import DockerClient

OPS = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a + b\n"
OLD_TESTS = "from calc.ops import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
NEW_TESTS = (
    OLD_TESTS.replace("import add", "import add, mul")
    + "\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"
)
TEST_CMD = "python3 -m pytest -rA -p no:cacheprovider tests/test_ops.py"


def _git(cwd: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "crl",
        "GIT_AUTHOR_EMAIL": "crl@example.invalid",
        "GIT_COMMITTER_NAME": "crl",
        "GIT_COMMITTER_EMAIL": "crl@example.invalid",
    }
    proc = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed: {proc.stderr}")
    return proc.stdout.strip()


def make_demo_instance(root: str | Path, instance_id: str = "calc__calc-1") -> JSONDict:
    """Create the buggy ``calc`` repository under ``root`` and return its SWE-bench instance."""
    repo = Path(root) / "calc"
    (repo / "calc").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "calc" / "__init__.py").write_text("")
    (repo / "calc" / "ops.py").write_text(OPS)
    (repo / "tests" / "__init__.py").write_text("")
    (repo / "tests" / "test_ops.py").write_text(OLD_TESTS)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "calc: add and mul")
    base = _git(repo, "rev-parse", "HEAD")
    # The test patch is what the fix's PR added; it is NOT committed (the agent must not see it).
    (repo / "tests" / "test_ops.py").write_text(NEW_TESTS)
    test_patch = _git(repo, "diff") + "\n"
    _git(repo, "checkout", "-q", "--", ".")
    return {
        "instance_id": instance_id,
        "repo": "crl/calc",
        "base_commit": base,
        "version": "0.1",
        "problem_statement": "calc.ops.mul returns the sum instead of the product: mul(2, 3) == 5, "
        "expected 6.",
        "hints_text": "",
        "created_at": "2025-01-01T00:00:00Z",
        "environment_setup_commit": base,
        "patch": "",
        "test_patch": test_patch,
        "FAIL_TO_PASS": ["tests/test_ops.py::test_mul"],
        "PASS_TO_PASS": ["tests/test_ops.py::test_add"],
        "repo_path": str(repo),
        "test_cmd": TEST_CMD,
    }


def _scripted(messages: list[dict[str, str]], script: list[str]) -> str:
    """The script's reply for this turn (one per assistant message so far); the last one repeats."""
    turn = sum(1 for m in messages if m["role"] == "assistant")
    return script[min(turn, len(script) - 1)]


def fixing_agent(messages: list[dict[str, str]]) -> str:
    """A scripted agent that fixes the demo bug through the tools, then submits."""
    return _scripted(
        messages,
        [
            format_tool_call("execute_bash", command="grep -n 'def mul' -A1 calc/ops.py"),
            format_tool_call(
                "str_replace_editor",
                command="str_replace",
                path="/testbed/calc/ops.py",
                old_str="def mul(a, b):\n    return a + b",
                new_str="def mul(a, b):\n    return a * b",
            ),
            format_tool_call("submit"),
        ],
    )


def wrong_agent(messages: list[dict[str, str]]) -> str:
    """A scripted agent that submits a wrong fix (it breaks ``add`` and leaves ``mul``)."""
    return _scripted(
        messages,
        [
            format_tool_call(
                "str_replace_editor",
                command="str_replace",
                path="calc/ops.py",
                old_str="def add(a, b):\n    return a + b",
                new_str="def add(a, b):\n    return a - b",
            ),
            format_tool_call("submit"),
        ],
    )


def require_docker() -> DockerClient:
    """A Docker client with the base image, or skip (locally) / fail (``CI`` set) with
    the reason."""
    import pytest

    from crl_gym.envs.swebench.image import BASE_IMAGE, ImageError, ensure_base_image
    from crl_gym.envs.swebench.sandbox import DockerUnavailableError, docker_client

    try:
        client = docker_client()
        ensure_base_image(client)
        return client
    except (DockerUnavailableError, ImageError) as exc:
        reason = f"Docker sandbox tests need an engine and {BASE_IMAGE}: {exc}"
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI is set, so this fails instead of skipping)", pytrace=False)
        pytest.skip(reason)
