"""Task filtering by pass@k success rate, and the `crl-swe filter` command with real containers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from crl_gym.envs.swebench.cli import cli
from crl_gym.envs.swebench.filter import filter_tasks, keep, load_policy, pass_rates
from crl_gym.envs.swebench.image import instance_image
from crl_gym.envs.swebench.tasks import load_tasks, write_tasks
from crl_gym.envs.swebench.testing import make_demo_instance, require_docker


def test_keep_is_open_on_both_ends() -> None:
    # k = 16: 0/16 = 0 is dropped (never solved), 1/16 kept, 12/16 = 0.75 kept,
    # 13/16 = 0.8125 dropped (>= 0.8), 16/16 dropped
    assert [keep(n / 16, 0.0, 0.8) for n in (0, 1, 12, 13, 16)] == [False, True, True, False, False]
    assert not keep(0.8, 0.0, 0.8)


class CoinEnv:
    """A one-step stand-in env: the episode succeeds when the agent answers "fix"."""

    def reset(self, *, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self.iid = options["instance_id"]
        return f"task {self.iid}", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        ok = action == "fix"
        return "done", float(ok), True, False, {"success": ok}

    def close(self) -> None:
        pass


def test_pass_rates_count_successes_over_k() -> None:
    attempts: dict[str, int] = {}

    def make_agent() -> Any:
        def agent(messages: list[dict[str, str]]) -> str:
            iid = messages[0]["content"].split()[-1]
            attempts[iid] = attempts.get(iid, 0) + 1
            # "easy": always; "mid": attempts 1 and 3 of 4; "hard": never; "boom": raises
            if iid == "boom":
                raise RuntimeError("agent crashed")
            return "fix" if iid == "easy" or (iid == "mid" and attempts[iid] % 2 == 1) else "nope"
        return agent

    tasks = [{"instance_id": i} for i in ("easy", "mid", "hard", "boom")]
    kept, report = filter_tasks(tasks, CoinEnv, make_agent, k=4, low=0.0, high=0.8)
    # easy 4/4 = 1.0, mid 2/4 = 0.5, hard 0/4 = 0, boom 0/4 (4 errors counted as failures)
    assert report.rates == {"easy": 1.0, "mid": 0.5, "hard": 0.0, "boom": 0.0}
    assert [t["instance_id"] for t in kept] == ["mid"] == report.kept
    assert report.errors == {"boom": 4}
    with pytest.raises(ValueError, match="low < high"):
        filter_tasks(tasks, CoinEnv, make_agent, low=0.9, high=0.8)
    with pytest.raises(ValueError, match="k must be"):
        pass_rates(CoinEnv, make_agent, ["easy"], k=0)


def test_load_policy_from_file_module_and_factory(tmp_path: Path) -> None:
    policy = tmp_path / "agent.py"
    policy.write_text(
        "def act(messages):\n    return 'fix'\n\n"
        "def make_agent():\n    state = []\n    def agent(messages):\n        state.append(1)\n"
        "        return str(len(state))\n    return agent\n")
    assert load_policy(f"{policy}:act")()([]) == "fix"
    factory = load_policy(f"{policy}:make_agent")
    a, b = factory(), factory()
    assert (a([]), a([]), b([])) == ("1", "2", "1")  # one fresh agent per episode
    assert load_policy("crl_gym.envs.swebench.testing:fixing_agent")()([{"role": "user", "content": ""}]).startswith(
        "<function=execute_bash>")
    with pytest.raises(ValueError, match="expected"):
        load_policy("no_colon_here")
    with pytest.raises(FileNotFoundError):
        load_policy(f"{tmp_path}/missing.py:act")
    with pytest.raises(AttributeError, match="no attribute"):
        load_policy(f"{policy}:nothing")


def test_load_tasks_names_the_bad_line(tmp_path: Path) -> None:
    inst = make_demo_instance(tmp_path)
    good = tmp_path / "tasks.jsonl"
    write_tasks([{**inst, "FAIL_TO_PASS": json.dumps(inst["FAIL_TO_PASS"]), "repo_path": "calc"}], good)
    (loaded,) = load_tasks(good)
    assert loaded["FAIL_TO_PASS"] == ["tests/test_ops.py::test_mul"]  # decoded from the JSON string
    assert loaded["repo_path"] == str(tmp_path / "calc")  # relative to the file
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good.read_text() + '{"instance_id": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing field\(s\) repo"):
        load_tasks(bad)
    bad.write_text(good.read_text() + "{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        load_tasks(bad)
    with pytest.raises(ValueError, match="unknown instance id"):
        load_tasks([inst], instance_ids=["nope"])


@pytest.mark.docker
@pytest.mark.slow
def test_cli_filter_with_scripted_policies(tmp_path: Path) -> None:
    client = require_docker()
    inst = make_demo_instance(tmp_path)
    tasks = tmp_path / "tasks.jsonl"
    write_tasks([inst], tasks)
    policy = tmp_path / "policies.py"
    # alternate: attempt 1 fixes, attempt 2 submits without changes (an empty patch scores 0)
    policy.write_text(
        "from crl_gym.envs.swebench.testing import fixing_agent\n"
        "from crl_gym.envs.swebench.tools import format_tool_call\n"
        "N = [0]\n"
        "def make_alternating():\n"
        "    N[0] += 1\n"
        "    return fixing_agent if N[0] % 2 else (lambda messages: format_tool_call('submit'))\n")
    runner = CliRunner()
    try:
        out = tmp_path / "kept.jsonl"
        res = runner.invoke(cli, ["filter", "--tasks", str(tasks), "--policy", f"{policy}:make_alternating",
                                  "--k", "2", "--low", "0", "--high", "0.8", "--out", str(out)])
        assert res.exit_code == 0, res.output
        report = json.loads(res.output.strip().splitlines()[-1])
        assert report["rates"] == {inst["instance_id"]: 0.5} and report["n_kept"] == 1  # 1/2 in (0, 0.8)
        assert [t["instance_id"] for t in load_tasks(out)] == [inst["instance_id"]]
        res = runner.invoke(cli, ["filter", "--tasks", str(tasks), "--policy",
                                  "crl_gym.envs.swebench.testing:fixing_agent", "--k", "2", "--out", str(out)])
        assert res.exit_code == 0, res.output
        assert json.loads(res.output.strip().splitlines()[-1])["rates"] == {inst["instance_id"]: 1.0}
        assert out.read_text() == ""  # 2/2 = 1.0 is not below 0.8
    finally:
        client.images.remove(instance_image(client, inst).name, force=True)


def test_a_model_directory_loads_through_the_model_agent(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """crl_gym finds the model agent through its entry point group (crl_train registers it), or
    takes one as a parameter: it never imports crl_train itself."""
    import configparser
    import importlib
    from importlib.metadata import EntryPoint

    from crl_gym.envs.swebench import filter as swe_filter

    seen: list[tuple[Path, int]] = []

    def fake(directory: Path, max_new_tokens: int) -> Any:
        seen.append((directory, max_new_tokens))
        return lambda: (lambda messages: "patch")

    assert load_policy(str(tmp_path), max_new_tokens=7, model_agent=fake)()([]) == "patch"
    assert seen == [(tmp_path, 7)]
    monkeypatch.setattr(swe_filter, "entry_points", lambda group: [])
    with pytest.raises(ImportError, match=swe_filter.MODEL_AGENT_GROUP):
        load_policy(str(tmp_path))
    registered = EntryPoint("test", f"{__name__}:_fake_agent", swe_filter.MODEL_AGENT_GROUP)
    monkeypatch.setattr(swe_filter, "entry_points",
                        lambda group: [registered] if group == swe_filter.MODEL_AGENT_GROUP else [])
    assert load_policy(str(tmp_path), max_new_tokens=3)()([]) == "registered 3"
    # what setup.cfg registers (active once the package is installed) names crl_train's agent
    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    line = cfg["options.entry_points"][swe_filter.MODEL_AGENT_GROUP].strip()
    name, _, target = (part.strip() for part in line.partition("="))
    module, _, attr = target.partition(":")
    assert name == "crl_train" and callable(getattr(importlib.import_module(module), attr))


def _fake_agent(directory: Path, max_new_tokens: int) -> Any:
    return lambda: (lambda messages: f"registered {max_new_tokens}")
