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
* ``distill``: ``Extractor.distill`` of 8 requests in one batched call (the batch's common prompt
  prefix encoded once: ``HFPolicy.share_prefix``, the default) against 8 one-at-a-time calls
  (generated tokens per second), and, in the same run, the batched call without prefix sharing
  (``batched_no_share_*``), so each part's share of the gain shows; the prompt lengths in tokens
  (bounded by ``experience.max_prompt_chars``) and the shared prefix's. Sampled at the preset's
  temperature the three ways write different answers of different lengths (``answer_tokens_mean``),
  which moves tokens/s; ``greedy`` repeats the comparison with greedy answers, the same every way
  (``same_answers``), so its speed-ups are ratios of time alone (``--repeats`` alternating passes,
  the fastest of each way kept, as for generation). ``cpu_s`` / ``speedup_cpu``: the same from the
  process's CPU seconds, the work done, which a loaded machine's waits for a core do not inflate. ``--distill-threads 2`` also
  times the greedy batched call with a second torch thread (``batched_threads_greedy``).
* ``cispo_update_s``: one CISPO update of the LoRA extractor over 64 of those samples.
* ``actor_update_s``: one actor update over a step's 8 episodes: the tiny actor (the preset's) and
  SmolLM2 with LoRA r = 16 on sequences of the same token length.
* ``step_time_s``: a training step of the preset on ``crl/Recall-v0`` and on
  ``crl/MiniHack-Room-5x5-v0`` (mean over ``--steps`` steps, first step included).

Targets: ``constrained_over_free_b8`` <= 1.15; batched distillation >= 4x the tokens/s of one at a
time. The machine's load average is printed with the figures (a shared machine slows everything,
the ratios less).

    python bench/small.py --json            # last line: one JSON object
    python bench/small.py --json --sections distill --distill-threads 2   # the distillation only
"""

from __future__ import annotations

import argparse
import dataclasses
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
from crl_train.policy.generate import shared_prefix_len  # noqa: E402
from crl_train.policy.grammar import JsonGrammar  # noqa: E402
from crl_train.policy.hf import HFPolicy  # noqa: E402
from crl_train.policy.lora import LoraSpec  # noqa: E402
from crl_train.policy.packaged import display_name, resolve_model  # noqa: E402

TARGET_CONSTRAINED_OVER_FREE = 1.15
TARGET_BATCH_SPEEDUP = 4.0
SECTIONS = ("generation", "mask", "distill", "cispo", "actor", "steps")
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


def _timed_distill(ext: Extractor, reqs: list[DistillationRequest], *, share: bool = True,
                   threads: int | None = None) -> tuple[float, int, list[Any], float]:
    """Wall seconds, generated tokens, results and the process's CPU seconds of one batched
    ``distill`` (``threads``: torch's pool for this call only). On a loaded machine CPU seconds
    count the work done, not the time spent waiting for a core."""
    policy = ext.policy
    assert isinstance(policy, HFPolicy)
    before_share, before_threads = policy.share_prefix, torch.get_num_threads()
    policy.share_prefix = before_share if share else 0
    torch.set_num_threads(threads or before_threads)
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        got = ext.distill(reqs)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        policy.share_prefix = before_share
        torch.set_num_threads(before_threads)
    return dt, sum(len(s.token_ids) for s, _ in got), got, cpu


Timing = tuple[float, int, float]
"""Wall seconds, generated tokens, CPU seconds."""


def _three_ways(ext: Extractor, reqs: list[DistillationRequest]) -> tuple[dict[str, Timing], list[list[Any]]]:
    """Timings one at a time, batched without prefix sharing, batched with it (run in that order),
    and their results."""
    ts, ns, cs, single = 0.0, 0, 0.0, []
    for r in reqs:  # one at a time: a batch of one has no common prefix to share
        dt, k, got, cpu = _timed_distill(ext, [r])
        ts, ns, cs = ts + dt, ns + k, cs + cpu
        single.extend(got)
    tu, nu, unshared, cu = _timed_distill(ext, reqs, share=False)
    tb, nb, batched, cb = _timed_distill(ext, reqs)
    return {"one": (ts, ns, cs), "no_share": (tu, nu, cu), "batched": (tb, nb, cb)}, [batched, unshared, single]


def _figures(times: dict[str, Timing], n: int) -> dict[str, Any]:
    (ts, ns, cs), (tu, nu, cu), (tb, nb, cb) = times["one"], times["no_share"], times["batched"]
    one = ns / ts
    return {"cpu_s": {"batched": round(cb, 2), "no_share": round(cu, 2), "one_at_a_time": round(cs, 2)},
            "speedup_cpu": round((nb / cb) / (ns / cs), 2), "speedup_no_share_cpu": round((nu / cu) / (ns / cs), 2),
            "batched_s": round(tb, 2), "batched_tokens_per_s": round(nb / tb, 2), "one_at_a_time_s": round(ts, 2),
            "one_at_a_time_tokens_per_s": round(one, 2), "speedup": round((nb / tb) / one, 2),
            "batched_no_share_s": round(tu, 2), "batched_no_share_tokens_per_s": round(nu / tu, 2),
            "speedup_no_share": round((nu / tu) / one, 2),
            "answer_tokens_mean": {"batched": round(nb / n, 1), "no_share": round(nu / n, 1),
                                   "one_at_a_time": round(ns / n, 1)}}


def bench_distill(ext: Extractor, n: int, extra_threads: list[int], greedy: bool,
                  repeats: int) -> tuple[dict[str, Any], list[Any]]:
    """Sampled at the preset's temperature (the answers, so their lengths, differ between the three
    ways), then greedy (the same answers every way: the ratio is one of time alone), ``repeats``
    alternating passes of the three ways, the fastest of each kept."""
    reqs = _requests(n)
    out: dict[str, Any] = {"requests": n, "threads": torch.get_num_threads()}
    sampled, (batched, unshared, single) = _three_ways(ext, reqs)
    out.update(_figures(sampled, n))
    prompts = [s.prompt_token_ids for s, _ in batched]
    prompt_tokens = [len(p) for p in prompts]
    out.update({"shared_prefix_tokens": shared_prefix_len(prompts, 1),
                "prompt_tokens_mean": round(sum(prompt_tokens) / n, 1), "prompt_tokens_max": max(prompt_tokens),
                "example_answer": batched[0][0].response[:200]})
    samples = batched + unshared + single
    if not (greedy or extra_threads):
        return out, samples
    policy = ext.policy
    assert isinstance(policy, HFPolicy)
    sampling = policy.sampling
    policy.sampling = dataclasses.replace(sampling, greedy=True)
    try:
        if greedy:
            best: dict[str, Timing] = {}
            same = True
            for _ in range(max(1, repeats)):
                times, ways = _three_ways(ext, reqs)
                same = same and all(len({w[i][0].response for w in ways}) == 1 for i in range(n))
                # the fastest pass of each way, wall and CPU apart (greedy: the same tokens every pass)
                best = {k: (min(best.get(k, v)[0], v[0]), v[1], min(best.get(k, v)[2], v[2])) for k, v in times.items()}
            out["greedy"] = {**_figures(best, n), "passes": max(1, repeats), "same_answers": same}
            samples += ways[0]
        more = {}
        for k in extra_threads:  # greedy: the same answers as the one-thread batch above
            tk, nk, _, ck = _timed_distill(ext, reqs, threads=k)
            more[str(k)] = {"batched_s": round(tk, 2), "batched_tokens_per_s": round(nk / tk, 2), "cpu_s": round(ck, 2)}
        if more:
            out["batched_threads_greedy"] = more
    finally:
        policy.sampling = sampling
    return out, samples


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
    ap.add_argument("--repeats", type=int, default=2, help="alternating passes of the generation and the greedy distillation comparisons")
    ap.add_argument("--new-tokens", type=int, default=48, help="token budget of the generation comparison")
    ap.add_argument("--cispo-samples", type=int, default=64, help="samples of the CISPO update (paper: 64)")
    ap.add_argument("--steps", type=int, default=1, help="training steps per env for step_time_s (0 skips them)")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="override of the preset for the steps")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every figure (the preset's share: 1)")
    ap.add_argument("--distill-threads", default="",
                    help="comma list: also time the batched distillation with these thread counts (e.g. 2)")
    ap.add_argument("--no-greedy-distill", dest="greedy_distill", action="store_false",
                    help="skip the distillation comparison with greedy answers (the same answers every way)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma list of the sections to run (default all: {','.join(SECTIONS)})")
    args = ap.parse_args(argv)
    sections = {x.strip() for x in args.sections.split(",") if x.strip()}
    unknown = sections - set(SECTIONS)
    if unknown:
        ap.error(f"unknown --sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    extra_threads = [int(x) for x in args.distill_threads.split(",") if x.strip()]
    if args.threads < 1 or any(k < 1 for k in extra_threads):
        ap.error("--threads and --distill-threads take counts >= 1")
    torch.set_num_threads(args.threads)
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
    out["distill_prompt_tokens"] = len(prompt)
    if "generation" in sections:
        out["generation"] = bench_generation(smol, prompt, grammar, args.repeats, args.new_tokens)
    if "mask" in sections:
        out["mask_us_per_token"] = round(bench_mask(smol, prompt, grammar), 1)
    samples: list[Any] = []
    if "distill" in sections or "cispo" in sections:
        out["distill"], samples = bench_distill(ext, 8, extra_threads, args.greedy_distill, args.repeats)
    if "cispo" in sections:
        out["cispo_update_s"] = {"samples": args.cispo_samples, "threads": torch.get_num_threads(),
                                 "seconds": round(bench_cispo(ext, samples, args.cispo_samples), 2)}
    if "actor" in sections:
        from crl_train.policy.tiny import build_tiny_policy

        tiny = build_tiny_policy(["Task amber falcon: east west"] * 4, vocab_size=cfg.actor.tiny_vocab_size,
                                 hidden=cfg.actor.tiny_hidden, layers=cfg.actor.tiny_layers,
                                 optim=OptimConfig(lr=cfg.actor.lr, loss_scale="samples"))
        out["actor_update_s"] = {"sequences": 8, "tokens_each": 160, **bench_actor_update(smol, tiny, 150, 10)}
    del smol, ext
    if args.steps and "steps" in sections:
        out["step_time_s"] = {env: bench_steps(env, args.steps, args.extra)
                              for env in ("crl/Recall-v0", "crl/MiniHack-Room-5x5-v0")}
    out["load_avg_end"] = round(os.getloadavg()[0], 2)
    out["targets"] = {"constrained_over_free_b8": TARGET_CONSTRAINED_OVER_FREE,
                      "batched_distill_speedup": TARGET_BATCH_SPEEDUP}
    # both figures measured in this run, or no verdict
    ratio = out.get("generation", {}).get("b8", {}).get("constrained_over_free")
    speedup = out.get("distill", {}).get("speedup")
    out["meets_targets"] = (None if ratio is None or speedup is None else
                            bool(ratio <= TARGET_CONSTRAINED_OVER_FREE and speedup >= TARGET_BATCH_SPEEDUP))
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
