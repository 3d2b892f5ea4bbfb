"""Held-out evaluation of a run's actor, with and without retrieved experience (``crl-eval``)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from crl_gym.protocol import GUIDED_CONDITION
from crl_train.config import TrainConfig
from crl_train.rollout.tasks import eval_task_seeds
from crl_train.run.stats import LEVEL, mean_t, ratio_of_means, wilson
from crl_train.run.trainer import Trainer


def evaluate_run(trainer: Trainer, episodes: int, modes: tuple[bool, ...] = (True, False)) -> dict[str, Any]:
    """Held-out episodes (seeds from ``env.eval_seed_offset``) with and/or without experience; writes eval.json.

    Per mode: ``success`` with its Wilson interval, ``actions_per_episode`` with its t interval;
    with both modes, ``internalisation`` = success without / with experience, bootstrap interval
    (``crl_train.run.stats``). Every interval is 95 %.
    """
    cfg: TrainConfig = trainer.cfg
    runner = trainer.c.runner
    groups = max(1, -(-episodes // cfg.env.group_size))
    result: dict[str, Any] = {"episodes_per_mode": groups * cfg.env.group_size, "level": LEVEL}
    outcomes: dict[str, list[float]] = {}
    for with_exp in modes:
        if with_exp and not trainer.method.guided:
            continue
        with torch.no_grad():
            if with_exp:  # only the guided half of each group counts: run twice as many groups
                eps = [e for e in runner.collect(eval_task_seeds(cfg.env, 2 * groups), guided=True, step=-1)
                       if e.condition == GUIDED_CONDITION]
            else:
                eps = runner.collect(eval_task_seeds(cfg.env, groups), guided=False, step=-1)
        key = "with_experience" if with_exp else "without_experience"
        outcomes[key] = [1.0 if e.success else 0.0 for e in eps]
        rate = wilson(sum(e.success for e in eps), len(eps))
        actions = mean_t([float(e.num_actions) for e in eps])
        by_env = {}
        for env in dict.fromkeys(e.env_id for e in eps):
            r = wilson(sum(e.success for e in eps if e.env_id == env), sum(e.env_id == env for e in eps))
            by_env[env] = {"success": r.value, "success_ci": [r.low, r.high], "episodes": r.n}
        result[key] = {"success": rate.value, "success_ci": [rate.low, rate.high],
                       "actions_per_episode": actions.value, "actions_per_episode_ci": [actions.low, actions.high],
                       "episodes": len(eps), "by_env": by_env}
    if len(outcomes) == 2:
        ratio = ratio_of_means(outcomes["without_experience"], outcomes["with_experience"])
        result["internalisation"] = {"ratio": ratio.value, "ratio_ci": [ratio.low, ratio.high]}
    # evaluation episodes are held out: their requests (of no training step) must not reach the bank
    trainer.c.client.get_requests(10**9)
    (trainer.run_dir / "eval.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    return result


def evaluate_dir(cfg: TrainConfig, run_dir: Path, episodes: int, modes: tuple[bool, ...] = (True, False),
                 env_factory: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """``crl-eval``: the run's checkpoint on held-out seeds. The run is left as it was: retrieval
    counts, pending requests and the index change on a copy of ``bank/``, deleted afterwards."""
    with tempfile.TemporaryDirectory(prefix="crl_eval_") as tmp:
        bank_copy = Path(tmp) / "bank"
        if (run_dir / "bank").is_dir():
            shutil.copytree(run_dir / "bank", bank_copy, ignore=shutil.ignore_patterns("*.lock"))
        trainer = Trainer(cfg, run_dir, read_only=True, eval_bank_dir=bank_copy, progress=False, env_factory=env_factory)
        try:
            return evaluate_run(trainer, episodes, modes)
        finally:
            trainer.close()
