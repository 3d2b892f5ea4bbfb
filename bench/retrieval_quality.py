"""Does retrieval find the task's own entry? Own-task top-1 per retrieval key and embedder.

A guided episode queries the bank with its task text and is shown the top entry (k = 1). An entry
helps it most when it was distilled from an episode of the same task. This bench builds banks from
real episodes and asks, for every task that has an entry of its own, whether the top-1 result is
one of them (pure ranking: no diversification, which only moves later copies of a group).

* Episodes: ``crl/Recall-v0`` as the small suites play it (256 tasks, L = 1, A = 2, balanced
  secrets), one seeded random-agent episode per task, and the five ``crl/`` MiniHack tasks, a few
  seeded random-agent episodes each (real NLE games).
* Writers: ``oracle`` (an episode's winning actions after its task text; nothing for a failure)
  and ``smollm2`` (the small preset's SmolLM2-135M-Instruct extractor, untrained, under the
  config's settings): the entries a run's bank actually holds.
* Each entry goes through ``ExperienceManager.apply_ops`` with its distillation request, as in
  training, once per retrieval key (``manager.retrieve_by``: ``text``, ``task``, ``task_text``, and
  ``text_named``: the text key with ``manager.name_task`` on) and embedder (``hashing:256``, the
  bundled ``minilm``).

The last line is the JSON report: per env, writer, embedder and key, ``own_task_top1`` (with its
Wilson interval), the number of queries (tasks with an entry of their own) and entries, and
``meets_goal``: own-task top-1 >= 0.95 on Recall for the small preset's key and embedder.

    python bench/retrieval_quality.py --json
    python bench/retrieval_quality.py --json --writers oracle        # seconds, no model
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from crl_gym.envs import make
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.config import ManagerConfig
from crl_gym.experience.embedders import Embedder, embedder_name
from crl_gym.experience.keys import RETRIEVE_BY
from crl_gym.experience.manager import ExperienceManager
from crl_gym.protocol import DistillationRequest, ExperienceOp, Step, Trajectory
from crl_train.config import load_config
from crl_train.extractor.oracle import OracleExtractor
from crl_train.extractor.worker import build_extractor
from crl_train.run.stats import wilson
from crl_train.service.build import embedder_of, extractor_spec

GOAL = 0.95
RECALL_KWARGS = {"num_tasks": 256, "length": 1, "num_actions": 2, "secret_seed": 1}
MINIHACK_IDS = ("crl/MiniHack-Room-5x5-v0", "crl/MiniHack-Room-Ultimate-5x5-v0", "crl/MiniHack-MazeWalk-9x9-v0",
                "crl/MiniHack-KeyRoom-Dark-S5-v0", "crl/MiniHack-River-Narrow-v0")
EMBEDDERS = ("hashing", "minilm")


def play(env_id: str, kwargs: dict[str, Any], seed: int, max_turns: int) -> DistillationRequest:
    """One finished episode of a seeded uniform-random agent, as the distillation request it emits."""
    env = make(env_id, **kwargs)
    rng = np.random.default_rng(seed)
    try:
        obs, info = env.reset(seed=seed)
        task, first, steps, total, success = str(info["task"]), obs, [], 0.0, False
        for _ in range(max_turns):
            actions = list(info["admissible_actions"])
            action = actions[int(rng.integers(len(actions)))]
            obs_next, reward, terminated, truncated, info = env.step(action)
            steps.append(Step(observation=obs, action=action, reward=float(reward)))
            total, obs = total + float(reward), obs_next
            if terminated or truncated:
                success = bool(info.get("success", False))
                break
    finally:
        env.close()
    return DistillationRequest(task=task, trajectory=Trajectory(steps=steps, initial_observation=first),
                               outcome=total, success=success, experience=None, condition="free",
                               env_id=env_id, seed=seed)


def recall_episodes(oracle: bool) -> list[DistillationRequest]:
    """One episode per Recall task; for the oracle, the first success of each task (it writes only those)."""
    out = []
    for task in range(RECALL_KWARGS["num_tasks"]):
        seed = task
        req = play("crl/Recall-v0", RECALL_KWARGS, seed, max_turns=2)
        while oracle and not req.success:
            seed += RECALL_KWARGS["num_tasks"]
            req = play("crl/Recall-v0", RECALL_KWARGS, seed, max_turns=2)
        out.append(req)
    return out


def minihack_episodes(per_task: int, max_turns: int) -> list[DistillationRequest]:
    return [play(env_id, {}, seed, max_turns) for env_id in MINIHACK_IDS for seed in range(per_task)]


def distil(writer: str, requests: list[DistillationRequest], config: str, overrides: Sequence[str],
           batch: int) -> list[list[ExperienceOp]]:
    """Each request's ops, written once by ``writer`` (the same entries for every key and embedder)."""
    if writer == "oracle":
        return [ops for _, ops in OracleExtractor().distill(requests)]
    cfg = load_config(config, list(overrides))
    # the extractor's share of the cores, as in training: more intra-op threads than free cores makes
    # every parallel region wait for a descheduled thread
    torch.set_num_threads(cfg.experience.extractor_threads)
    extractor = build_extractor(extractor_spec(cfg, None))
    out: list[list[ExperienceOp]] = []
    for i in range(0, len(requests), batch):
        out += [ops for _, ops in extractor.distill(requests[i:i + batch])]
        print(f"  {writer}: {len(out)}/{len(requests)} requests distilled", file=sys.stderr)
    return out


KEYS = {**{key: (key, False) for key in RETRIEVE_BY}, "text_named": ("text", True)}
"""Row name → (``manager.retrieve_by``, ``manager.name_task``): ``text_named`` is the text key with
each entry starting with its task (the option the last suites used to make text retrieval work)."""


def own_task_top1(requests: list[DistillationRequest], ops: list[list[ExperienceOp]], embedder: Embedder,
                  row: str) -> dict[str, Any]:
    """Build the bank through the manager, then query every task that has an entry of its own."""
    bank = ExperienceBank(None, dim=int(embedder.dim), embedder_name=embedder_name(embedder))
    retrieve_by, name_task = KEYS[row]
    config = ManagerConfig(retrieve_by=retrieve_by, name_task=name_task,  # type: ignore[arg-type]
                           diversity_lambda=0.0, recency_window_s=0.0)
    with ExperienceManager(bank, embedder, config) as manager:
        for req, answer in zip(requests, ops, strict=True):
            manager.apply_ops(answer, request=req)
        own = {e.source for e in bank}
        tasks = sorted({r.task for r in requests} & own)
        hits = sum(bool(top) and top[0].source == task
                   for task, top in zip(tasks, manager.search_many(tasks, k=1), strict=True))
        entries = len(bank)
    interval = wilson(hits, len(tasks)) if tasks else None
    return {"own_task_top1": round(hits / len(tasks), 4) if tasks else None,
            "ci95": interval.rounded() if interval else None, "queries": len(tasks), "entries": entries}


def markdown(report: dict[str, Any]) -> str:
    """The report as one table per env: writer and embedder by row, retrieval key by column."""
    lines = []
    for env, writers in report["envs"].items():
        lines += [f"## {env}", "", "| writer | embedder | episodes (successes) | " + " | ".join(KEYS) + " |",
                  "| --- | --- | --- |" + " --- |" * len(KEYS)]
        for writer, cell in writers.items():
            for emb in (k for k in cell if k not in ("episodes", "successes")):
                row = cell[emb]
                vals = []
                for key in KEYS:
                    r = row[key]
                    ci = r["ci95"]
                    vals.append("n/a" if r["own_task_top1"] is None else
                                f"{r['own_task_top1']:.3f} [{ci[1]:.3f}, {ci[2]:.3f}] of {r['queries']} ({r['entries']} entries)")
                lines.append(f"| {writer} | {emb} | {cell['episodes']} ({cell['successes']}) | " + " | ".join(vals) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON report (last line)")
    parser.add_argument("--writers", nargs="+", default=["oracle", "smollm2"], choices=["oracle", "smollm2"])
    parser.add_argument("--embedders", nargs="+", default=list(EMBEDDERS), choices=list(EMBEDDERS))
    parser.add_argument("--minihack-episodes", type=int, default=4, help="random-agent episodes per MiniHack task")
    parser.add_argument("--minihack-turns", type=int, default=20)
    parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "small_recall.yaml"),
                        help="the preset whose extractor writes the smollm2 entries and whose key and embedder "
                             "the goal is checked for")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--markdown", type=Path, help="also write the tables into this file")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    preset = load_config(args.config, list(args.overrides))
    embedders = {name: embedder_of(preset.experience.__class__(embedder=name, embed_dim=256)) for name in args.embedders}
    report: dict[str, Any] = {"envs": {}, "goal": GOAL}
    for env, episodes in (("recall", recall_episodes), ("minihack", None)):
        report["envs"][env] = {}
        for writer in args.writers:
            if env == "recall":
                requests = episodes(writer == "oracle")  # type: ignore[misc]
            else:
                requests = minihack_episodes(args.minihack_episodes, args.minihack_turns)
            ops = distil(writer, requests, args.config, args.overrides, args.batch)
            cell: dict[str, Any] = {"episodes": len(requests), "successes": sum(r.success for r in requests)}
            for name, embedder in embedders.items():
                cell[name] = {row: own_task_top1(requests, ops, embedder, row) for row in KEYS}
                print(f"{env} / {writer} / {name}: " + ", ".join(
                    f"{k} {v['own_task_top1']}" for k, v in cell[name].items()), file=sys.stderr)
            report["envs"][env][writer] = cell
    key, emb = preset.manager.retrieve_by, preset.experience.embedder
    chosen = [report["envs"]["recall"][w].get(emb, {}).get(key, {}).get("own_task_top1") for w in args.writers]
    report["preset"] = {"config": Path(args.config).name, "retrieve_by": key, "embedder": emb,
                        "recall_own_task_top1": dict(zip(args.writers, chosen, strict=True))}
    report["meets_goal"] = all(c is not None and c >= GOAL for c in chosen)
    report["seconds"] = round(time.perf_counter() - started, 1)
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(report), encoding="utf-8")
    if not args.json:
        print(json.dumps(report, indent=2))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
