"""Token-level sampling and log-prob math shared by generation and recomputation.

Both paths go through :func:`tempered_logprobs`, so a sampled token's recorded log-prob and the
one recomputed for training come from the same formula:
``log_softmax(constraint_mask(logits) / temperature)``.

>>> import torch
>>> lp = tempered_logprobs(torch.tensor([[0.0, 0.0, 2.0]]), temperature=2.0, allowed=[(0, 1)])
>>> [round(x, 4) for x in lp[0].tolist()]   # 2 allowed tokens with equal logits: log(1/2) each
[-0.6931, -0.6931, -inf]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .trie import constraint_mask


def tempered_logprobs(
    logits: torch.Tensor,
    temperature: float,
    allowed: Sequence[Sequence[int] | torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """[N, V] logits -> [N, V] float32 log-probs of the masked, tempered distribution."""
    x = logits.float()
    if allowed is not None:
        x = constraint_mask(x, allowed)
    return torch.log_softmax(x / temperature, dim=-1)


def top_p_filter(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose mass reaches ``top_p`` (at least one); others -inf.

    >>> lp = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    >>> [round(p, 3) for p in top_p_filter(lp, 0.7).exp()[0].tolist()]  # 0.5 < 0.7 <= 0.5 + 0.3
    [0.5, 0.3, 0.0]
    """
    if top_p >= 1.0:
        return logprobs
    sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)
    cum = sorted_lp.exp().cumsum(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p.
    drop_sorted = (cum - sorted_lp.exp()) >= top_p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logprobs.masked_fill(drop, float("-inf"))


def sample_tokens(
    logprobs: torch.Tensor,
    *,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """[N, V] log-probs -> [N] sampled ids (arg-max when ``greedy``)."""
    if greedy:
        return logprobs.argmax(dim=-1)
    probs = top_p_filter(logprobs, top_p).exp()
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def selective_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    constraints: dict[int, tuple[int, ...]] | None = None,
    chunk: int = 1024,
) -> torch.Tensor:
    """Log-probs of ``targets`` [T] under ``logits`` [T, V] (row t predicts targets[t]).

    ``constraints`` maps a row index to its allowed ids. Chunks over T bound the float32 copy of
    the logits (a 150k vocabulary times 4k tokens would otherwise be 2.4 GB).
    """
    out = []
    for s in range(0, logits.shape[0], chunk):
        rows = logits[s : s + chunk]
        allowed = None
        if constraints:
            allowed = [constraints.get(s + i) for i in range(rows.shape[0])]
        lp = tempered_logprobs(rows, temperature, allowed)
        out.append(lp.gather(-1, targets[s : s + chunk, None]).squeeze(-1))
    return torch.cat(out) if out else logits.new_zeros(0, dtype=torch.float32)


def support_logprobs(
    logits: torch.Tensor,
    temperature: float,
    ids: torch.Tensor | None = None,
    k: int = 1,
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [T, k], logprobs [T, k])`` of the tempered, unconstrained distribution of ``logits``
    [T, V]: the log-probs of ``ids`` when given, else of each row's top-``k`` ids (k clamped to V).
    Differentiable in ``logits``; chunked over T like :func:`selective_logprobs`.

    >>> ids, lp = support_logprobs(torch.log(torch.tensor([[0.5, 0.3, 0.2]])), 1.0, k=2)
    >>> ids.tolist(), [round(x, 3) for x in lp.exp()[0].tolist()]
    ([[0, 1]], [0.5, 0.3])
    """
    out_ids, out_lp = [], []
    for s in range(0, logits.shape[0], chunk):
        lp = tempered_logprobs(logits[s : s + chunk], temperature)
        if ids is None:
            top_lp, top_ids = lp.topk(max(1, min(k, lp.shape[-1])), dim=-1)
            out_ids.append(top_ids)
            out_lp.append(top_lp)
        else:
            part = ids[s : s + chunk]
            out_ids.append(part)
            out_lp.append(lp.gather(-1, part))
    if not out_lp:
        width = k if ids is None else ids.shape[-1]
        return logits.new_zeros((0, width), dtype=torch.long), logits.new_zeros(
            (0, width), dtype=torch.float32
        )
    return torch.cat(out_ids), torch.cat(out_lp)
