"""crl/SWEBench-v0 end to end: scripted agents act through the tools in a real container."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from crl_gym.envs import make
from crl_gym.envs.swebench.env import SWEBenchEnv
from crl_gym.envs.swebench.filter import run_episode
from crl_gym.envs.swebench.image import instance_image
from crl_gym.envs.swebench.sandbox import SandboxConfig
from crl_gym.envs.swebench.testing import (
    fixing_agent,
    make_demo_instance,
    require_docker,
    wrong_agent,
)
from crl_gym.envs.swebench.tools import format_tool_call


@pytest.fixture(scope="module")
def instance(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return make_demo_instance(tmp_path_factory.mktemp("env"))


def test_env_needs_valid_tasks(instance: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="needs tasks"):
        SWEBenchEnv()
    with pytest.raises(ValueError, match="missing field"):
        SWEBenchEnv(tasks=[{"instance_id": "x"}])
    env = SWEBenchEnv(tasks=[instance])  # no container before reset
    with pytest.raises(RuntimeError, match="reset"):
        env.step(format_tool_call("submit"))


@pytest.fixture(scope="module")
def client(instance: dict[str, Any]) -> Iterator[Any]:
    client = require_docker()
    yield client
    client.images.remove(instance_image(client, instance).name, force=True)


@pytest.fixture()
def env(instance: dict[str, Any], client: Any) -> Iterator[Any]:
    env = make("crl/SWEBench-v0", tasks=[instance], max_turns=6, client=client, render_mode="ansi",
               sandbox_config=SandboxConfig(command_timeout=5))
    yield env
    env.close()


@pytest.mark.docker
def test_fixing_agent_is_graded_one(env: Any, instance: dict[str, Any]) -> None:
    success, info = run_episode(env.unwrapped, fixing_agent, instance["instance_id"])
    assert success and info["grading"]["reward"] == 1.0
    assert info["grading"]["report"]["tests_status"]["FAIL_TO_PASS"]["success"] == ["tests/test_ops.py::test_mul"]
    assert "+    return a * b" in info["patch"]
    assert env.unwrapped.sandbox is None  # the agent's container is gone after submit


@pytest.mark.docker
def test_wrong_agent_is_graded_zero(env: Any, instance: dict[str, Any]) -> None:
    success, info = run_episode(env.unwrapped, wrong_agent, instance["instance_id"])
    assert not success and info["grading"]["reward"] == 0.0
    assert info["grading"]["report"]["tests_status"]["PASS_TO_PASS"]["failure"] == ["tests/test_ops.py::test_add"]


@pytest.mark.docker
def test_turns_errors_and_limits(env: Any, instance: dict[str, Any]) -> None:
    obs, info = env.reset(options={"instance_id": instance["instance_id"]})
    assert instance["problem_statement"] in obs and "<function=" in obs
    assert info["task"] == instance["problem_statement"] and info["turn"] == 0
    assert env.render() == obs

    obs, reward, term, trunc, info = env.step("I think I will just think.")
    assert "ERROR: No tool call found" in obs and not (term or trunc) and reward == 0.0
    obs, *_ = env.step(format_tool_call("str_replace_editor", command="view", path="/etc/passwd"))
    assert "outside the work tree" in obs
    obs, *_, info = env.step(format_tool_call("execute_bash", command="sleep 10000", timeout="2"))
    assert info["timed_out"] and "timed out after 2 s" in obs
    obs, *_ = env.step(format_tool_call("execute_bash", command="python3 -m pytest -q tests 2>&1 | tail -1"))
    assert "1 passed" in obs and "[exit code: 0]" in obs
    obs, *_ = env.step(format_tool_call("str_replace_editor", command="create", path="notes.txt", file_text="hi"))
    assert "created" in obs
    obs, reward, term, trunc, info = env.step(format_tool_call("execute_bash", command="cat notes.txt"))
    assert trunc and not term and info["turn"] == 6 and info["success"] is False
    assert "turn limit" in info["error"]
    assert env.unwrapped.stats["malformed_calls"] == 2
    with pytest.raises(KeyError, match="unknown instance_id"):
        env.reset(options={"instance_id": "nope"})
