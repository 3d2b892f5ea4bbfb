"""The tiny preset: on-the-fly tokenizer, random Qwen2 model, env text gathering, naming."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from crl_train.policy.tiny import (  # noqa: E402
    TINY_MODEL_NAME,
    build_tiny_model,
    build_tiny_policy,
    gather_env_texts,
    train_tiny_tokenizer,
)

TEXTS = ["You are in a room. The stairs are to the north.", "north", "south", "east", "west"]


def test_tokenizer_round_trips_and_has_chatml_specials() -> None:
    tok = train_tiny_tokenizer(TEXTS, vocab_size=320)
    assert len(tok) == 320
    for text in ["north", "unseen ünïcode ✓ text", "  spaced  "]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # Training learned merges: "north" (in the texts) takes fewer tokens than its 5 bytes.
    assert len(tok.encode("north", add_special_tokens=False)) < 5


def test_tokenizer_bad_input() -> None:
    with pytest.raises(ValueError, match="non-empty text"):
        train_tiny_tokenizer(["", None])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="vocab_size"):
        train_tiny_tokenizer(TEXTS, vocab_size=100)


def test_model_is_a_seeded_random_qwen2() -> None:
    tok = train_tiny_tokenizer(TEXTS, vocab_size=300)
    a = build_tiny_model(tok, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, seed=3)
    b = build_tiny_model(tok, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, seed=3)
    c = build_tiny_model(tok, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, seed=4)
    assert type(a).__name__ == "Qwen2ForCausalLM" and a.config.model_type == "qwen2"
    assert a.config.vocab_size == 300 and a.config.hidden_size == 32
    assert a.config.name_or_path == TINY_MODEL_NAME and "random init" in TINY_MODEL_NAME
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    with pytest.raises(ValueError, match="divisible"):
        build_tiny_model(tok, hidden=30, heads=4)


class FakeEnv:
    """A text env with admissible actions; raises on seed 2 to exercise the fallback."""

    def __init__(self) -> None:
        self.steps: list[str] = []

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        if seed == 2:
            raise RuntimeError("broken level")
        return f"room {seed}", {"task": "reach the stairs", "admissible_actions": ["north", "wait"]}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.steps.append(action)
        return f"moved {action}", 0.0, action == "wait", False, {"admissible_actions": ["north", "wait"]}


def test_gather_env_texts_cycles_admissible_actions_and_survives_errors(caplog: pytest.LogCaptureFixture) -> None:
    env = FakeEnv()
    texts = gather_env_texts([env], ["north", "south"], seeds=(0, 1, 2), steps=3)
    # Per good seed: reset obs, task, 2 admissible; step "north" (obs + 2), step "wait" (obs + 2) -> terminated.
    assert env.steps == ["north", "wait", "north", "wait"]
    assert texts[:2] == ["north", "south"]
    assert "room 0" in texts and "room 1" in texts and "moved wait" in texts and "reach the stairs" in texts
    assert len(texts) == 2 + 2 * (4 + 3 + 3)
    assert "broken level" in caplog.text


def test_build_tiny_policy_is_named_as_random_init() -> None:
    policy = build_tiny_policy(TEXTS, vocab_size=300, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    assert policy.name == TINY_MODEL_NAME
    assert policy.eos_token_ids[0] == policy.tokenizer.eos_token_id
    assert policy.pad_token_id == policy.tokenizer.pad_token_id
