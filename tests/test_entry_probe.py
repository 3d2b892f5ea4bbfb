"""scripts/entry_probe.py: the episodes it distils, what it counts, the inputs it refuses.

The oracle extractor stands in for a model here: it writes each success's winning actions and
returns on each failure, so every count the probe reports is known by hand.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from crl_train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
RECALL = "env.kwargs={num_tasks: 8, length: 1, num_actions: 2}"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("entry_probe", ROOT / "scripts" / "entry_probe.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


probe_script = _script()


def test_episodes_are_half_successes_and_reproducible() -> None:
    cfg = load_config(ROOT / "configs" / "small.yaml", [RECALL, "env.max_turns=2"])
    first = probe_script.play_episodes(cfg, 6, seed=0)
    again = probe_script.play_episodes(cfg, 6, seed=0)
    assert [r.success for r in first] == [True, True, True, False, False, False]
    assert [r.seed for r in first] == [r.seed for r in again]
    for r in first:
        steps = r.trajectory.steps
        assert 1 <= len(steps) <= 2
        # Recall: the last right action pays 1, the first wrong one ends the episode with 0
        assert r.outcome == (1.0 if r.success else 0.0)
        assert all(s.action in s.info["admissible_actions"] for s in steps)


def test_counts_with_the_oracle() -> None:
    cfg = load_config(ROOT / "configs" / "small.yaml", [RECALL, "extractor.model=oracle"])
    requests = probe_script.play_episodes(cfg, 6, seed=1)
    result = probe_script.probe(cfg, requests, batch=4)
    assert result["requests"] == 6
    # 3 successes: the oracle's entry holds the secret; 3 failures: a Return, nothing added
    assert result["holds_secret"]["count"] == 3
    assert result["holds_secret_after_success"]["count"] == 3
    assert result["holds_secret_after_failure"]["count"] == 0
    assert result["reader_plays_secret"]["count"] == 3
    assert result["names_action"]["count"] == 3
    assert result["returns"]["count"] == 3
    value, low, high = result["holds_secret"]["share_ci95"]
    assert value == pytest.approx(0.5) and 0.0 < low < 0.5 < high < 1.0  # Wilson interval of 3 in 6


def test_main_writes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "probe.json"
    code = probe_script.main(["--set", RECALL, "--set", "extractor.model=oracle", "--episodes", "4",
                              "--temperatures", "1.0", "--out", str(out)])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report == json.loads(out.read_text())
    assert report["by_temperature"]["1.0"]["holds_secret"]["count"] == 2


@pytest.mark.parametrize("args", [
    ["--set", "extractor.model=tiny"],                       # no tokenizer of its own
    ["--set", "env.ids=[crl/MiniHack-Room-5x5-v0]"],          # no secrets to count
    ["--episodes", "1"],
])
def test_refuses(args: list[str]) -> None:
    with pytest.raises(SystemExit) as err:
        probe_script.main(args)
    assert err.value.code == 2
