"""The batched sampling loop of :class:`~crl_train.policy.hf.HFPolicy` (left padding, KV cache).

Written out instead of ``model.generate`` so that each sampled token's log-prob is taken from
exactly the distribution the training recomputation uses (``sampling.tempered_logprobs``), with
the per-sequence trie constraints, and so the allowed sets can be stored with the tokens.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from .base import FinishReason, Generation, SamplingConfig
from .sampling import sample_tokens, tempered_logprobs
from .trie import ActionTrie


def _cache_arg(model: Any) -> str:
    """Name of the KV-cache argument: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def _stop_cut(text: str, stops: Sequence[str]) -> str | None:
    """``text`` cut after the earliest stop string, or None when none occurs."""
    best: int | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i + len(s) < best):
            best = i + len(s)
    return None if best is None else text[:best]


def generate_batch(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    tries: Sequence[ActionTrie | None],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    device: torch.device,
    generator: torch.Generator | None = None,
) -> list[Generation]:
    """Sample one response per prompt. Constrained rows follow their trie and end with its EOS."""
    n = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding: every prompt ends at the same column
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attn[i, width - len(p) :] = 1
    ids, attn = ids.to(device), attn.to(device)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    cache_arg = _cache_arg(model)
    eos = set(int(e) for e in eos_token_ids)

    tokens: list[list[int]] = [[] for _ in range(n)]
    logps: list[list[float]] = [[] for _ in range(n)]
    allowed_log: list[list[tuple[int, ...] | None]] = [[] for _ in range(n)]
    finish: list[FinishReason | None] = [None] * n
    texts: list[str | None] = [None] * n

    out = model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True)
    for _ in range(max_new_tokens):
        logits = out.logits[:, -1, :]
        allowed: list[tuple[int, ...] | None] = []
        for i in range(n):
            trie = tries[i]
            if trie is None or finish[i] is not None:
                allowed.append(None)
            else:
                allowed.append(trie.allowed(tokens[i]))
        lp = tempered_logprobs(logits, sampling.temperature, allowed)
        nxt = sample_tokens(lp, top_p=sampling.top_p, greedy=sampling.greedy, generator=generator)
        chosen = lp.gather(-1, nxt[:, None]).squeeze(-1).tolist()
        nxt_list = nxt.tolist()
        for i in range(n):
            if finish[i] is not None:
                nxt_list[i] = pad_token_id  # keeps the batch shape; never recorded
                continue
            tok = int(nxt_list[i])
            tokens[i].append(tok)
            logps[i].append(float(chosen[i]))
            allowed_log[i].append(allowed[i])
            trie = tries[i]
            if tok in eos or (trie is not None and tok == trie.eos_token_id):
                finish[i] = "stop"
            elif sampling.stop and trie is None:
                cut = _stop_cut(tokenizer.decode(tokens[i], skip_special_tokens=True), sampling.stop)
                if cut is not None:
                    finish[i], texts[i] = "stop", cut
        if all(f is not None for f in finish):
            break
        step_ids = torch.tensor(nxt_list, dtype=torch.long, device=device)[:, None]
        attn = torch.cat([attn, torch.ones((n, 1), dtype=attn.dtype, device=device)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(
            input_ids=step_ids, attention_mask=attn, position_ids=positions, use_cache=True,
            **{cache_arg: _cache_of(out)},
        )

    gens = []
    for i in range(n):
        trie = tries[i]
        text = texts[i]
        if text is None:
            action = trie.action_of(tokens[i]) if trie is not None and finish[i] == "stop" else None
            text = action if action is not None else tokenizer.decode(tokens[i], skip_special_tokens=True)
        gens.append(
            Generation(
                prompt_ids=prompts[i],
                token_ids=tokens[i],
                logprobs=logps[i],
                text=text,
                finish_reason=finish[i] or "length",
                allowed=allowed_log[i] if trie is not None else None,
            )
        )
    return gens
