"""ActionTrie and constraint_mask: allowed sets, prefixes, EOS handling, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from crl_train.policy.trie import ActionTrie, ThinkThenChoose, constraint_mask


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


def test_think_then_choose_reasons_freely_then_follows_the_trie() -> None:
    trie = ActionTrie.from_actions(["go", "up"], CharTokenizer())
    think = ThinkThenChoose(trie, think_tokens=3, free_ids=[0, 5, 6, 7])
    assert think.free_ids == (5, 6, 7)  # EOS never allowed while reasoning: it would end the answer
    for n in range(3):
        assert think.allowed([5] * n) is think.free_ids  # one shared tuple per position
    assert think.allowed([5, 6, 7]) == (ord("g"), ord("u"))
    assert think.allowed([5, 6, 7, ord("u"), ord("p")]) == (0,)
    assert think.action_of([5, 6, 7, ord("u"), ord("p"), 0]) == "up"
    assert think.action_of([5, 6, 7]) is None and think.action_of([ord("u"), ord("p")]) is None
    assert think.is_complete([5, 6, 7, ord("g"), ord("o")]) and not think.is_complete([ord("g"), ord("o")])
    assert think.eos_token_id == 0 and len(think) == 2 and sorted(think.actions) == ["go", "up"]
    # think_tokens=0 is the trie itself
    plain = ThinkThenChoose(trie, 0, [])
    assert plain.allowed([]) == trie.allowed([]) and plain.action_of([ord("g"), ord("o"), 0]) == "go"


def test_think_then_choose_bad_input() -> None:
    trie = ActionTrie.from_actions(["go"], CharTokenizer())
    with pytest.raises(ValueError, match="think_tokens must be >= 0"):
        ThinkThenChoose(trie, -1, [1])
    with pytest.raises(ValueError, match="no free token ids"):
        ThinkThenChoose(trie, 2, [0])  # only EOS


def test_constraint_mask_converts_a_shared_allowed_set_once_per_call() -> None:
    shared = (1, 2)
    out = constraint_mask(torch.zeros(3, 4), [shared, shared, (3,)])
    assert torch.isinf(out[:, 0]).all() and torch.isfinite(out[:2, 1:3]).all() and torch.isinf(out[:2, 3]).all()
    assert torch.isfinite(out[2, 3]) and torch.isinf(out[2, :3]).all()


def test_constraint_mask_takes_a_grammars_boolean_mask_as_a_row() -> None:
    logits = torch.zeros(3, 4)
    mask = torch.tensor([False, True, True, False])
    out = constraint_mask(logits, [mask, (0,), None])
    assert out[0].tolist() == [float("-inf"), 0.0, 0.0, float("-inf")]
    assert out[1].tolist() == [0.0, float("-inf"), float("-inf"), float("-inf")] and out[2].tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="expected bool"):
        constraint_mask(logits, [torch.ones(4), None, None])
    with pytest.raises(ValueError, match="expected bool"):
        constraint_mask(logits, [torch.ones(3, dtype=torch.bool), None, None])
    with pytest.raises(ValueError, match="allows no token"):  # a tuple row is checked (a grammar's mask when made)
        constraint_mask(logits, [torch.zeros(4, dtype=torch.bool), (), None])
    # masks only: one masked_fill, rows without a mask kept
    both = constraint_mask(logits, [mask, None, mask])
    assert both[0].tolist() == both[2].tolist() == out[0].tolist() and both[1].tolist() == [0.0] * 4
    assert constraint_mask(logits[:1], [mask]).tolist() == [out[0].tolist()]
