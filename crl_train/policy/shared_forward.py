"""The training forward pass of a micro-batch whose rows share a prompt prefix, with gradients.

The samples of one distillation batch share their first ~190 prompt tokens (the chat template's
system part and the distillation instructions). Training ran the model over every row in full; here
the common prefix runs once, at batch 1, **with** gradients (LoRA adapters change it), its keys and
values are expanded over the rows (a view: backward sums the rows' gradients into the one prefix
pass), and each row's suffix runs on top, positions continuing after the prefix. Every row computes
what it would alone, up to float rounding (``tests/test_prefix_training.py``).

Only the logits that a loss reads are computed: the positions before a micro-batch's first trained
token (the loss mask) predict prompt tokens, which no loss reads, so the output starts at
``offset`` (``logits_to_keep``) and the vocabulary projection and log-softmax skip the prompt.

>>> import torch
>>> trained_offset(torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 1]]))
2
>>> common_prefix_len(torch.tensor([[5, 6, 7, 8], [5, 6, 9, 9]]), cap=3)
2
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

from .generate import _cache_arg, _cache_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def trained_offset(loss_mask: torch.Tensor) -> int:
    """The first logits row a loss reads: row t predicts token t + 1, so one before the earliest
    trained position of any row (0 when nothing is trained)."""
    trained = loss_mask.bool().any(0).nonzero()
    return max(int(trained[0]) - 1, 0) if trained.numel() else 0


def common_prefix_len(input_ids: torch.Tensor, cap: int) -> int:
    """How many leading tokens every row of ``input_ids`` [b, T] shares, at most ``cap``."""
    if cap <= 0:
        return 0
    same = (input_ids[:, :cap] == input_ids[:1, :cap]).all(0)
    differ = (~same).nonzero()
    return int(differ[0]) if differ.numel() else min(cap, int(input_ids.shape[1]))


def _keeps_logits(model: PreTrainedModel) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def _checkpointing(model: PreTrainedModel) -> bool:
    """Whether activation (gradient) checkpointing is on: it drops caches, so nothing is shared."""
    name = (
        "is_activation_checkpointing"
        if hasattr(type(model), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    return bool(getattr(model, name, False))


def _expanded_cache(cache: Any, rows: int) -> Any:
    """A ``DynamicCache`` whose every layer is ``cache``'s batch-1 keys/values viewed
    ``rows`` times."""
    from transformers import DynamicCache

    return DynamicCache(
        ddp_cache_data=[
            (layer.keys.expand(rows, -1, -1, -1), layer.values.expand(rows, -1, -1, -1))
            for layer in cache.layers
        ]
    )


def train_logits(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    share_min: int,
) -> tuple[torch.Tensor, int]:
    """``(logits [b, T - offset, V], offset)``: the logits of positions ``offset`` … T − 1 of a
    right-padded micro-batch (``offset``: :func:`trained_offset`), with gradients.

    When at least two rows share ``share_min`` (>= 1) leading tokens before ``offset``, that prefix
    runs once at batch 1 and each row's suffix on its keys/values (module docstring); with
    gradient checkpointing (which drops caches) or ``share_min`` 0, every row runs in full.
    """
    b, width = int(input_ids.shape[0]), int(input_ids.shape[1])
    offset = trained_offset(loss_mask)
    keep = width - offset
    kw: dict[str, Any] = {"logits_to_keep": keep} if _keeps_logits(model) else {}
    shared = 0
    if share_min >= 1 and b >= 2 and not _checkpointing(model):
        shared = common_prefix_len(input_ids, offset)
        if shared < share_min:
            shared = 0
    if not shared:
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kw
        ).logits
        return logits[:, -keep:], offset
    device = input_ids.device
    prefix = input_ids[:1, :shared]
    out = model(
        input_ids=prefix,
        attention_mask=torch.ones_like(prefix),
        use_cache=True,
        **({"logits_to_keep": 1} if kw else {}),
    )
    cache = _expanded_cache(_cache_of(out), b)
    positions = torch.arange(shared, width, device=device)[None].expand(b, -1)
    logits = model(
        input_ids=input_ids[:, shared:],
        attention_mask=attention_mask,
        position_ids=positions,
        use_cache=True,
        **{_cache_arg(model): cache},
        **kw,
    ).logits
    return logits[:, -keep:], offset


__all__ = ["common_prefix_len", "train_logits", "trained_offset"]
