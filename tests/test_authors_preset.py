"""``configs/authors_minihack.yaml`` runs end to end on CPU with the tiny models substituted, by the
exact command docs/training.md gives (read from the docs, so the two cannot drift apart)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from crl_train.config import load_config

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _documented_command() -> list[str]:
    text = (REPO / "docs" / "training.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(crl-train --config configs/authors_minihack\.yaml.*?)```", text, re.S)
    assert block is not None, "docs/training.md lost the authors' preset command"
    return shlex.split(block.group(1).replace("\\\n", " "))


def test_the_preset_keeps_the_authors_retrieval_settings() -> None:
    cfg = load_config(REPO / "configs" / "authors_minihack.yaml")
    m, x = cfg.manager, cfg.experience
    assert (m.diversity_lambda, m.recency_window_s, m.overfetch, m.top1_dropout) == (0.4, 300.0, 16, 0.5)
    assert (m.batch_size, m.max_wait_ms, m.cache_size, m.num_workers) == (32, 5.0, 1000, 4)
    assert (m.bank_capacity, m.bank_eviction, x.warmup_steps, x.retrieve) == (20000, "fifo", 5, "episode")
    assert x.entries_per_episode == 1 and cfg.algo.gate.enabled and not cfg.algo.self_distill
    assert (cfg.env.tasks_per_step, cfg.env.group_size, cfg.train.steps, cfg.algo.cooldown) == (16, 8, 512, 1)


def test_documented_overrides_touch_sizes_and_models_only() -> None:
    args = _documented_command()
    keys = {a.split("=", 1)[0] for a, prev in zip(args[1:], args[:-1], strict=True) if prev == "--set"}
    retrieval = {k for k in keys if k.startswith("manager.") or k == "experience.retrieve"}
    assert not retrieval, f"the documented run overrides the authors' retrieval: {retrieval}"


@pytest.mark.slow
def test_authors_preset_two_steps_on_cpu(tmp_path: Path) -> None:
    args = _documented_command()
    out = args.index("--out")
    args[out + 1] = str(tmp_path / "run")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, env=env,
                          timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    # warm-up (1 step here): step 0 ran every copy free
    reqs = [json.loads(x) for x in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    assert {r["condition"] for r in reqs if r["rollout_step"] == 0} == {"free"}
    assert {r["condition"] for r in reqs if r["rollout_step"] == 1} == {"guided", "free"}
