"""Grade a patch the way SWE-bench does: fresh container, apply, run the tests, parse, compare.

The test command and the log parser come from swebench's own data where the instance has them
(SWE-bench ≥ 5 instances carry ``eval_script``, ``log_parser`` and ``eval_type``; the parser
for a known repo comes from ``MAP_REPO_TO_PARSER_PY``). An instance made for this project
(e.g. the test fixture) registers its command in ``test_cmd``; its eval script is then written
in swebench's shape (reset the test files, apply ``test_patch``, run the command between the
start/end markers, reset again). Parsing and the FAIL_TO_PASS / PASS_TO_PASS verdict are
``swebench.harness.grading.get_eval_report``, unchanged.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swebench.harness.constants import (
    END_TEST_OUTPUT,
    FAIL_ONLY_REPOS,
    START_TEST_OUTPUT,
    TESTS_ERROR,
    EvalType,
)
from swebench.harness.grading import get_eval_report
from swebench.harness.log_parsers import PARSER_REGISTRY
from swebench.harness.log_parsers.python import MAP_REPO_TO_PARSER_PY
from swebench.harness.run_evaluation import GIT_APPLY_CMDS
from swebench.harness.utils import make_test_spec
from swebench.types import TestSpec

from crl_gym.envs.swebench.sandbox import DockerSandbox, SandboxConfig
from crl_gym.json_types import JSONDict

if TYPE_CHECKING:
    from docker import DockerClient

    from crl_gym.envs.swebench.tasks import SWEInstance

PATCH_FILE = "/tmp/patch.diff"
HEREDOC = "EOF_114329324912"  # swebench's own heredoc delimiter for test patches
_DIFF_FILE_RE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.M)


@dataclass
class GradeResult:
    """The verdict on one submitted patch."""

    resolved: bool
    reason: str
    """Why it was (not) resolved, in one line."""
    report: dict[str, Any] = field(default_factory=dict)
    """swebench's per-instance report (``patch_successfully_applied``, ``tests_status``, …)."""
    log: str = ""
    """The test run's output (or the patch tool's, when the patch did not apply)."""
    duration: float = 0.0

    @property
    def reward(self) -> float:
        return 1.0 if self.resolved else 0.0

    def to_info(self, max_log: int = 4000) -> JSONDict:
        return {
            "resolved": self.resolved,
            "reward": self.reward,
            "reason": self.reason,
            "report": self.report,
            "log_tail": self.log[-max_log:],
            "duration": self.duration,
        }


def patch_files(test_patch: str) -> list[str]:
    """Paths a test patch touches (``b/`` side), in order.

    >>> patch_files("diff --git a/tests/test_x.py b/tests/test_x.py\\n--- a/tests/test_x.py\\n")
    ['tests/test_x.py']
    """
    return list(dict.fromkeys(m.group(2) for m in _DIFF_FILE_RE.finditer(test_patch)))


def log_parser_name(instance: SWEInstance) -> str:
    """The swebench log parser for an instance: its own, its repo's, or the pytest parser."""
    name = instance.get("log_parser")
    if not name and instance.get("repo") in MAP_REPO_TO_PARSER_PY:
        name = MAP_REPO_TO_PARSER_PY[instance["repo"]].__name__
    name = name or "parse_log_pytest"
    if name not in PARSER_REGISTRY:
        raise ValueError(f"instance {instance.get('instance_id')!r}: unknown log_parser {name!r}")
    return str(name)


def eval_script(instance: SWEInstance, workdir: str = "/testbed") -> str:
    """The bash script that applies ``test_patch`` and runs the instance's tests."""
    if instance.get("eval_script"):
        return str(instance["eval_script"])
    cmd = instance.get("test_cmd")
    if not cmd:
        raise ValueError(
            f"instance {instance.get('instance_id')!r} has no test command: give it `eval_script` "
            "(SWE-bench >= 5 datasets) or register one in `test_cmd`"
        )
    base = instance["base_commit"]
    files = " ".join(patch_files(instance.get("test_patch", "")))
    reset = f"git checkout {base} -- {files} 2>/dev/null || true" if files else "true"
    lines = [
        "#!/bin/bash",
        "set -uxo pipefail",
        f"cd {workdir}",
        reset,
    ]
    if instance.get("test_patch", "").strip():
        lines += [
            f"git apply -v - <<'{HEREDOC}' || {{ echo '{TESTS_ERROR}: test_patch did not apply'; "
            "exit 1; }",
            instance["test_patch"].rstrip("\n"),
            HEREDOC,
        ]
    lines += [f": '{START_TEST_OUTPUT}'", str(cmd), f": '{END_TEST_OUTPUT}'", reset]
    return "\n".join(lines) + "\n"


def make_spec(instance: SWEInstance, image: str) -> TestSpec:
    """swebench's ``TestSpec`` for an instance (built with ``make_test_spec``)."""
    repo = str(instance.get("repo", ""))
    eval_type = instance.get("eval_type") or (
        EvalType.FAIL_ONLY.value if repo in FAIL_ONLY_REPOS else EvalType.PASS_AND_FAIL.value
    )
    return make_test_spec(
        {
            "instance_id": instance["instance_id"],
            "image": image,
            "repo": repo,
            "version": str(instance.get("version", "")),
            "FAIL_TO_PASS": instance["FAIL_TO_PASS"],
            "PASS_TO_PASS": instance["PASS_TO_PASS"],
            "log_parser": log_parser_name(instance),
            "eval_type": eval_type,
            "eval_script": eval_script(instance),
        }
    )


def grade_log(spec: TestSpec, log_text: str, patch: str) -> JSONDict:
    """swebench's report for one test log (pure: no Docker)."""
    with tempfile.TemporaryDirectory(prefix="crl-grade-") as tmp:
        path = Path(tmp) / "test_output.txt"
        path.write_text(log_text)
        prediction = {
            "instance_id": spec.instance_id,
            "model_name_or_path": "crl",
            "model_patch": patch,
        }
        return get_eval_report(spec, prediction, str(path), include_tests_status=True)[
            spec.instance_id
        ]


def _reason(report: dict[str, Any]) -> str:
    if not report.get("patch_successfully_applied"):
        return "tests did not run to completion (no parseable test output)"
    if report.get("resolved"):
        return "resolved: all FAIL_TO_PASS and PASS_TO_PASS tests pass"
    status = report.get("tests_status", {})
    f2p = status.get("FAIL_TO_PASS", {}).get("failure", [])
    p2p = status.get("PASS_TO_PASS", {}).get("failure", [])
    return (
        f"not resolved: {len(f2p)} FAIL_TO_PASS and {len(p2p)} PASS_TO_PASS test(s) failing "
        + json.dumps({"FAIL_TO_PASS": f2p[:5], "PASS_TO_PASS": p2p[:5]})
    )


def grading_config(config: SandboxConfig | None, timeout: float) -> SandboxConfig:
    """The limits of a grading container: the episode's, with the grading's own time limit."""
    cfg = config or SandboxConfig()
    return SandboxConfig(
        **{
            **cfg.__dict__,
            "episode_timeout": timeout + 120.0,
            "command_timeout": timeout,
            "max_command_timeout": timeout,
        }
    )


def grade_patch(
    instance: SWEInstance,
    patch: str,
    image: str,
    *,
    client: DockerClient,
    config: SandboxConfig | None = None,
    timeout: float = 900.0,
    sandbox: DockerSandbox | None = None,
) -> GradeResult:
    """Apply ``patch`` and the test patch in a FRESH container and grade with swebench.

    ``sandbox``: a started container of ``image`` that no agent command has touched (the env
    starts one while the episode runs); it is used and removed. Without it one is started here.
    """
    t0 = time.monotonic()
    if not patch.strip():
        if sandbox is not None:
            sandbox.close()
        return GradeResult(
            False, "empty patch: the work tree has no changes", duration=time.monotonic() - t0
        )
    try:
        spec = make_spec(instance, image)
    except Exception:
        if sandbox is not None:
            sandbox.close()
        raise
    if sandbox is None:
        sandbox = DockerSandbox(image, grading_config(config, timeout), client).start()
    sandbox.started_at = (
        time.monotonic()
    )  # its budget counts from the grading, not from its prestart
    with sandbox:
        sandbox.put_file(PATCH_FILE, patch.encode("utf-8"))
        applied, tool_out = False, b""
        for attempt, cmd in enumerate(GIT_APPLY_CMDS):
            if attempt:  # a failed attempt can leave partial state behind
                sandbox.run(["bash", "-c", "git checkout -- . ; git clean -fdq"], timeout=120.0)
            code, tool_out = sandbox.run(["bash", "-c", f"{cmd} {PATCH_FILE}"], timeout=120.0)
            if code == 0:
                applied = True
                break
        if not applied:
            code, _ = sandbox.run(
                ["git", "apply", "--check", "--reverse", PATCH_FILE], timeout=60.0
            )
            applied = code == 0
        if not applied:
            out = tool_out.decode("utf-8", "replace")
            return GradeResult(
                False,
                "patch does not apply: "
                f"{out.strip().splitlines()[-1] if out.strip() else 'no output'}",
                {"patch_exists": True, "patch_successfully_applied": False, "resolved": False},
                out,
                time.monotonic() - t0,
            )
        sandbox.put_file("/tmp/eval.sh", spec.eval_script.encode("utf-8"), 0o755)
        code, raw = sandbox.run(
            ["bash", "-c", f"{sandbox.config.env_setup}/bin/bash /tmp/eval.sh 2>&1"],
            timeout=timeout,
        )
    log_text = raw.decode("utf-8", "replace")
    if code is None:
        return GradeResult(
            False,
            f"tests timed out after {timeout:.0f} s",
            {"patch_successfully_applied": True, "resolved": False},
            log_text,
            time.monotonic() - t0,
        )
    report = grade_log(spec, log_text, patch)
    return GradeResult(
        bool(report.get("resolved")), _reason(report), report, log_text, time.monotonic() - t0
    )
