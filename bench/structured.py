"""What the extractor's grammar costs: tiny-model generation of the same prompts, constrained and free.

The tiny preset's extractor (random-initialised Qwen2, tokenizer trained on the preset's corpus)
generates answers to the same prompts — distillation prompts of synthetic MiniHack-like episodes,
refinement prompts and Merge windows — twice: under each task's JSON Schema (``JsonGrammar``
through llguidance, as the extractor does) and unconstrained, one prompt at a time (so no row
waits for another in a batch). The free side runs, per prompt, as many tokens as a warm-up
constrained answer to it took (a random model rarely stops by itself), so both sides generate
answers of the same lengths and the comparison is per generated token. The two sides alternate
prompt by prompt, in flipping order, for ``--repeats`` passes, so a burst of load on a shared
machine lands on both; each pass gives a ratio of per-token times, and ``constrained_over_free``
is their median.

Also reported: the grammar's one-time costs (wrapping the tokenizer, compiling each schema,
starting a matcher), the per-token cost of the mask alone (``mask_us_per_token``), and — for the
actor's admissible-action constraint — the token trie against llguidance on the same action lists
(``actor_mask_us``: µs per token, and µs to build the constraint, which the actor does every turn
for a new action list), the measurement behind keeping the trie.

    python bench/structured.py --json            # last line: one JSON object
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from crl_gym.experience.merge import MergePrompt  # noqa: E402
from crl_gym.experience.prompts import (  # noqa: E402
    MergeItem,
    build_distillation_prompt,
    build_merge_prompt,
    build_refinement_prompt,
)
from crl_gym.experience.schemas import merge_schema, ops_schema, refinement_schema  # noqa: E402
from crl_gym.protocol import DistillationRequest, ExperienceRef, Step, Trajectory  # noqa: E402
from crl_train.config import ExtractorSettings  # noqa: E402
from crl_train.extractor.model import Extractor  # noqa: E402
from crl_train.extractor.worker import TINY_ENTRY_CHARS  # noqa: E402
from crl_train.policy.grammar import JsonGrammar  # noqa: E402

ACTIONS = ("north", "east", "south", "west", "northeast", "southeast", "southwest", "northwest")


def _corpus() -> list[str]:
    """The tiny preset's tokenizer corpus (its envs' texts and every prompt), as a run builds it."""
    from crl_train.config import load_config
    from crl_train.rollout.envs import raw_env_factory, seed_texts, tokenizer_texts

    cfg = load_config(None)
    return tokenizer_texts(cfg.env, raw_env_factory(cfg.env), ACTIONS, seed_entries=seed_texts(cfg))


def _requests(n: int) -> list[DistillationRequest]:
    out = []
    for i in range(n):
        steps = [Step(f"You see a room; the stairs are {ACTIONS[(i + t) % 4]} of you.", ACTIONS[(i * 3 + t) % 8], 0.0)
                 for t in range(6)]
        exp = ExperienceRef(i + 1, "Find the staircase down and walk towards it.", 0) if i % 2 else None
        out.append(DistillationRequest(task="Reach the staircase down.", trajectory=Trajectory(steps=steps),
                                       outcome=float(i % 3 == 0), success=i % 3 == 0, experience=exp,
                                       condition="guided" if exp else "free"))
    return out


def _tasks(n: int) -> list[tuple[str, str, dict[str, Any]]]:
    """``(task, prompt, schema)`` triples of the three tasks."""
    tasks = []
    for r in _requests(n):
        ids = {r.experience.id} if r.experience else set()
        tasks.append(("distill", build_distillation_prompt(r, max_chars=1500), ops_schema(ids, max_text=TINY_ENTRY_CHARS)))
    for i in range(max(1, n // 4)):
        prompt = build_refinement_prompt("Where are the stairs?", ExperienceRef(i, "Walk to the stairs.", 0), "a room")
        tasks.append(("refine", prompt, refinement_schema(TINY_ENTRY_CHARS)))
        items = [MergeItem(f"E{j}", f"Entry {j}: walk {ACTIONS[j % 8]} towards the stairs.") for j in range(1, 9)]
        tasks.append(("merge", MergePrompt(build_merge_prompt(items), [x.label for x in items]),
                      merge_schema([x.label for x in items], TINY_ENTRY_CHARS)))
    return tasks


def _one(policy: Any, ids: list[int], allowed: Any, new_tokens: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    (g,) = policy.generate([ids], new_tokens, allowed=None if allowed is None else [allowed])
    return time.perf_counter() - t0, len(g.token_ids)


def actor_masks(policy: Any, steps: int = 2000) -> dict[str, float]:
    """Per-token µs of the actor's constraint: the trie's allowed set + mask, llguidance's bitmask + mask."""
    import llguidance

    from crl_train.policy.trie import ActionTrie, constraint_mask

    tok = policy.tokenizer
    eos = policy.eos_token_ids[0]
    trie = ActionTrie.from_actions(ACTIONS, tok, eos)
    vocab = int(policy.model.get_output_embeddings().weight.shape[0])
    logits = torch.zeros(1, vocab)
    paths = [list(tok.encode(a, add_special_tokens=False)) + [eos] for a in ACTIONS]
    t0 = time.perf_counter()
    n = 0
    while n < steps:
        for path in paths:
            for k in range(len(path)):
                constraint_mask(logits, [trie.allowed(path[:k])])
                n += 1
    trie_us = (time.perf_counter() - t0) / n * 1e6
    engine = policy.grammar_engine
    lark = "start: " + " | ".join(json.dumps(a) for a in ACTIONS)
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    matcher = llguidance.LLMatcher(engine.ll_tokenizer, grammar, log_level=0)
    state = engine.start(JsonGrammar.from_schema({"enum": list(ACTIONS)}))
    state.matcher = matcher  # the same state machinery, over the plain action strings
    t0 = time.perf_counter()
    n = 0
    while n < steps:
        for path in paths:
            matcher.reset()
            for k, tok_id in enumerate(path):
                got = state.allowed()
                assert got is not None
                constraint_mask(logits, [got[1]])
                if k < len(path) - 1:
                    matcher.consume_token(tok_id)
                n += 1
    grammar_us = (time.perf_counter() - t0) / n * 1e6
    # building the constraint, once per actor turn (the admissible actions change every turn)
    b0 = time.perf_counter()
    for _ in range(50):
        ActionTrie.from_actions(ACTIONS, tok, eos)
    trie_build = (time.perf_counter() - b0) / 50 * 1e6
    b0 = time.perf_counter()
    for i in range(50):  # a new action list each time, as a new turn brings (no compiled grammar to reuse)
        g = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(f"{a} {i}") for a in ACTIONS))
        llguidance.LLMatcher(engine.ll_tokenizer, g, log_level=0)
    llg_build = (time.perf_counter() - b0) / 50 * 1e6
    return {"trie": round(trie_us, 2), "llguidance": round(grammar_us, 2),
            "trie_build": round(trie_build, 1), "llguidance_build": round(llg_build, 1)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16, help="distillation prompts (a quarter as many refine and merge)")
    ap.add_argument("--repeats", type=int, default=5, help="alternating constrained / free passes")
    ap.add_argument("--vocab", type=int, default=512, help="tiny tokenizer size (the preset's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = ap.parse_args(argv)

    from crl_train.policy.base import SamplingConfig
    from crl_train.policy.tiny import build_tiny_policy

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    policy = build_tiny_policy(_corpus(), vocab_size=args.vocab, max_positions=1024, seed=args.seed,
                               sampling=SamplingConfig(seed=args.seed))
    build_s = time.perf_counter() - t0
    ext = Extractor(
        policy,
        ExtractorSettings(
            max_new_tokens=48,
            max_context_tokens=1024,
            constrained=True,
            max_entry_chars=TINY_ENTRY_CHARS,
        ),
    )
    tasks = _tasks(args.prompts)
    engine = policy.grammar_engine
    compile_ms: dict[str, float] = {}
    for task, _, schema in tasks:
        g = ext._grammar(schema)
        c0 = engine.compile_s
        engine.grammar_text(g)
        engine.start(g)
        compile_ms[task] = max(compile_ms.get(task, 0.0), (engine.compile_s - c0) * 1000)
    rows = []
    for _, prompt, schema in tasks:
        g = ext._grammar(schema)
        rows.append((ext._prompt_ids(prompt, ext._budget(g)), g, ext._budget(g)))
    # warm-up (untimed): each row's constrained answer, whose length its free twin will run
    warm = [policy.generate([ids], budget, allowed=[g])[0] for ids, g, budget in rows]
    lengths = [len(w.token_ids) for w in warm]
    ratios: list[float] = []
    per_side: dict[str, list[float]] = {"c": [], "f": []}
    tokens = 0
    for rep in range(args.repeats):
        times = {"c": 0.0, "f": 0.0}
        counts = {"c": 0, "f": 0}
        for i, (ids, g, budget) in enumerate(rows):
            for side in (("c", "f") if (rep + i) % 2 == 0 else ("f", "c")):
                dt, k = _one(policy, ids, g, budget) if side == "c" else _one(policy, ids, None, lengths[i])
                times[side] += dt
                counts[side] += k
        per_side["c"].append(times["c"] / counts["c"] * 1e6)
        per_side["f"].append(times["f"] / counts["f"] * 1e6)
        ratios.append(per_side["c"][-1] / per_side["f"][-1])
        tokens = counts["c"]
    # the mask alone: the warm-up answers' tokens replayed through their grammars (compute the
    # mask, intern it, consume the token), as training does
    m0 = time.perf_counter()
    for (_, g, _), w in zip(rows, warm, strict=True):
        engine.replay(g, w.token_ids)
    mask_us = (time.perf_counter() - m0) * 1e6 / max(1, sum(lengths))
    out: dict[str, Any] = {
        "benchmark": "structured",
        "prompts": {t: sum(1 for x in tasks if x[0] == t) for t in ("distill", "refine", "merge")},
        "repeats": args.repeats,
        "constrained_tokens_per_pass": tokens,
        "ratios": [round(r, 4) for r in ratios],
        "constrained_us_per_token": round(statistics.median(per_side["c"]), 1),
        "free_us_per_token": round(statistics.median(per_side["f"]), 1),
        "mask_us_per_token": round(mask_us, 1),
        "actor_mask_us": actor_masks(policy),
        "tiny_policy_build_s": round(build_s, 2),
        "tokenizer_wrap_ms": round(engine.tokenizer_s * 1000, 2),
        "grammar_compile_ms": {k: round(v, 2) for k, v in compile_ms.items()},
        "constrained_over_free": round(statistics.median(ratios), 4),
    }
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
