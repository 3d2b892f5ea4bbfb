"""The batched sampling loop of :class:`~crl_train.policy.hf.HFPolicy` (left padding, KV cache).

Written out instead of ``model.generate`` so that each sampled token's log-prob is taken from
exactly the distribution the training recomputation uses (``sampling.tempered_logprobs``), with
the per-sequence constraints (an action trie, or a JSON grammar's state: ``grammar.py``), and so
the allowed sets can be stored with the tokens.

**Prefix reuse across turns.** A multi-turn prompt is the previous turn's prompt + response + the
new observation. Re-encoding it every turn costs O(T²) attention over the whole conversation (most
of a tiny model's rollout time). A row given a :class:`RowKV` whose ids are a prefix of its prompt
starts from those keys/values and encodes only the new tokens; rows of one batch may have different
cached lengths (the attention mask has holes between a row's cached part and its new part; position
ids count only real tokens, so every token sees what it would see without the cache).

**A batch's common prefix encoded once.** Prompts of one batch often start alike: the chat
template's system part and a task's fixed instructions (the extractor's distillation prompts are
mostly that). With ``share_prefix=N`` a batch whose rows have no cache of their own and whose
prompts share at least N leading tokens runs the model over that prefix once, at batch 1, and
gives every row those keys/values as its cache: the prefill then encodes only each row's suffix.
The suffixes are left-padded *after* the prefix (``[prefix][pad…][suffix]``): the attention mask
is 0 on the padding and the position ids count real tokens only, so each row computes what it
would without sharing (equal up to float rounding; ``tests/test_prefix_sharing.py``).

**Stopped rows leave the batch.** A batch runs until its longest answer ends; a row that has
stopped is dropped from the cache (``Cache.batch_select_indices``) and from every later decoding
step, so each step costs the rows still writing. Only the last position's logits are computed
(``logits_to_keep``), and the budget's last token is never fed (nothing reads its keys/values).

>>> shared_prefix_len([[1, 2, 3, 4], [1, 2, 3, 9, 9], [1, 2, 3]], min_tokens=2)
2
>>> shared_prefix_len([[1, 2, 3, 4], [7, 2, 3, 4]], min_tokens=1)
0
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .base import FinishReason, Generation, SamplingConfig
from .grammar import GrammarState
from .sampling import sample_tokens, tempered_logprobs
from .trie import Constraint

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

RowConstraint = Constraint | GrammarState
"""What constrains one row: a trie over actions (stateless, asked with the tokens so far) or a
grammar's state (advanced token by token)."""


def _cache_arg(model: PreTrainedModel) -> str:
    """Name of the KV-cache argument: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _last_logits_only(model: PreTrainedModel) -> dict[str, int]:
    """``logits_to_keep=1`` where the model takes it: generation reads only the last position's
    logits, and a prefill's full [n, T, V] logits cost a fifth of a small model's compute (its
    vocabulary projection) and n·T·V floats of memory."""
    return (
        {"logits_to_keep": 1}
        if "logits_to_keep" in inspect.signature(model.forward).parameters
        else {}
    )


def _cache_of(out: object) -> Any:
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


@dataclass
class RowKV:
    """One sequence's cached keys/values: per layer ``(k, v)``, each [kv_heads,
    len(ids), head_dim]."""

    ids: tuple[int, ...]
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    def prefix_of(self, prompt: Sequence[int]) -> bool:
        """True when these ids start ``prompt`` and leave at least one new token to encode."""
        n = len(self.ids)
        return n < len(prompt) and tuple(prompt[:n]) == self.ids


def _past_cache(past: Sequence[RowKV | None], device: torch.device) -> tuple[Any, torch.Tensor]:
    """The rows' cached keys/values left-padded into one ``DynamicCache``, and its [n, P] mask."""
    from transformers import DynamicCache

    n = len(past)
    width = max((len(p.ids) for p in past if p is not None), default=0)
    mask = torch.zeros((n, width), dtype=torch.long, device=device)
    some = next(p for p in past if p is not None)
    layers = []
    for layer, (k0, v0) in enumerate(some.layers):
        k = k0.new_zeros((n, k0.shape[0], width, k0.shape[-1]))
        v = v0.new_zeros((n, v0.shape[0], width, v0.shape[-1]))
        for i, p in enumerate(past):
            if p is not None:
                start = width - len(p.ids)
                k[i, :, start:] = p.layers[layer][0]
                v[i, :, start:] = p.layers[layer][1]
        layers.append((k, v))
    for i, p in enumerate(past):
        if p is not None:
            mask[i, width - len(p.ids) :] = 1
    return DynamicCache(ddp_cache_data=layers), mask


def shared_prefix_len(prompts: Sequence[Sequence[int]], min_tokens: int) -> int:
    """Length of the longest common token prefix of ``prompts``, capped to leave every prompt at
    least one token of its own (the last prompt token's logits start the answer); 0 when that is
    below ``min_tokens`` (too short to be worth a forward pass of its own), ``min_tokens`` < 1, or
    fewer than two prompts."""
    if min_tokens < 1 or len(prompts) < 2:
        return 0
    cap = min(len(p) for p in prompts) - 1
    first = prompts[0]
    n = 0
    while n < cap and all(p[n] == first[n] for p in prompts[1:]):
        n += 1
    return n if n >= min_tokens else 0


def _prefix_kv(model: PreTrainedModel, prefix: Sequence[int], device: torch.device) -> RowKV:
    """Keys/values of ``prefix`` from one batch-1 forward pass (what every sharing row
    starts from)."""
    ids = torch.tensor([list(prefix)], dtype=torch.long, device=device)
    out = model(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        position_ids=torch.arange(ids.shape[1], device=device)[None],
        use_cache=True,
        **_last_logits_only(model),
    )
    cache = _cache_of(out)
    return RowKV(
        tuple(int(t) for t in prefix), [(layer.keys[0], layer.values[0]) for layer in cache.layers]
    )


def _row_kv(
    cache: Any, attn: torch.Tensor, prefill_width: int, i: int, ids: tuple[int, ...], fed_new: int
) -> RowKV:
    """Row ``i``'s real positions in ``cache``: its prefill columns, then ``fed_new``
    generated tokens."""
    cols = torch.cat(
        [
            attn[i, :prefill_width].nonzero().squeeze(-1),
            torch.arange(prefill_width, prefill_width + fed_new, device=attn.device),
        ]
    )
    layers = [
        (layer.keys[i].index_select(1, cols), layer.values[i].index_select(1, cols))
        for layer in cache.layers
    ]
    return RowKV(ids, layers)


def generate_batch(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    tries: Sequence[RowConstraint | None],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    device: torch.device,
    generator: torch.Generator | None = None,
    past: Sequence[RowKV | None] | None = None,
    keep_kv: bool = False,
    share_prefix: int = 0,
) -> tuple[list[Generation], list[RowKV] | None]:
    """Sample one response per prompt. Constrained rows follow their trie (or grammar) and end with
    its EOS.

    ``past[i]``: cached keys/values of a prefix of ``prompts[i]`` (see the module docstring; a row
    whose cache is not a prefix of its prompt is encoded in full). ``keep_kv``: also return each
    row's keys/values of ``prompt + response[:-1]`` (every token fed to the model), for its next
    turn. ``share_prefix``: when no row has a usable ``past``, encode the prompts' common prefix
    once if it is at least this many tokens (0 = never; module docstring).
    """
    n = len(prompts)
    rows_past: list[RowKV | None] = [
        p if p is not None and p.prefix_of(prompts[i]) else None
        for i, p in enumerate(past or [None] * n)
    ]
    if all(p is None for p in rows_past):
        shared = shared_prefix_len(prompts, share_prefix)
        if shared:
            common = _prefix_kv(model, prompts[0][:shared], device)
            rows_past = [common] * n
    new_parts = [
        prompts[i][len(p.ids) :] if p is not None else prompts[i] for i, p in enumerate(rows_past)
    ]
    width = max(len(p) for p in new_parts)
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(new_parts):  # left padding: every prompt ends at the same column
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attn[i, width - len(p) :] = 1
    ids, attn = ids.to(device), attn.to(device)
    cache_arg = _cache_arg(model)
    extra: dict[str, Any] = {}
    if any(p is not None for p in rows_past):
        cache, past_mask = _past_cache(rows_past, device)
        attn = torch.cat([past_mask, attn], dim=1)
        extra[cache_arg] = cache
    positions = (attn.cumsum(-1) - 1).clamp(min=0)[:, attn.shape[1] - width :]
    prefill_width = attn.shape[1]
    eos = set(int(e) for e in eos_token_ids)

    tokens: list[list[int]] = [[] for _ in range(n)]
    logps: list[list[float]] = [[] for _ in range(n)]
    allowed_log: list[list[tuple[int, ...] | None]] = [[] for _ in range(n)]
    finish: list[FinishReason | None] = [None] * n
    texts: list[str | None] = [None] * n

    # live[j]: the row that batch position j holds; a row leaves the batch when it stops
    live = list(range(n))
    kept: list[RowKV | None] = [None] * n
    last_only = _last_logits_only(model)
    extra.update(last_only)
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True, **extra)
    for step in range(max_new_tokens):
        logits = out.logits[:, -1, :]
        allowed: list[tuple[int, ...] | None] = []
        masks: list[tuple[int, ...] | torch.Tensor | None] = []
        for i in live:
            trie = tries[i]
            if trie is None:
                allowed.append(None)
                masks.append(None)
            elif isinstance(trie, GrammarState):
                got = trie.allowed()  # None while a thinking model reasons freely
                allowed.append(None if got is None else got[0])
                masks.append(None if got is None else got[1])
            else:
                allowed.append(trie.allowed(tokens[i]))
                masks.append(allowed[-1])
        lp = tempered_logprobs(logits, sampling.temperature, masks)
        nxt = sample_tokens(lp, top_p=sampling.top_p, greedy=sampling.greedy, generator=generator)
        chosen = lp.gather(-1, nxt[:, None]).squeeze(-1).tolist()
        nxt_list = nxt.tolist()
        for j, i in enumerate(live):
            tok = int(nxt_list[j])
            tokens[i].append(tok)
            logps[i].append(float(chosen[j]))
            allowed_log[i].append(allowed[j])
            trie = tries[i]
            if tok in eos or (trie is not None and tok == trie.eos_token_id):
                finish[i] = "stop"
            elif isinstance(trie, GrammarState):
                trie.advance(tok)
            elif sampling.stop and trie is None:
                cut = _stop_cut(
                    str(tokenizer.decode(tokens[i], skip_special_tokens=True)), sampling.stop
                )
                if cut is not None:
                    finish[i], texts[i] = "stop", cut
        last = step == max_new_tokens - 1
        stay = [j for j, i in enumerate(live) if finish[i] is None]
        cache = _cache_of(out)
        if keep_kv:  # a leaving row's keys/values: every token fed so far (its last one never is)
            for j, i in enumerate(live):
                if last or finish[i] is not None:
                    kept[i] = _row_kv(
                        cache,
                        attn,
                        prefill_width,
                        j,
                        tuple(prompts[i]) + tuple(tokens[i][:-1]),
                        len(tokens[i]) - 1,
                    )
        if last or not stay:
            break  # the last tokens are never fed: nothing reads their keys/values
        if len(stay) < len(live):
            # stopped rows leave the batch: every later step costs only the rows still writing
            keep = torch.tensor(stay, dtype=torch.long, device=device)
            cache.batch_select_indices(keep)
            attn, positions, nxt = attn[keep], positions[keep], nxt[keep]
            live = [live[j] for j in stay]
        attn = torch.cat([attn, torch.ones((len(live), 1), dtype=attn.dtype, device=device)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(
            input_ids=nxt[:, None].to(device),
            attention_mask=attn,
            position_ids=positions,
            use_cache=True,
            **{cache_arg: cache},
            **last_only,
        )

    rows_kv = None
    if keep_kv:
        rows_kv = [k for k in kept if k is not None]
        assert len(rows_kv) == n  # every row left the batch once, with its keys/values
    gens = []
    for i in range(n):
        trie = tries[i]
        text = texts[i]
        if text is None:
            action = trie.action_of(tokens[i]) if trie is not None and finish[i] == "stop" else None
            text = (
                action
                if action is not None
                else str(tokenizer.decode(tokens[i], skip_special_tokens=True))
            )
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
    return gens, rows_kv
