"""ActionTrie and constraint_mask: allowed sets, prefixes, EOS handling, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from crl_train.policy.trie import ActionTrie, constraint_mask


class CharTokenizer:
    """One token per character (ids from ord), EOS = 0: enough to tokenise actions."""

    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def test_allowed_sets_follow_the_trie() -> None:
    trie = ActionTrie.from_actions(["go", "gone", "up"], CharTokenizer())
    assert trie.allowed([]) == (ord("g"), ord("u"))
    assert trie.allowed([ord("g")]) == (ord("o"),)
    # "go" is complete (EOS allowed) and continues to "gone".
    assert trie.allowed([ord("g"), ord("o")]) == (0, ord("n"))
    assert trie.allowed([ord(c) for c in "gone"]) == (0,)
    assert trie.is_complete([ord(c) for c in "go"]) and not trie.is_complete([ord("g")])
    assert trie.action_of([ord(c) for c in "gone"] + [0]) == "gone"
    assert trie.action_of([ord("g")]) is None
    assert len(trie) == 3 and sorted(trie.actions) == ["go", "gone", "up"]


def test_invalid_prefix_names_the_position() -> None:
    trie = ActionTrie.from_actions(["up"], CharTokenizer())
    with pytest.raises(ValueError, match="position 1"):
        trie.allowed([ord("u"), ord("x")])
    assert not trie.is_complete([ord("x")])


def test_bad_actions() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ActionTrie.from_actions(["", "  "], CharTokenizer())
    with pytest.raises(TypeError, match="must be str"):
        ActionTrie.from_actions(["up", 3], CharTokenizer())  # type: ignore[list-item]
    with pytest.raises(ValueError, match="EOS"):
        ActionTrie.from_token_ids({"bad": [5, 0]}, eos_token_id=0)


def test_duplicate_token_paths_keep_the_first_text() -> None:
    trie = ActionTrie.from_token_ids({"a": [1], "A": [1]}, eos_token_id=0)
    assert len(trie) == 1 and trie.action_of([1, 0]) == "a"


def test_constraint_mask_and_softmax_renormalises() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    out = constraint_mask(logits, [(0, 2), None])
    assert out[0, 1] == -math.inf and out[0, 0] == 1.0 and out[0, 2] == 3.0
    assert torch.equal(out[1], logits[1])
    # Softmax over {1, 3}: p(3) = e^3 / (e^1 + e^3) = 1 / (1 + e^-2) = 0.880797
    p = torch.softmax(out[0], -1)
    assert p[2].item() == pytest.approx(0.880797, abs=1e-6)
    assert logits[0, 1] == 2.0  # input untouched


def test_constraint_mask_bad_input() -> None:
    with pytest.raises(ValueError, match="do not match"):
        constraint_mask(torch.zeros(2, 3), [None])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        constraint_mask(torch.zeros(1, 3), [(3,)])
    with pytest.raises(ValueError, match="allows no token"):
        constraint_mask(torch.zeros(1, 3), [()])
