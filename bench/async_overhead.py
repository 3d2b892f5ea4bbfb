"""Actor step time of grpo vs complementary (background track) vs complementary forced synchronous.

Runs the tiny preset for a few steps three ways, in one process, one after another:

* ``grpo``: no experience; the actor gets its share (1 core).
* ``complementary`` asynchronous: the background track runs in its own thread of the trainer
  process and the extractor's model work in its own process (``crl_train.extractor_worker``).
* ``complementary`` synchronous: each actor step waits for distillation, the extractor update and
  the merge (``experience.asynchronous=false``; the extractor in process, as auto mode picks).

Core split (2 cores): the trainer process runs torch with 1 intra-op thread — the actor's core,
shared with the light bank/manager work of the background thread, which otherwise waits on the
worker's pipe; the extractor process runs torch with 1 intra-op thread — the extractor's core.
The grpo run gets the actor's share (1 thread) and has no second process.

The first ``--warmup`` steps of each run are excluded from the mean (the first steps also include
the worker's start-up wait in the async run, and the first merge). Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


CORE_SPLIT = ("trainer process: torch 1 intra-op thread = the actor's core (primary loop; the background-track thread "
              "only does bank/manager work and waits on the worker's pipe); extractor worker process (spawn): torch 1 "
              "intra-op thread = the extractor's core (distillation, refinement, merge generation, CISPO, checkpoints); "
              "grpo: 1 thread, no worker; sync: extractor in process, 1 thread")


def run(method: str, asynchronous: bool, steps: int, warmup: int, extra: list[str]) -> dict[str, Any]:
    from crl_train.config import load_config
    from crl_train.trainer import Trainer

    overrides = [f"method={method}", f"train.steps={steps}", "train.eval_episodes=0", "train.checkpoint_every=1000",
                 f"experience.asynchronous={str(asynchronous).lower()}", "experience.actor_threads=1",
                 "experience.extractor_threads=1", *extra]
    cfg = load_config(None, overrides)
    with tempfile.TemporaryDirectory(prefix=f"bench_{method}_") as d:
        t0 = time.perf_counter()
        trainer = Trainer(cfg, d, progress=False)
        times: list[float] = []
        try:
            trainer.c.track.start()
            for t in range(steps):
                row = trainer.step(t)
                times.append(row["step_time_s"])
            # how far the extractor got while the actor ran (async: it may trail; sync: nothing pending)
            st = trainer.c.track.stats
            extra_out = {"distilled": st.distilled, "extractor_updates": st.updates, "merges": st.merges,
                         "queue_depth_end": trainer.c.manager.pending(), "track_errors": st.errors,
                         "extractor_process": trainer.c.extractor.__class__.__name__ == "ExtractorWorker"}
            trainer.c.track.stop()
        finally:
            trainer.close()
        wall = time.perf_counter() - t0
    kept = times[warmup:] or times
    return {"mean_step_s": statistics.mean(kept), "median_step_s": statistics.median(kept), "steps": len(kept),
            "step_times_s": [round(x, 4) for x in times], **extra_out, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5, help="actor steps per configuration")
    ap.add_argument("--warmup", type=int, default=1, help="first steps excluded from the mean")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config overrides applied to all three runs")
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    args = ap.parse_args(argv)
    import logging

    import torch

    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    res = {
        "grpo": run("grpo", True, args.steps, args.warmup, args.overrides),
        "complementary_async": run("complementary", True, args.steps, args.warmup, args.overrides),
        "complementary_sync": run("complementary", False, args.steps, args.warmup, args.overrides),
    }
    out = {
        "grpo_step_s": res["grpo"]["mean_step_s"],
        "async_step_s": res["complementary_async"]["mean_step_s"],
        "sync_step_s": res["complementary_sync"]["mean_step_s"],
        "async_over_grpo": res["complementary_async"]["mean_step_s"] / res["grpo"]["mean_step_s"],
        "sync_over_async": res["complementary_sync"]["mean_step_s"] / res["complementary_async"]["mean_step_s"],
        "core_split": CORE_SPLIT,
        "cpu_count": os.cpu_count(),
        "runs": res,
    }
    if not args.json:
        for k, v in out.items():
            if k != "runs":
                print(f"{k}: {v}", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
