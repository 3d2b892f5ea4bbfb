"""The small preset's real model on CPU: what SmolLM2-135M-Instruct costs as extractor (and as actor).

One run measures, side by side, on the preset's settings (``configs/small.yaml``; one torch thread,
the share the preset gives each model on 2 cores):

* ``generation``: tokens/s of SmolLM2 free and under the distillation ops' JSON grammar
  (llguidance over its 49,152-token vocabulary) at batch 1 and 8. A batch runs until its last row
  stops, so the comparison is per decoding step: ``constrained_over_free_b8`` = (seconds per step
  constrained) / (seconds per step free), the free side generating as many steps as the
  constrained one took. The two alternate for ``--repeats`` passes; the best of each is kept (a
  burst of load from other processes only ever slows a pass down).
* ``mask_us_per_token``: llguidance's mask alone, per token, replaying the constrained answers.
* ``distill``: ``Extractor.distill`` of 8 requests in one batched call against 8 one-at-a-time
  calls (generated tokens per second), and the prompt lengths in tokens (bounded by
  ``experience.max_prompt_chars``).
* ``cispo_update_s``: one CISPO update of the LoRA extractor over 64 of those samples.
* ``actor_update_s``: one actor update over a step's 8 episodes: the tiny actor (the preset's) and
  SmolLM2 with LoRA r = 16 on sequences of the same token length.
* ``step_time_s``: a training step of the preset on ``crl/Recall-v0`` and on
  ``crl/MiniHack-Room-5x5-v0`` (mean over ``--steps`` steps, first step included).

Targets: ``constrained_over_free_b8`` <= 1.15; batched distillation >= 4x the tokens/s of one at a
time. The machine's load average is printed with the figures (a shared machine slows everything,
the ratios less).

    python bench/small.py --json            # last line: one JSON object
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from crl_gym.experience.schemas import MAX_OPS, ops_schema  # noqa: E402
from crl_gym.protocol import DistillationRequest, Step, Trajectory  # noqa: E402
from crl_train.algorithms import LOSSES  # noqa: E402
from crl_train.config import load_config  # noqa: E402
from crl_train.extractor.model import BufferItem, Extractor  # noqa: E402
from crl_train.policy.base import Generation, OptimConfig, SamplingConfig, TokenSequence, TrainBatch  # noqa: E402
from crl_train.policy.grammar import JsonGrammar  # noqa: E402
from crl_train.policy.hf import HFPolicy  # noqa: E402
from crl_train.policy.lora import LoraSpec  # noqa: E402
from crl_train.policy.packaged import display_name, resolve_model  # noqa: E402

TARGET_CONSTRAINED_OVER_FREE = 1.15
TARGET_BATCH_SPEEDUP = 4.0
NAMES = ["amber falcon", "coral heron", "bold lynx", "quiet otter", "brisk crane", "pale wolf", "dusty owl", "red fox"]


def _requests(n: int) -> list[DistillationRequest]:
    """Recall-like episodes (one turn, half won), as the preset's distillation sees them."""
    out = []
    for i in range(n):
        name = NAMES[i % len(NAMES)]
        action = ("east", "west")[i % 2]
        obs = (f"Task: {name}. Play its secret sequence of 1 actions, one per turn; a wrong action ends the episode.\n"
               "Actions so far: (none)\nTurn 1: action 1 of 1?")
        won = i % 2 == 0
        out.append(DistillationRequest(task=f"Task {name}: repeat the 1 secret actions of {name}.",
                                       trajectory=Trajectory(steps=[Step(obs, action, 1.0 if won else 0.0)]),
                                       outcome=1.0 if won else 0.0, success=won, experience=None))
    return out


def _per_step(policy: HFPolicy, prompts: list[list[int]], allowed: list[Any] | None, new: int) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    gens = policy.generate(prompts, new, allowed=allowed)
    dt = time.perf_counter() - t0
    steps = max(len(g.token_ids) for g in gens)
    return dt / steps, steps, sum(len(g.token_ids) for g in gens)


def bench_generation(policy: HFPolicy, prompt: list[int], grammar: JsonGrammar, repeats: int, new: int) -> dict[str, Any]:
    policy.generate([prompt], 4, allowed=[grammar])  # wrap the tokenizer and compile the schema once
    out: dict[str, Any] = {}
    for bs in (1, 8):
        best_c, best_f, tps_c, tps_f = float("inf"), float("inf"), 0.0, 0.0
        for _ in range(repeats):
            sc, steps, nc = _per_step(policy, [prompt] * bs, [grammar] * bs, new)
            sf, _, nf = _per_step(policy, [prompt] * bs, None, steps)
            if sc < best_c:
                best_c, tps_c = sc, nc / (sc * steps)
            if sf < best_f:
                best_f, tps_f = sf, nf / (sf * steps)
        out[f"b{bs}"] = {"free_tokens_per_s": round(tps_f, 2), "constrained_tokens_per_s": round(tps_c, 2),
                         "free_s_per_step": round(best_f, 4), "constrained_s_per_step": round(best_c, 4),
                         "constrained_over_free": round(best_c / best_f, 3)}
    return out


def bench_mask(policy: HFPolicy, prompt: list[int], grammar: JsonGrammar) -> float:
    gens = policy.generate([prompt] * 4, 64, allowed=[grammar] * 4)
    engine = policy.grammar_engine
    tokens, t0 = 0, time.perf_counter()
    for g in gens:
        engine.replay(grammar, g.token_ids)
        tokens += len(g.token_ids)
    return (time.perf_counter() - t0) / tokens * 1e6


def bench_distill(ext: Extractor, n: int) -> tuple[dict[str, Any], list[Any]]:
    reqs = _requests(n)
    t0 = time.perf_counter()
    batched = ext.distill(reqs)
    tb = time.perf_counter() - t0
    nb = sum(len(s.token_ids) for s, _ in batched)
    t0 = time.perf_counter()
    single = [x for r in reqs for x in ext.distill([r])]
    ts = time.perf_counter() - t0
    ns = sum(len(s.token_ids) for s, _ in single)
    prompt_tokens = [len(s.prompt_token_ids) for s, _ in batched]
    return {"requests": n, "batched_s": round(tb, 2), "batched_tokens_per_s": round(nb / tb, 2),
            "one_at_a_time_s": round(ts, 2), "one_at_a_time_tokens_per_s": round(ns / ts, 2),
            "speedup": round((nb / tb) / (ns / ts), 2), "prompt_tokens_mean": round(sum(prompt_tokens) / n, 1),
            "prompt_tokens_max": max(prompt_tokens),
            "example_answer": batched[0][0].response[:200]}, batched + single


def bench_cispo(ext: Extractor, samples: list[Any], n: int) -> float:
    items = [BufferItem(samples[i % len(samples)][0], 1.0 if i % 2 else -1.0, None, 0) for i in range(n)]
    t0 = time.perf_counter()
    ext.train(items, [0] * n, [-1] * n, step=10)
    return time.perf_counter() - t0


def _actor_batch(policy: HFPolicy, n: int, prompt_len: int, resp_len: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    vocab = len(policy.tokenizer)
    seqs = []
    for _ in range(n):
        s = TokenSequence()
        s.append_context(torch.randint(5, vocab, (prompt_len,), generator=gen).tolist())
        ids = torch.randint(5, vocab, (resp_len,), generator=gen).tolist()
        s.append_generation(Generation(prompt_ids=[], token_ids=ids, logprobs=[-2.0] * resp_len, text=""))
        seqs.append(s)
    batch = TrainBatch.from_sequences(seqs, [1.0, -1.0] * (n // 2), policy.pad_token_id)
    batch.old_logprobs = policy.logprobs(batch)
    return batch


def bench_actor_update(smol: HFPolicy, tiny: HFPolicy, prompt_len: int, resp_len: int) -> dict[str, float]:
    out = {}
    for name, policy in (("tiny", tiny), ("smollm2_lora16", smol)):
        batch = _actor_batch(policy, 8, prompt_len, resp_len)
        t0 = time.perf_counter()
        policy.train_step(batch, LOSSES.get("clip"), loss_scale="samples", clip_eps=0.2)
        out[name] = round(time.perf_counter() - t0, 3)
    return out


def bench_steps(env_id: str, steps: int, extra: list[str]) -> dict[str, Any]:
    from crl_train.run.trainer import Trainer

    overrides = [f"env.ids=[{env_id}]", f"train.steps={steps}", "train.eval_episodes=0", *extra]
    if "MiniHack" in env_id:
        overrides += ["env.kwargs={max_turns: 12}", "env.max_turns=12"]
    cfg = load_config("small", overrides)
    with tempfile.TemporaryDirectory(prefix="crl_bench_small_") as tmp:
        trainer = Trainer(cfg, Path(tmp) / "run", progress=False)
        try:
            trainer.run()
        finally:
            trainer.close()
        rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"step_time_s": round(sum(r["step_time_s"] for r in rows) / len(rows), 2),
            "rollout_time_s": round(sum(r["rollout_time_s"] for r in rows) / len(rows), 2),
            "distilled": rows[-1]["distilled"], "bank_size": rows[-1]["bank_size"], "steps": len(rows)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--repeats", type=int, default=2, help="alternating passes of the generation comparison")
    ap.add_argument("--new-tokens", type=int, default=48, help="token budget of the generation comparison")
    ap.add_argument("--cispo-samples", type=int, default=64, help="samples of the CISPO update (paper: 64)")
    ap.add_argument("--steps", type=int, default=1, help="training steps per env for step_time_s (0 skips them)")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="override of the preset for the steps")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    load_before = os.getloadavg()[0]
    cfg = load_config("small")
    mc = cfg.extractor
    t0 = time.perf_counter()
    path = resolve_model(mc.model)
    resolve_s = time.perf_counter() - t0
    smol = HFPolicy.from_pretrained(path, sampling=SamplingConfig(temperature=mc.temperature, top_p=mc.top_p, seed=0),
                                    optim=OptimConfig(lr=mc.lr, micro_batch_size=mc.micro_batch_size, loss_scale="tokens"))
    smol.name = display_name(mc.model)
    smol.enable_lora(LoraSpec(mc.lora_rank, mc.lora_alpha, mc.lora_targets))
    ext = Extractor(smol, max_new_tokens=mc.max_new_tokens, max_context_tokens=mc.max_context_tokens,
                    max_prompt_chars=cfg.experience.max_prompt_chars, structured=True,
                    max_entry_chars=cfg.experience.max_entry_chars or 160)
    from crl_gym.experience.prompts import build_distillation_prompt

    prompt = ext._prompt_ids(build_distillation_prompt(_requests(1)[0], max_chars=cfg.experience.max_prompt_chars,
                                                       max_ops=MAX_OPS), args.new_tokens)
    grammar = JsonGrammar.from_schema(ops_schema((), max_ops=MAX_OPS, max_text=cfg.experience.max_entry_chars or 160))
    out: dict[str, Any] = {"model": smol.name, "vocab": len(smol.tokenizer), "threads": torch.get_num_threads(),
                           "resolve_s": round(resolve_s, 2), "load_avg_start": round(load_before, 2)}
    out["generation"] = bench_generation(smol, prompt, grammar, args.repeats, args.new_tokens)
    out["mask_us_per_token"] = round(bench_mask(smol, prompt, grammar), 1)
    out["distill"], samples = bench_distill(ext, 8)
    out["cispo_update_s"] = {"samples": args.cispo_samples,
                             "seconds": round(bench_cispo(ext, samples, args.cispo_samples), 2)}
    from crl_train.policy.tiny import build_tiny_policy

    tiny = build_tiny_policy(["Task amber falcon: east west"] * 4, vocab_size=cfg.actor.tiny_vocab_size,
                             hidden=cfg.actor.tiny_hidden, layers=cfg.actor.tiny_layers,
                             optim=OptimConfig(lr=cfg.actor.lr, loss_scale="samples"))
    out["actor_update_s"] = {"sequences": 8, "tokens_each": 160, **bench_actor_update(smol, tiny, 150, 10)}
    del smol, ext
    if args.steps:
        out["step_time_s"] = {env: bench_steps(env, args.steps, args.extra)
                              for env in ("crl/Recall-v0", "crl/MiniHack-Room-5x5-v0")}
    out["load_avg_end"] = round(os.getloadavg()[0], 2)
    ratio = out["generation"]["b8"]["constrained_over_free"]
    out["targets"] = {"constrained_over_free_b8": TARGET_CONSTRAINED_OVER_FREE,
                      "batched_distill_speedup": TARGET_BATCH_SPEEDUP}
    out["meets_targets"] = bool(ratio <= TARGET_CONSTRAINED_OVER_FREE
                                and out["distill"]["speedup"] >= TARGET_BATCH_SPEEDUP)
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
