"""Held-out evaluation of a run's actor under three memory modes (``crl-eval --memory``).

* ``none``: no bank; every episode runs free (what the actor has internalised).
* ``frozen``: the checkpoint's bank, read-only; every episode is guided by what it retrieves and
  nothing is written (what the bank the run ended with is worth to its actor).
* ``online``: the bank live, as in training: after each round of ``env.tasks_per_step`` held-out
  tasks, the extractor distils their episodes into the bank (under the run's distillation rule)
  before the next round; its weights do not change (no credit, no CISPO update on held-out
  episodes).

Every mode plays the same held-out tasks (seeds from ``env.eval_seed_offset``), each ``group_size``
times, so modes are compared task by task: ``paired`` holds, for each pair of modes, the mean over
tasks of the difference in success with a paired t interval. The run is left as it was: the bank is
a copy, deleted afterwards.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from collections.abc import Callable, Sequence
from itertools import combinations
from pathlib import Path
from typing import Any, Literal, get_args

import torch

from crl_gym.json_types import JSONDict
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
    paired_difference,
    ratio_of_means,
)
from crl_train.run.trainer import Trainer
from crl_train.service.checkpoint import CKPT

Memory = Literal["none", "frozen", "online"]
MEMORY_MODES: tuple[str, ...] = get_args(Memory)
DEFAULT_MEMORY: tuple[str, ...] = ("frozen", "none")
LEGACY_KEYS = {"frozen": "with_experience", "none": "without_experience"}
"""eval.json keys of the two modes ``crl-eval`` had before ``--memory`` (reports read them)."""
Task = tuple[str, int]


def memory_of_modes(modes: Sequence[bool]) -> tuple[str, ...]:
    """The memory modes of the older ``modes`` argument (True: with experience, False: without)."""
    warnings.warn(
        "evaluate_run(modes=...) / crl-eval --with-exp/--without-exp are deprecated: use "
        "memory=('frozen', 'none') / crl-eval --memory frozen|none|online",
        DeprecationWarning,
        stacklevel=3,
    )
    return tuple("frozen" if m else "none" for m in modes)


def evaluate_run(
    trainer: Trainer,
    episodes: int,
    modes: tuple[bool, ...] | None = None,
    *,
    memory: Sequence[str] = DEFAULT_MEMORY,
) -> JSONDict:
    """Held-out episodes of ``trainer``'s actor in each ``memory`` mode; writes eval.json.

    Each held-out task is played a group of times, and its episodes mostly agree, so the task is
    the unit of evidence. Per mode (``result["memory"][mode]``): ``success`` with its Wilson
    interval at ``effective_episodes`` (episodes / design effect), ``tasks``,
    ``actions_per_episode`` with its t interval. ``paired``: per pair of modes the mean difference
    in success over the same tasks (paired t). With ``frozen`` and ``none``: their old keys
    ``with_experience`` / ``without_experience``, ``experience_gain`` (Newcombe interval) and
    ``internalisation`` = success none / frozen (bootstrap over tasks). Every interval is 95 %.
    ``modes`` (deprecated): True/False for frozen/none.
    """
    if modes is not None:
        memory = memory_of_modes(modes)
    unknown = [m for m in memory if m not in MEMORY_MODES]
    if unknown:
        raise ValueError(f"unknown memory mode(s) {unknown}; choose from {list(MEMORY_MODES)}")
    cfg: TrainConfig = trainer.cfg
    groups = max(1, -(-episodes // cfg.env.group_size))
    tasks = eval_task_seeds(cfg.env, groups)
    result: dict[str, Any] = {
        "episodes_per_mode": groups * cfg.env.group_size,
        "level": LEVEL,
        "memory": {},
        "skipped": {},
    }
    by_mode: dict[str, dict[Task, list[float]]] = {}
    rates: dict[str, Interval] = {}
    for mode in sorted(
        dict.fromkeys(memory), key=MEMORY_MODES.index
    ):  # online last: it writes the bank
        why = _unavailable(trainer, mode)
        if why:
            result["skipped"][mode] = why
            continue
        with torch.no_grad():
            eps = _play(trainer, tasks, mode)
        by_task = by_mode[mode] = _outcomes_by_task(eps)
        rate = rates[mode] = clustered_wilson(list(by_task.values()))
        actions = mean_t([float(e.num_actions) for e in eps])
        by_env = {}
        for env in dict.fromkeys(e.env_id for e in eps):
            r = clustered_wilson([o for (env_id, _), o in by_task.items() if env_id == env])
            by_env[env] = {"success": r.value, "success_ci": [r.low, r.high], "episodes": r.n}
        result["memory"][mode] = {
            "success": rate.value,
            "success_ci": [rate.low, rate.high],
            "actions_per_episode": actions.value,
            "actions_per_episode_ci": [actions.low, actions.high],
            "episodes": len(eps),
            "tasks": len(by_task),
            "effective_episodes": len(eps) / design_effect(list(by_task.values())),
            "by_env": by_env,
        }
        if mode in LEGACY_KEYS:
            result[LEGACY_KEYS[mode]] = result["memory"][mode]
    result["paired"] = [
        _paired(a, b, by_mode[a], by_mode[b])
        for a, b in combinations([m for m in reversed(MEMORY_MODES) if m in by_mode], 2)
    ]
    if "frozen" in by_mode and "none" in by_mode:
        ratio = ratio_of_means(_task_means(by_mode["none"]), _task_means(by_mode["frozen"]))
        result["internalisation"] = {"ratio": ratio.value, "ratio_ci": [ratio.low, ratio.high]}
        gain = newcombe_difference(rates["frozen"], rates["none"])
        result["experience_gain"] = {
            "difference": gain.value,
            "difference_ci": [gain.low, gain.high],
        }
    # held-out episodes of no training step: whatever a mode left queued must not reach the bank
    trainer.c.client.get_requests(10**9)
    (trainer.run_dir / "eval.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    return result


def _unavailable(trainer: Trainer, mode: str) -> str | None:
    """Why ``mode`` cannot run for this run (None: it can)."""
    if mode == "none":
        return None
    if not trainer.method.guided:
        return f"method {trainer.cfg.method!r} uses no experience"
    if mode == "online" and trainer.c.service.track is None:
        return f"method {trainer.cfg.method!r} has no extractor to write the bank"
    return None


def _play(trainer: Trainer, tasks: list[Task], mode: str) -> list[Episode]:
    """Every task played ``group_size`` times in ``mode`` (``step=-1``: held out, never credited).

    A guided group runs its first half guided, so each task is played as two groups and their
    guided halves kept. Online, tasks go in rounds of ``env.tasks_per_step``, each round's episodes
    distilled into the bank before the next."""
    runner = trainer.c.runner
    if mode == "none":
        return runner.collect(tasks, guided=False, step=-1)
    rounds = (
        [tasks]
        if mode == "frozen"
        else [
            tasks[i : i + trainer.cfg.env.tasks_per_step]
            for i in range(0, len(tasks), trainer.cfg.env.tasks_per_step)
        ]
    )
    out: list[Episode] = []
    for chunk in rounds:
        doubled = [t for t in chunk for _ in range(2)]
        out += [
            e
            for e in runner.collect(doubled, guided=True, step=-1)
            if e.condition == GUIDED_CONDITION
        ]
        if mode == "online":
            track = trainer.c.service.track
            assert track is not None  # _unavailable checked it
            track.distill_now(trainer.c.client.get_requests(10**9))
    return out


def _outcomes_by_task(episodes: list[Episode]) -> dict[Task, list[float]]:
    """0/1 outcomes per held-out task (env id, task seed), in order of first appearance."""
    by_task: dict[Task, list[float]] = {}
    for e in episodes:
        by_task.setdefault((e.env_id, e.seed), []).append(1.0 if e.success else 0.0)
    return by_task


def _task_means(by_task: dict[Task, list[float]]) -> list[float]:
    return [sum(o) / len(o) for o in by_task.values()]


def _paired(a: str, b: str, da: dict[Task, list[float]], db: dict[Task, list[float]]) -> JSONDict:
    """Success in mode ``a`` − in mode ``b`` over the tasks both played: mean of the
    per-task differences."""
    common = [t for t in da if t in db]
    iv = paired_difference(
        _task_means({t: da[t] for t in common}), _task_means({t: db[t] for t in common})
    )
    return {
        "a": a,
        "b": b,
        "diff": iv.value,
        "ci95": [iv.low, iv.high],
        "tasks": len(common),
        "method": "paired t over tasks",
    }


def evaluate_dir(
    cfg: TrainConfig,
    run_dir: Path,
    episodes: int,
    modes: tuple[bool, ...] | None = None,
    env_factory: Callable[[str], Any] | None = None,
    *,
    memory: Sequence[str] = DEFAULT_MEMORY,
) -> JSONDict:
    """``crl-eval``: the run's checkpoint on held-out seeds, with the checkpoint's own bank
    (``checkpoint/bank``; the run's ``bank/`` for a checkpoint written before checkpoints kept one).
    The run is left as it was: retrieval counts, online writes, pending requests and the index
    change on a copy of the bank, deleted afterwards. ``modes`` (deprecated): True/False
    for frozen/none."""
    if modes is not None:
        memory = memory_of_modes(modes)
    source = run_dir / CKPT / "bank"
    if not source.is_dir():
        source = run_dir / "bank"
    with tempfile.TemporaryDirectory(prefix="crl_eval_") as tmp:
        bank_copy = Path(tmp) / "bank"
        if source.is_dir():
            shutil.copytree(source, bank_copy, ignore=shutil.ignore_patterns("*.lock"))
        trainer = Trainer(
            cfg,
            run_dir,
            read_only=True,
            eval_bank_dir=bank_copy,
            progress=False,
            env_factory=env_factory,
        )
        try:
            result = evaluate_run(trainer, episodes, memory=memory)
        finally:
            trainer.close()
    result["bank"] = str(source.relative_to(run_dir)) if source.is_dir() else None
    (run_dir / "eval.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    return result
