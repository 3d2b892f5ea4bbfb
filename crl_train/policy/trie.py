"""Constrained decoding: a token trie over an env's admissible actions (+ EOS).

A random-init model cannot spell ``north``; restricting each sampled token to the continuations
of the admissible actions makes every response a valid action. The per-token allowed sets are
stored with the generation (``Generation.allowed``) and applied again when log-probs are
recomputed for training, so the ratio compares like with like.

>>> trie = ActionTrie.from_token_ids({"north": [5, 6], "nop": [5], "south": [7]}, eos_token_id=0)
>>> trie.allowed([])          # first token: any action's first token
(5, 7)
>>> trie.allowed([5])         # "nop" is complete (EOS allowed) or continue to "north"
(0, 6)
>>> trie.allowed([5, 6])      # only EOS after a complete leaf
(0,)
>>> trie.action_of([5, 6, 0])
'north'

:class:`ThinkThenChoose` puts a fixed number of free "reasoning" tokens before the trie: how the
tiny preset's extractor stands in for a thinking model (long reasoning, short answer).

>>> think = ThinkThenChoose(trie, think_tokens=2, free_ids=range(1, 9))
>>> think.allowed([3])        # still reasoning: any token but EOS
(1, 2, 3, 4, 5, 6, 7, 8)
>>> think.allowed([3, 8])     # reasoning over: the trie's first tokens
(5, 7)
>>> think.action_of([3, 8, 7, 0])
'south'
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class _Node:
    children: dict[int, _Node] = field(default_factory=dict)
    action: str | None = None  # set when the path from the root spells a complete action


class ActionTrie:
    """Trie of tokenised actions. An action's token path ends in EOS, which ends the response."""

    def __init__(self, eos_token_id: int) -> None:
        self.eos_token_id = int(eos_token_id)
        self._root = _Node()
        self._actions: dict[tuple[int, ...], str] = {}

    @classmethod
    def from_token_ids(cls, actions: Mapping[str, Sequence[int]], eos_token_id: int) -> ActionTrie:
        """Build from ``{action text: token ids}`` (ids without EOS)."""
        trie = cls(eos_token_id)
        for text, ids in actions.items():
            trie.add(text, ids)
        if not trie._actions:
            raise ValueError("ActionTrie needs at least one admissible action, got none")
        return trie

    @classmethod
    def from_actions(
        cls,
        actions: Iterable[str],
        tokenizer: PreTrainedTokenizerBase,
        eos_token_id: int | None = None,
    ) -> ActionTrie:
        """Tokenise each action on its own (no special tokens) with ``tokenizer``.

        ``eos_token_id`` defaults to ``tokenizer.eos_token_id``. Empty / whitespace-only actions
        are skipped (they cannot be told apart from a bare EOS).
        """
        eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        if eos is None:
            raise ValueError(
                "ActionTrie.from_actions: the tokenizer has no eos_token_id; pass eos_token_id"
            )
        mapping: dict[str, list[int]] = {}
        for text in actions:
            if not isinstance(text, str):
                raise TypeError(
                    "ActionTrie.from_actions: actions must be str, got "
                    f"{type(text).__name__}: {text!r}"
                )
            if text.strip():
                mapping[text] = list(tokenizer.encode(text, add_special_tokens=False))
        return cls.from_token_ids(mapping, int(eos))

    def add(self, text: str, ids: Sequence[int]) -> None:
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError(f"ActionTrie.add: action {text!r} has no tokens")
        if self.eos_token_id in ids:
            raise ValueError(
                f"ActionTrie.add: action {text!r} contains the EOS token {self.eos_token_id}"
            )
        node = self._root
        for tok in ids:
            node = node.children.setdefault(tok, _Node())
        if node.action is None:  # two texts with the same tokens: the first one names the path
            node.action = text
            self._actions[tuple(ids)] = text

    def __len__(self) -> int:
        return len(self._actions)

    @property
    def actions(self) -> list[str]:
        return list(self._actions.values())

    def _walk(self, prefix: Sequence[int]) -> _Node:
        node = self._root
        for pos, tok in enumerate(prefix):
            nxt = node.children.get(int(tok))
            if nxt is None:
                raise ValueError(
                    f"ActionTrie: token {int(tok)} at position {pos} of {list(prefix)} is not a "
                    "valid continuation"
                )
            node = nxt
        return node

    def allowed(self, prefix: Sequence[int]) -> tuple[int, ...]:
        """Sorted token ids allowed after ``prefix`` (response tokens so far, without EOS)."""
        node = self._walk(prefix)
        out = set(node.children)
        if node.action is not None:
            out.add(self.eos_token_id)
        return tuple(sorted(out))

    def is_complete(self, prefix: Sequence[int]) -> bool:
        """True when ``prefix`` spells a whole action (EOS may follow)."""
        try:
            return self._walk(prefix).action is not None
        except ValueError:
            return False

    def action_of(self, ids: Sequence[int]) -> str | None:
        """The action spelled by ``ids`` (a trailing EOS is ignored); None if not an action."""
        ids = [int(i) for i in ids]
        if ids and ids[-1] == self.eos_token_id:
            ids = ids[:-1]
        return self._actions.get(tuple(ids))


class ThinkThenChoose:
    """``think_tokens`` free tokens (any of ``free_ids``; never EOS), then one action of ``trie``.

    Same interface as :class:`ActionTrie` (``allowed``, ``is_complete``, ``action_of``,
    ``eos_token_id``), so ``generate_batch`` takes either. ``action_of`` returns only the chosen
    action: like a thinking model's reasoning, the free tokens are trained on but never stored as
    the answer. Every reasoning position allows the same tuple object, so the per-token allowed
    sets a generation stores cost one reference each.
    """

    def __init__(self, trie: ActionTrie, think_tokens: int, free_ids: Iterable[int]) -> None:
        if think_tokens < 0:
            raise ValueError(f"ThinkThenChoose: think_tokens must be >= 0, got {think_tokens}")
        self.trie = trie
        self.think_tokens = int(think_tokens)
        self.free_ids: tuple[int, ...] = tuple(
            sorted({int(i) for i in free_ids} - {trie.eos_token_id})
        )
        if think_tokens and not self.free_ids:
            raise ValueError("ThinkThenChoose: no free token ids to reason with")

    @property
    def eos_token_id(self) -> int:
        return self.trie.eos_token_id

    @property
    def actions(self) -> list[str]:
        return self.trie.actions

    def __len__(self) -> int:
        return len(self.trie)

    def allowed(self, prefix: Sequence[int]) -> tuple[int, ...]:
        if len(prefix) < self.think_tokens:
            return self.free_ids
        return self.trie.allowed(prefix[self.think_tokens :])

    def is_complete(self, prefix: Sequence[int]) -> bool:
        return len(prefix) >= self.think_tokens and self.trie.is_complete(
            prefix[self.think_tokens :]
        )

    def action_of(self, ids: Sequence[int]) -> str | None:
        if len(ids) <= self.think_tokens:
            return None
        return self.trie.action_of(ids[self.think_tokens :])


Constraint = ActionTrie | ThinkThenChoose
"""What ``generate_batch`` accepts per row to constrain it."""


def constraint_mask(
    logits: torch.Tensor, allowed: Sequence[Sequence[int] | torch.Tensor | None]
) -> torch.Tensor:
    """``logits`` [N, V] with every token outside ``allowed[n]`` set to ``-inf`` (None: row kept).

    ``allowed[n]`` is a sequence of token ids, or a boolean mask [V] (a grammar's, already built).

    >>> constraint_mask(torch.zeros(2, 3), [(1,), None]).tolist()
    [[-inf, 0.0, -inf], [0.0, 0.0, 0.0]]
    >>> constraint_mask(torch.zeros(1, 3), [torch.tensor([True, False, True])]).tolist()
    [[0.0, -inf, 0.0]]
    """
    if logits.dim() != 2 or logits.shape[0] != len(allowed):
        raise ValueError(
            f"constraint_mask: logits {tuple(logits.shape)} do not match {len(allowed)} "
            "allowed sets"
        )
    if all(a is None for a in allowed):
        return logits
    vocab = logits.shape[1]
    if all(
        a is None or isinstance(a, torch.Tensor) for a in allowed
    ):  # grammar rows: masks already built
        return _mask_rows(logits, allowed)  # type: ignore[arg-type]
    keep = torch.ones((len(allowed), vocab), dtype=torch.bool, device=logits.device)
    seen: dict[
        int, torch.Tensor
    ] = {}  # rows sharing one allowed object (ThinkThenChoose) convert it once
    for i, row in enumerate(allowed):
        if row is None:
            continue
        if isinstance(row, torch.Tensor):
            _check_mask(row, i, vocab)
            keep[i] = row
            continue
        ids = seen.get(id(row))
        if ids is None:
            ids = torch.as_tensor(list(row), dtype=torch.long, device=logits.device)
            if ids.numel() == 0:
                raise ValueError(f"constraint_mask: row {i} allows no token")
            if int(ids.max()) >= vocab or int(ids.min()) < 0:
                raise ValueError(
                    f"constraint_mask: row {i} allows token ids outside the vocabulary of {vocab}"
                )
            seen[id(row)] = ids
        keep[i] = False
        keep[i, ids] = True
    return logits.masked_fill(~keep, float("-inf"))


def _check_mask(row: torch.Tensor, i: int, vocab: int) -> None:
    if row.dtype != torch.bool or row.shape != (vocab,):
        raise ValueError(
            f"constraint_mask: row {i}'s mask is {row.dtype} {tuple(row.shape)}, expected "
            f"bool ({vocab},)"
        )


def _mask_rows(logits: torch.Tensor, masks: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Boolean-mask rows (None: kept) in one ``masked_fill``: a grammar step costs a few µs here.
    A mask row must allow a token; a grammar's are checked once, when made (``GrammarEngine``)."""
    vocab = logits.shape[1]
    for i, m in enumerate(masks):
        if m is not None:
            _check_mask(m, i, vocab)
    if len(masks) == 1:
        assert masks[0] is not None
        return logits.masked_fill(~masks[0].to(logits.device), float("-inf"))
    every = torch.ones(vocab, dtype=torch.bool)
    keep = torch.stack([every if m is None else m for m in masks]).to(logits.device)
    return logits.masked_fill(~keep, float("-inf"))
