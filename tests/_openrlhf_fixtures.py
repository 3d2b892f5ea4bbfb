"""Stand-ins for what OpenRLHF's agent mode hands an executor on a GPU node, built from real parts.

* :class:`HFEngine` — the tiny HF policy behind the shape of OpenRLHF's ``RolloutRayActor.generate``
  (``await engine.generate(prompt_token_ids, sampling_params, multi_modal_data=None)`` returning a
  vLLM ``RequestOutput``: ``.outputs[0].token_ids / .text / .finish_reason / .logprobs``). vLLM's
  engine cannot run here (no CUDA); the tokens are really sampled by a model. ``choices`` restricts
  each turn to a few texts (the tiny random model cannot write an action otherwise).
* :class:`SamplingParamsLike` — the fields of ``vllm.SamplingParams`` OpenRLHF's
  ``_dispatch_prompts_to_vllm`` sets (vLLM is not importable here).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from _trainer_fixtures import TEXTS

from crl_gym.templates import SEARCH_AND_ASK_ANSWER_TEMPLATE, SYSTEM_REACT
from crl_train.policy.base import OptimConfig, SamplingConfig
from crl_train.policy.tiny import build_tiny_policy

ACTIONS = ["<action>east</action>", "<action>west</action>", "search_and_ask[which way is the exit?]"]


def agent_policy(seed: int = 0) -> Any:
    """A tiny random policy whose tokenizer knows the texts of these tests (system prompt, actions)."""
    texts = [*TEXTS, SYSTEM_REACT, SEARCH_AND_ASK_ANSWER_TEMPLATE, *ACTIONS, "Valid actions: east, west"]
    return build_tiny_policy(texts, vocab_size=400, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64,
                             seed=seed, sampling=SamplingConfig(seed=seed), optim=OptimConfig(lr=1e-3))


@dataclass
class SamplingParamsLike:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = None
    min_tokens: int = 1
    skip_special_tokens: bool = False
    logprobs: int | None = None


class HFEngine:
    """See the module docstring. ``requested`` records every call's ``max_tokens``."""

    def __init__(self, policy: Any, choices: list[str] | None = None) -> None:
        self.policy = policy
        self.choices = choices
        self.requested: list[int] = []
        self.prompts: list[list[int]] = []
        self._lock = threading.Lock()

    def _generate(self, prompt: list[int], max_tokens: int) -> Any:
        with self._lock:  # one model, many concurrent episodes
            allowed = [list(self.choices)] if self.choices else None
            (gen,) = self.policy.generate([prompt], max_tokens, allowed=allowed)
            return gen

    async def generate(self, prompt_token_ids: list[int], sampling_params: Any, multi_modal_data: Any = None) -> Any:
        assert multi_modal_data is None
        max_tokens = int(sampling_params.max_tokens)
        self.requested.append(max_tokens)
        self.prompts.append(list(prompt_token_ids))
        gen = await asyncio.to_thread(self._generate, list(prompt_token_ids), max_tokens)
        text = self.policy.tokenizer.decode(gen.token_ids, skip_special_tokens=sampling_params.skip_special_tokens)
        logprobs = None
        if sampling_params.logprobs is not None:
            logprobs = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(gen.token_ids, gen.logprobs, strict=True)]
        comp = SimpleNamespace(token_ids=list(gen.token_ids), text=text, finish_reason=gen.finish_reason,
                               logprobs=logprobs, gen_logprobs=list(gen.logprobs))
        return SimpleNamespace(outputs=[comp], request_id=str(len(self.requested)))


__all__ = ["ACTIONS", "HFEngine", "SamplingParamsLike", "agent_policy"]
