"""The small preset's real model on CPU: what SmolLM2-135M-Instruct costs as extractor (and as actor).

One run measures, side by side, on the preset's settings (``configs/small.yaml``; one torch thread,
the share the preset gives each model on 2 cores). The default sections (``precision``, ``profile``)
compare the model with the CPU's own limits, measured in the same run (``machine``): a 2048² matmul
in float32 and bfloat16 (GFLOP/s; where the CPU has no bf16 units, a 512² one: emulated bf16 is
~70x slower) and the bandwidth of a 512 MiB read (GB/s). They time with the process's CPU seconds
(``--clock cpu``, the default), the work done, which waits for a core on a loaded machine do not
inflate; ``--clock wall`` times wall seconds.

* ``precision``: float32 as before (no training prefix sharing) against the new default
  (``dtype: auto`` on this CPU: bfloat16 mixed precision with bf16 units, float32 without; the
  training prefix sharing on), each: prefill and decoding tokens/s at batch 1 and 8 (free, the
  distillation prompt; ``prefill_gflops`` against the matmul), seconds of a distillation of 8,
  seconds per sample of a CISPO update over ``--train-samples`` of its samples (the first update
  after sampling: on-policy), their sum per extractor sample (``extractor_sample_s`` = distillation
  / 8 + CISPO per sample), the update's achieved FLOP/s over the matmul's (``train_over_matmul``;
  FLOPs executed: each micro-batch's shared prefix once, logits from the first trained token, the
  backward of a LoRA model counted as one more forward), mean and max |log ρ| of that on-policy
  update, and a decoding step at batch 1 over its floor (every weight's bytes over the bandwidth).
  When the default is float32 too, both share the one model (and its distillation and generation
  figures); only the training differs.
* ``profile``: where a distillation of 8 under the default spends its time: the model's forward
  passes (prefill: the shared prefix and the suffixes; each decoding step), llguidance's masks
  (``GrammarState.allowed`` / ``advance``), the log-softmax and sampling, and the rest (Python),
  prefill and decoding against their floors (FLOPs over the matmul rate; weight bytes over the
  bandwidth, per step).

Opt-in sections (``--sections``):

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

Targets (ratios inside one run; ``meets_each_target``, ``meets_targets`` = all that ran): an
extractor sample >= 4x cheaper with the default than with float32 as before; the training step
>= 40 % of the matmul's FLOP/s; a decoding step at batch 1 within 2x of its bandwidth floor;
``constrained_over_free_b8`` <= 1.15 (when ``generation`` runs). The machine's load average is
printed with the figures (a shared machine slows everything, the ratios less).

    python bench/small.py --json            # last line: one JSON object
    python bench/small.py --json --sections profile                       # the profile only
    python bench/small.py --json --sections distill --distill-threads 2   # the distillation only
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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
from crl_train.config import ExtractorSettings, load_config  # noqa: E402
from crl_train.extractor.model import BufferItem, Extractor  # noqa: E402
from crl_train.policy.base import Generation, OptimConfig, SamplingConfig, TokenSequence, TrainBatch  # noqa: E402
from crl_train.policy.checkpoint import resolve_dtype  # noqa: E402
from crl_train.policy.generate import _cache_of, shared_prefix_len  # noqa: E402
from crl_train.policy.grammar import JsonGrammar  # noqa: E402
from crl_train.policy.hf import SHARE_PREFIX_TOKENS, HFPolicy  # noqa: E402
from crl_train.policy.lora import LoraSpec  # noqa: E402
from crl_train.policy.packaged import display_name, resolve_model  # noqa: E402
from crl_train.policy.precision import cpu_bf16_supported  # noqa: E402
from crl_train.policy.shared_forward import common_prefix_len, trained_offset  # noqa: E402

TARGET_CONSTRAINED_OVER_FREE = 1.15
TARGET_EXTRACTOR_SPEEDUP = 4.0
"""An extractor sample (its distillation + its share of a CISPO update) at least this many times
cheaper with the default than with float32 as before."""
TARGET_TRAIN_OVER_MATMUL = 0.4
"""The training step's achieved FLOP/s at least this share of a large matmul's, same dtype, same run."""
TARGET_DECODE_OVER_FLOOR = 2.0
"""A decoding step at batch 1 within this factor of its floor: the weights' bytes over the bandwidth."""
SECTIONS = ("precision", "profile", "generation", "mask", "distill", "cispo", "actor", "steps")
DEFAULT_SECTIONS = ("precision", "profile")
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


# ---------------------------------------------------------------- the CPU's limits (issue: real models at the CPU's limit)
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
_clock = CLOCKS["cpu"]
"""What the precision and profile sections time with (``--clock``): the process's CPU seconds by
default, the work done, which the waits for a core on a machine loaded by other jobs do not
inflate (one torch thread: CPU seconds and wall seconds agree on an idle machine)."""


def _best(fn: Any, repeats: int) -> float:
    """Fastest of ``repeats`` timed calls (load from other processes only ever slows a call down)."""
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = _clock()
        fn()
        best = min(best, _clock() - t0)
    return best


def machine_rates(repeats: int) -> dict[str, Any]:
    """This core's ceilings, measured in this run: a large float32 and bfloat16 matmul (GFLOP/s) and
    the memory bandwidth of a read of 512 MiB (GB/s; a decoding step reads every weight once)."""
    out: dict[str, Any] = {"cpu_bf16": cpu_bf16_supported()}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        # an AVX2-only core emulates bf16 ~70x slower: a smaller matrix keeps its figure quick
        n = 2048 if dtype == torch.float32 or out["cpu_bf16"] else 512
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b
        out[f"matmul_{name}_gflops"] = round(2 * n**3 / _best(functools.partial(torch.matmul, a, b), repeats) / 1e9, 2)
        out[f"matmul_{name}_n"] = n
    big = torch.ones(128 * 2**20)  # 512 MiB of float32
    big.sum()
    out["bandwidth_gbs"] = round(big.numel() * 4 / _best(big.sum, repeats + 1) / 1e9, 2)
    return out


def _body_params(policy: HFPolicy) -> tuple[int, int]:
    """(parameters every token multiplies by, except the vocabulary projection; bytes one decoding
    step reads: every weight once, the tied embedding/projection matrix once)."""
    model = policy.model
    emb = model.get_input_embeddings().weight
    seen: set[int] = set()
    n_body, nbytes = 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        nbytes += p.numel() * p.element_size()
        if p is not emb and p is not model.get_output_embeddings().weight:
            n_body += p.numel()
    return n_body, nbytes


def forward_flops(policy: HFPolicy, tokens: int, context: int, logits_rows: int) -> float:
    """Matmul FLOPs of one forward over ``tokens`` new tokens after ``context`` cached ones: 2 per
    weight per token, attention's two products (causal), the vocabulary projection of ``logits_rows``."""
    cfg = policy.model.config
    n_body, _ = _body_params(policy)
    d, layers, vocab = int(cfg.hidden_size), int(cfg.num_hidden_layers), int(cfg.vocab_size)
    attn = 2 * 2 * layers * d * tokens * (context + (tokens + 1) / 2)
    return 2.0 * n_body * tokens + attn + 2.0 * d * vocab * logits_rows


def _smol(cfg: Any, dtype: str) -> tuple[HFPolicy, Extractor]:
    mc = cfg.extractor
    policy = HFPolicy.from_pretrained(resolve_model(mc.model), dtype=dtype,
                                      sampling=SamplingConfig(temperature=mc.temperature, top_p=mc.top_p, seed=0),
                                      optim=OptimConfig(lr=mc.lr, micro_batch_size=mc.micro_batch_size, loss_scale="tokens"))
    policy.name = display_name(mc.model)
    policy.enable_lora(LoraSpec(mc.lora_rank, mc.lora_alpha, mc.lora_targets))
    ext = Extractor(
        policy,
        ExtractorSettings(
            max_new_tokens=mc.max_new_tokens,
            max_context_tokens=mc.max_context_tokens,
            max_prompt_chars=cfg.experience.max_prompt_chars,
            structured=True,
            max_entry_chars=cfg.experience.max_entry_chars or 160,
        ),
    )
    return policy, ext


def _prefill_decode(policy: HFPolicy, prompt: list[int], repeats: int, steps: int) -> dict[str, Any]:
    """Tokens/s of a prefill (the whole prompt, last position's logits only) and of decoding steps
    (one token per row on the prompt's keys/values) at batch 1 and 8, free (no grammar)."""
    model = policy.model
    out: dict[str, Any] = {}
    for b in (1, 8):
        ids = torch.tensor([prompt] * b)
        with torch.no_grad(), policy.compute():
            prefill = functools.partial(model, input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True,
                                        logits_to_keep=1)
            pre_s = _best(prefill, repeats)
            cache = _cache_of(prefill())
            nxt = torch.zeros((b, 1), dtype=torch.long)
            attn = torch.ones((b, len(prompt)), dtype=torch.long)
            t0 = _clock()
            for i in range(steps):
                attn = torch.cat([attn, torch.ones((b, 1), dtype=torch.long)], 1)
                model(input_ids=nxt, attention_mask=attn, position_ids=torch.full((b, 1), len(prompt) + i),
                      use_cache=True, cache=cache, logits_to_keep=1)
            step_s = (_clock() - t0) / steps
        out[f"b{b}"] = {"prefill_tokens_per_s": round(b * len(prompt) / pre_s, 1), "prefill_s": round(pre_s, 3),
                        "decode_tokens_per_s": round(b / step_s, 1), "decode_step_s": round(step_s, 4),
                        "prefill_gflops": round(b * forward_flops(policy, len(prompt), 0, 1) / pre_s / 1e9, 2)}
    return out


def _cispo_step(policy: HFPolicy, ext: Extractor, samples: list[Any], n: int, share: int) -> tuple[float, torch.Tensor, float]:
    """One CISPO update over ``n`` of ``samples`` (training prefix sharing at ``share`` tokens, 0 =
    off): (seconds, |log ρ| of its trained tokens, matmul FLOPs). The first update after sampling
    is on-policy: ρ = 1 up to the numeric path."""
    seqs = [ext._sequence(samples[i % len(samples)][0]) for i in range(n)]
    batch = TrainBatch.from_sequences(seqs, [1.0 if i % 2 else -1.0 for i in range(n)], policy.pad_token_id)
    seen: list[torch.Tensor] = []
    cispo = LOSSES.get("cispo")

    def recording(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, **kw: Any) -> Any:
        seen.append((lp.detach() - old)[mask.bool()].abs())
        return cispo(lp, old, adv, mask, **kw)

    before = policy.share_prefix
    trained = {k: p.detach().clone() for k, p in policy.model.named_parameters() if p.requires_grad}
    policy.share_prefix = share
    try:
        dt = _best(lambda: policy.train_step(batch, recording, loss_scale="tokens"), 1)
    finally:
        policy.share_prefix = before
        with torch.no_grad():  # back to the sampling weights: the next run's update is on-policy too
            for k, p in policy.model.named_parameters():
                if k in trained:
                    p.copy_(trained[k])
        policy.optimizer = None
    return dt, torch.cat(seen), _train_flops(policy, batch, share)


def _train_flops(policy: HFPolicy, batch: TrainBatch, share: int) -> float:
    """Matmul FLOPs the update executes: per micro-batch (rows sorted by length, as
    ``accumulate_gradients`` groups them) its shared prefix once and each row's suffix on it, logits
    from the first trained position on; the backward of a LoRA model computes the inputs' gradients
    (a forward's worth) and the adapters' (negligible): 2 forwards."""
    order = batch.attention_mask.sum(1).argsort(descending=True, stable=True)
    mbs, total = policy.optim.micro_batch_size, 0.0
    for s in range(0, batch.batch_size, mbs):
        mb = batch.select(order[s : s + mbs]).trimmed()
        offset = trained_offset(mb.loss_mask)
        shared = common_prefix_len(mb.input_ids, offset) if share and mb.batch_size > 1 else 0
        shared = shared if shared >= share else 0
        total += forward_flops(policy, shared, 0, 0)
        for t in mb.attention_mask.sum(1).tolist():
            total += forward_flops(policy, int(t) - shared, shared, int(t) - offset)
    return 2.0 * total


def bench_precision(cfg: Any, prompt: list[int], rates: dict[str, Any], cispo_samples: int, repeats: int,
                    steps: int) -> dict[str, Any]:
    """Float32 as today (no training prefix sharing) against the new default (``dtype: auto`` on this
    CPU, training prefix sharing on), each: prefill/decode tokens/s, a distillation of 8, a CISPO
    update, their sum per extractor sample, achieved FLOP/s, |log ρ| of the on-policy update."""
    auto = resolve_dtype("auto", "cpu")
    out: dict[str, Any] = {"default_dtype": str(auto).removeprefix("torch.")}
    reqs = _requests(8)
    runs = [("float32", "float32", 0), ("default", str(auto).removeprefix("torch."), SHARE_PREFIX_TOKENS)]
    policy: HFPolicy | None = None
    for name, dtype, share in runs:
        if policy is None or dtype != "float32":
            policy, ext = _smol(cfg, dtype)
            ext.distill(reqs[:1])  # compile the schema, wrap the tokenizer
            torch.manual_seed(0)
            d_s = _best(functools.partial(ext.distill, reqs), 1)
            torch.manual_seed(0)
            samples = ext.distill(reqs)
            gen = _prefill_decode(policy, prompt, repeats, steps)
        c_s, ratios, flops = _cispo_step(policy, ext, samples, cispo_samples, share)
        matmul = rates[f"matmul_{dtype}_gflops"]
        out[name] = {
            "dtype": dtype, "train_share_prefix": share, **gen, "distill_8_s": round(d_s, 2),
            "answer_tokens_mean": round(sum(len(s.token_ids) for s, _ in samples) / len(samples), 1),
            "cispo_samples": cispo_samples, "cispo_s_per_sample": round(c_s / cispo_samples, 3),
            "extractor_sample_s": round(d_s / 8 + c_s / cispo_samples, 3),
            "train_gflops": round(flops / c_s / 1e9, 2), "train_over_matmul": round(flops / c_s / 1e9 / matmul, 3),
            "prefill_b8_over_matmul": round(gen["b8"]["prefill_gflops"] / matmul, 3),
            "log_ratio_abs_mean": float(f"{float(ratios.mean()):.3g}"), "log_ratio_abs_max": float(f"{float(ratios.max()):.3g}"),
        }
        _, nbytes = _body_params(policy)
        floor = nbytes / (rates["bandwidth_gbs"] * 1e9)
        out[name]["decode_b1_floor_s"] = round(floor, 4)
        out[name]["decode_b1_over_floor"] = round(gen["b1"]["decode_step_s"] / floor, 2)
    out["extractor_sample_speedup"] = round(out["float32"]["extractor_sample_s"] / out["default"]["extractor_sample_s"], 2)
    return out


def bench_profile(cfg: Any, dtype: str, rates: dict[str, Any]) -> dict[str, Any]:
    """Where a distillation of 8 spends its time: the model's forward passes (the prefix and the
    suffixes' prefill, then each decoding step), llguidance's masks, the log-softmax and sampling,
    and the rest (Python: the loop, the trie/grammar bookkeeping, decoding the text), each phase
    against its floor (FLOPs over the matmul rate for the prefill, weight bytes over bandwidth for
    a decoding step)."""
    import crl_train.policy.generate as gen_mod
    from crl_train.policy.grammar import GrammarState

    policy, ext = _smol(cfg, dtype)
    reqs = _requests(8)
    ext.distill(reqs[:1])
    timers: dict[str, list[float]] = {"prefill": [], "decode": [], "mask": [], "sampling": []}
    shapes: list[tuple[int, int, int]] = []

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = _clock()
            try:
                return fn(*a, **kw)
            finally:
                timers[name].append(_clock() - t0)
        return wrapper

    forward = policy.model.forward

    def model_call(*a: Any, **kw: Any) -> Any:
        ids = kw["input_ids"]
        name = "decode" if ids.shape[1] == 1 else "prefill"
        shapes.append((int(ids.shape[0]), int(ids.shape[1]), int(kw["attention_mask"].shape[1])))
        return timed(name, forward)(*a, **kw)

    patches = [(gen_mod, "tempered_logprobs"), (gen_mod, "sample_tokens"), (GrammarState, "allowed"), (GrammarState, "advance")]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr in patches]
    policy.model.forward = functools.wraps(forward)(model_call)  # keeps the signature generate.py reads
    try:
        gen_mod.tempered_logprobs = timed("sampling", gen_mod.tempered_logprobs)
        gen_mod.sample_tokens = timed("sampling", gen_mod.sample_tokens)
        GrammarState.allowed = timed("mask", GrammarState.allowed)  # type: ignore[method-assign]
        GrammarState.advance = timed("mask", GrammarState.advance)  # type: ignore[method-assign]
        torch.manual_seed(0)
        t0 = _clock()
        got = ext.distill(reqs)
        wall = _clock() - t0
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)
        policy.model.forward = forward  # type: ignore[method-assign]
    spent = {k: sum(v) for k, v in timers.items()}
    prefill_flops = sum(b * forward_flops(policy, t, w - t, 1) for b, t, w in shapes if t > 1)
    _, nbytes = _body_params(policy)
    decode_floor = len(timers["decode"]) * nbytes / (rates["bandwidth_gbs"] * 1e9)
    matmul = rates[f"matmul_{dtype}_gflops"] * 1e9
    return {
        "dtype": dtype, "total_s": round(wall, 3), "answer_tokens": [len(s.token_ids) for s, _ in got],
        "forward_shapes_prefill": [list(s) for s in shapes if s[1] > 1],
        "decode_steps": len(timers["decode"]), "decode_rows_mean": round(
            sum(s[0] for s in shapes if s[1] == 1) / max(1, len(timers["decode"])), 2),
        "prefill_s": round(spent["prefill"], 3), "prefill_floor_s": round(prefill_flops / matmul, 3),
        "decode_s": round(spent["decode"], 3), "decode_floor_s": round(decode_floor, 3),
        "decode_step_s_mean": round(spent["decode"] / max(1, len(timers["decode"])), 4),
        "mask_s": round(spent["mask"], 3), "sampling_s": round(spent["sampling"], 3),
        "python_s": round(wall - sum(spent.values()), 3),
    }


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
    ap.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                    help=f"comma list of the sections to run (default {','.join(DEFAULT_SECTIONS)}; all: {','.join(SECTIONS)})")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                    help="what the precision and profile sections time: process CPU seconds (default) or wall seconds")
    ap.add_argument("--decode-steps", type=int, default=16, help="decoding steps timed per batch size (precision)")
    ap.add_argument("--train-samples", type=int, default=16,
                    help="samples of the CISPO update timed per dtype in the precision section")
    args = ap.parse_args(argv)
    sections = {x.strip() for x in args.sections.split(",") if x.strip()}
    unknown = sections - set(SECTIONS)
    if unknown:
        ap.error(f"unknown --sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    extra_threads = [int(x) for x in args.distill_threads.split(",") if x.strip()]
    if args.threads < 1 or any(k < 1 for k in extra_threads):
        ap.error("--threads and --distill-threads take counts >= 1")
    torch.set_num_threads(args.threads)
    global _clock
    _clock = CLOCKS[args.clock]
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
    ext = Extractor(
        smol,
        ExtractorSettings(
            max_new_tokens=mc.max_new_tokens,
            max_context_tokens=mc.max_context_tokens,
            max_prompt_chars=cfg.experience.max_prompt_chars,
            structured=True,
            max_entry_chars=cfg.experience.max_entry_chars or 160,
        ),
    )
    from crl_gym.experience.prompts import build_distillation_prompt

    prompt = ext._prompt_ids(build_distillation_prompt(_requests(1)[0], max_chars=cfg.experience.max_prompt_chars,
                                                       max_ops=MAX_OPS), args.new_tokens)
    grammar = JsonGrammar.from_schema(ops_schema((), max_ops=MAX_OPS, max_text=cfg.experience.max_entry_chars or 160))
    out: dict[str, Any] = {"model": smol.name, "vocab": len(smol.tokenizer), "threads": torch.get_num_threads(),
                           "clock": args.clock,
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
    del smol, ext  # one model in memory at a time: the sections below build their own
    rates: dict[str, Any] = {}
    if sections & {"precision", "profile"}:
        rates = machine_rates(args.repeats)
        out["machine"] = rates
    if "precision" in sections:
        out["precision"] = bench_precision(cfg, prompt, rates, args.train_samples, args.repeats, args.decode_steps)
    if "profile" in sections:
        out["profile"] = bench_profile(cfg, str(resolve_dtype("auto", "cpu")).removeprefix("torch."), rates)
    if args.steps and "steps" in sections:
        out["step_time_s"] = {env: bench_steps(env, args.steps, args.extra)
                              for env in ("crl/Recall-v0", "crl/MiniHack-Room-5x5-v0")}
    out["load_avg_end"] = round(os.getloadavg()[0], 2)
    out["targets"] = {"extractor_sample_speedup": TARGET_EXTRACTOR_SPEEDUP, "train_over_matmul": TARGET_TRAIN_OVER_MATMUL,
                      "decode_b1_over_floor": TARGET_DECODE_OVER_FLOOR,
                      "constrained_over_free_b8": TARGET_CONSTRAINED_OVER_FREE}
    out["meets_targets"] = _verdict(out)
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return out


def _verdict(out: dict[str, Any]) -> dict[str, bool | None] | bool | None:
    """Each target measured in this run against its bound (None: its section did not run), and
    whether all that ran meet theirs."""
    prec = out.get("precision")
    ratio = out.get("generation", {}).get("b8", {}).get("constrained_over_free")
    each: dict[str, bool | None] = {
        "extractor_sample_speedup": None if prec is None else prec["extractor_sample_speedup"] >= TARGET_EXTRACTOR_SPEEDUP,
        "train_over_matmul": None if prec is None else prec["default"]["train_over_matmul"] >= TARGET_TRAIN_OVER_MATMUL,
        "decode_b1_over_floor": None if prec is None else prec["default"]["decode_b1_over_floor"] <= TARGET_DECODE_OVER_FLOOR,
        "constrained_over_free_b8": None if ratio is None else ratio <= TARGET_CONSTRAINED_OVER_FREE,
    }
    ran = [v for v in each.values() if v is not None]
    out["meets_each_target"] = each
    return None if not ran else all(ran)


if __name__ == "__main__":
    main()
