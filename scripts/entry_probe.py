"""How often an untrained extractor's sampled entries hold their task's secret on crl/Recall-v0.

CISPO raises the probability of answers the extractor sampled, weighted by how they did; an answer
it never samples gets no push. So before tuning a learning rate or a LoRA rank, measure p: the share
of sampled entries that hold the task's secret (:func:`crl_gym.envs.recall.holds_secret`). With the
``reader`` actor an entry's reward is decided by its text only when it names an action; an entry that
names none gets the reader's coin flip, whose variance in the CISPO buffer says nothing about the
text. This script distils the same finished episodes (half successes, half failures, played by a
seeded random agent) once per temperature, with no training, and reports per temperature:

* ``holds_secret``: the share of requests whose answer adds an entry holding the secret (Wilson
  95 % interval), also split by the episode's outcome;
* ``reader_plays_secret``: the share whose entry's first L action words are the secret (what the
  ``reader`` plays; ``holds_secret`` also fails an entry that names another action later);
* ``names_action``: the share whose entries name any of the task's action words (the part of the
  buffer's reward variance that the text decides), and ``first_action_is_first_listed``: the share
  whose first named action is the first admissible one (``north``);
* ``returns``: the share answered with a Return (nothing added);
* a few entries as written.

    python scripts/entry_probe.py --config configs/small.yaml --episodes 16 --temperatures 0.7 1.0 1.3
    python scripts/entry_probe.py --config configs/small.yaml --set experience.action_slot=1

The env's settings come from the config (``env.kwargs``, ``env.max_turns``); ``--set`` overrides any
key as for ``crl-train``. The last line of output is the JSON report.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from crl_gym.envs.recall import ACTION_WORDS, RecallEnv, holds_secret
from crl_gym.protocol import AddOp, DistillationRequest, ReturnOp, Step, Trajectory, UpdateOp
from crl_train.config import TrainConfig, load_config
from crl_train.extractor.worker import build_extractor
from crl_train.policy.reader import named_actions
from crl_train.run.stats import wilson
from crl_train.service.build import extractor_spec

SAMPLES_SHOWN = 4


def play_episodes(cfg: TrainConfig, n: int, seed: int) -> list[DistillationRequest]:
    """``n`` finished Recall episodes of a seeded uniform-random agent, half successes and half failures."""
    kwargs = dict(cfg.env.kwargs)
    env = RecallEnv(**kwargs)
    rng = np.random.default_rng(seed)
    wins: list[DistillationRequest] = []
    losses: list[DistillationRequest] = []
    episode = 0
    while len(wins) < n // 2 or len(losses) < n - n // 2:
        if episode > 100 * n:
            raise RuntimeError(f"entry_probe: {episode} random episodes gave {len(wins)} successes and "
                               f"{len(losses)} failures; this env is too hard or too easy for a random agent")
        obs, info = env.reset(seed=episode)
        task, first, steps = str(info["task"]), obs, []
        success, total = False, 0.0
        for _ in range(cfg.env.max_turns):
            actions = list(info["admissible_actions"])
            action = actions[int(rng.integers(len(actions)))]
            obs_next, reward, terminated, truncated, info = env.step(action)
            steps.append(Step(observation=obs, action=action, reward=float(reward), info=dict(info)))
            total += float(reward)
            obs = obs_next
            if terminated or truncated:
                success = bool(info.get("success", False))
                break
        request = DistillationRequest(task=task, trajectory=Trajectory(steps=steps, initial_observation=first),
                                      outcome=total, success=success, experience=None, condition="free",
                                      env_id="crl/Recall-v0", seed=episode)
        bucket, size = (wins, n // 2) if success else (losses, n - n // 2)
        if len(bucket) < size:
            bucket.append(request)
        episode += 1
    return wins + losses


def entry_texts(ops: list[Any]) -> list[str]:
    return [op.text for op in ops if isinstance(op, AddOp | UpdateOp)]


def probe(cfg: TrainConfig, requests: list[DistillationRequest], batch: int) -> dict[str, Any]:
    """Distil ``requests`` with the extractor ``cfg`` describes; count what its entries hold."""
    length, num_actions = int(cfg.env.kwargs.get("length", 1)), int(cfg.env.kwargs.get("num_actions", 2))
    actions = ACTION_WORDS[:num_actions]
    secret_seed = int(cfg.env.kwargs.get("secret_seed", 0))

    def secret(text: str, task: str) -> bool:
        return bool(holds_secret(text, task, length=length, num_actions=num_actions, secret_seed=secret_seed))

    torch.manual_seed(cfg.seed)
    extractor = build_extractor(extractor_spec(cfg, None))
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for i in range(0, len(requests), batch):
        chunk = requests[i:i + batch]
        for request, (_, ops) in zip(chunk, extractor.distill(chunk), strict=True):
            texts = entry_texts(ops)
            named = [named_actions(t, actions) for t in texts]
            rows.append({
                "task": request.task,
                "success": request.success,
                "entries": texts,
                "holds_secret": any(secret(t, request.task) for t in texts),
                # what the reader plays: the first L admissible actions an entry names, in reading order
                "reader_plays_secret": any(len(n) >= length and secret(" ".join(n[:length]), request.task) for n in named),
                "names_action": any(named),
                "first_listed": any(n and n[0] == actions[0] for n in named),
                "returned": not texts and any(isinstance(op, ReturnOp) for op in ops),
            })
    seconds = time.perf_counter() - start

    def share(key: str, subset: list[dict[str, Any]]) -> dict[str, Any]:
        interval = wilson(sum(bool(r[key]) for r in subset), len(subset))
        return {"count": sum(bool(r[key]) for r in subset), "n": len(subset), "share_ci95": interval.rounded()}

    wins = [r for r in rows if r["success"]]
    losses = [r for r in rows if not r["success"]]
    return {
        "requests": len(rows),
        "holds_secret": share("holds_secret", rows),
        "holds_secret_after_success": share("holds_secret", wins),
        "holds_secret_after_failure": share("holds_secret", losses),
        "reader_plays_secret": share("reader_plays_secret", rows),
        "names_action": share("names_action", rows),
        "first_action_is_first_listed": share("first_listed", rows),
        "returns": share("returned", rows),
        "seconds": round(seconds, 1),
        "samples": [{"success": r["success"], "entries": r["entries"]}
                    for r in wins[:SAMPLES_SHOWN // 2] + losses[:SAMPLES_SHOWN // 2]],
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/small.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    parser.add_argument("--episodes", type=int, default=16, help="finished episodes distilled per temperature")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0, 1.3])
    parser.add_argument("--seed", type=int, default=0, help="the random agent's seed")
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    args = parser.parse_args(argv)
    if args.episodes < 2:
        parser.error("--episodes must be >= 2 (half successes, half failures)")
    base = load_config(args.config, args.set)
    if base.extractor.model == "tiny":
        parser.error("the tiny extractor has no tokenizer of its own (the trainer trains one on the env's "
                     "texts): probe a real model, e.g. extractor.model=smollm2-135m")
    if tuple(base.env.ids) != ("crl/Recall-v0",):
        parser.error(f"entry_probe reads Recall's secrets: env.ids must be [crl/Recall-v0], got {list(base.env.ids)}")
    torch.set_num_threads(base.experience.extractor_threads)
    requests = play_episodes(base, args.episodes, args.seed)
    report: dict[str, Any] = {"config": args.config, "set": args.set, "episodes": args.episodes,
                              "model": base.extractor.model, "env": dict(base.env.kwargs), "by_temperature": {}}
    for temperature in args.temperatures:
        cfg = load_config(args.config, [*args.set, f"extractor.temperature={temperature}"])
        result = probe(cfg, requests, cfg.experience.distill_batch)
        report["by_temperature"][str(temperature)] = result
        print(f"temperature {temperature}: holds_secret {result['holds_secret']}, names_action "
              f"{result['names_action']}, {result['seconds']} s", file=sys.stderr, flush=True)
    line = json.dumps(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
