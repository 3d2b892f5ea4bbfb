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
from crl_train.rollout.runner import Episode
from crl_train.rollout.tasks import eval_task_seeds
from crl_train.run.stats import (
    LEVEL,
    Interval,
    clustered_wilson,
    design_effect,
    mean_t,
    newcombe_difference,
    ratio_of_means,
)
from crl_train.run.trainer import Trainer


def evaluate_run(trainer: Trainer, episodes: int, modes: tuple[bool, ...] = (True, False)) -> dict[str, Any]:
    """Held-out episodes (seeds from ``env.eval_seed_offset``) with and/or without experience; writes eval.json.

    Each held-out task is played a group of times, and its episodes mostly agree, so the task is
    the unit of evidence. Per mode: ``success`` with its Wilson interval at ``effective_episodes``
    (episodes / design effect), ``tasks``, and ``actions_per_episode`` with its t interval; with both
    modes, ``experience_gain`` = success with − without experience (Newcombe interval) and
    ``internalisation`` = success without / with experience, bootstrap over tasks
    (``crl_train.run.stats``). Every interval is 95 %.
    """
    cfg: TrainConfig = trainer.cfg
    runner = trainer.c.runner
    groups = max(1, -(-episodes // cfg.env.group_size))
    result: dict[str, Any] = {"episodes_per_mode": groups * cfg.env.group_size, "level": LEVEL}
    outcomes: dict[str, list[float]] = {}
    rates: dict[str, Interval] = {}
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
        by_task = _outcomes_by_task(eps)
        outcomes[key] = [sum(o) / len(o) for o in by_task.values()]
        rate = rates[key] = clustered_wilson(list(by_task.values()))
        actions = mean_t([float(e.num_actions) for e in eps])
        by_env = {}
        for env in dict.fromkeys(e.env_id for e in eps):
            r = clustered_wilson([o for (env_id, _), o in by_task.items() if env_id == env])
            by_env[env] = {"success": r.value, "success_ci": [r.low, r.high], "episodes": r.n}
        result[key] = {"success": rate.value, "success_ci": [rate.low, rate.high],
                       "actions_per_episode": actions.value, "actions_per_episode_ci": [actions.low, actions.high],
                       "episodes": len(eps), "tasks": len(by_task),
                       "effective_episodes": len(eps) / design_effect(list(by_task.values())), "by_env": by_env}
    if len(outcomes) == 2:  # every task of a mode is played equally often: the mean of task means is the rate
        ratio = ratio_of_means(outcomes["without_experience"], outcomes["with_experience"])
        result["internalisation"] = {"ratio": ratio.value, "ratio_ci": [ratio.low, ratio.high]}
        gain = newcombe_difference(rates["with_experience"], rates["without_experience"])
        result["experience_gain"] = {"difference": gain.value, "difference_ci": [gain.low, gain.high]}
    # evaluation episodes are held out: their requests (of no training step) must not reach the bank
    trainer.c.client.get_requests(10**9)
    (trainer.run_dir / "eval.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    return result


def _outcomes_by_task(episodes: list[Episode]) -> dict[tuple[str, int], list[float]]:
    """0/1 outcomes per held-out task (env id, task seed), in order of first appearance."""
    by_task: dict[tuple[str, int], list[float]] = {}
    for e in episodes:
        by_task.setdefault((e.env_id, e.seed), []).append(1.0 if e.success else 0.0)
    return by_task


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
