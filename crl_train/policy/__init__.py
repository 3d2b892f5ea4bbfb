"""LLM policy backends: HF transformers (CPU/GPU), the tiny preset, constrained decoding, vLLM.

Importing this package does not import transformers or vLLM; ``HFPolicy`` and the tiny preset
load transformers on first use.
"""

from __future__ import annotations

from typing import Any

from .base import (
    FinishReason,
    Generation,
    LossFn,
    LossTerm,
    OptimConfig,
    Policy,
    SamplingConfig,
    TokenSequence,
    TrainBatch,
)
from .chat import ACTION_PATTERN, ChatFormatter, parse_action
from .trie import ActionTrie, ThinkThenChoose, constraint_mask

__all__ = [
    "ACTION_PATTERN",
    "ActionTrie",
    "ThinkThenChoose",
    "ChatFormatter",
    "FinishReason",
    "Generation",
    "HFPolicy",
    "LossFn",
    "LossTerm",
    "OptimConfig",
    "Policy",
    "SamplingConfig",
    "TINY_MODEL_NAME",
    "TokenSequence",
    "TrainBatch",
    "VLLMGenerator",
    "build_tiny_model",
    "build_tiny_policy",
    "constraint_mask",
    "gather_env_texts",
    "parse_action",
    "train_tiny_tokenizer",
]

_LAZY = {
    "HFPolicy": "hf",
    "TINY_MODEL_NAME": "tiny",
    "build_tiny_model": "tiny",
    "build_tiny_policy": "tiny",
    "gather_env_texts": "tiny",
    "train_tiny_tokenizer": "tiny",
    "VLLMGenerator": "vllm_engine",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
