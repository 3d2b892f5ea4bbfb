"""What the verl tests share: verl's real config, a tiny actor saved where verl loads it from, and a
CPU generator behind verl's ``server_manager.generate`` interface (the stand-in for the vLLM server
of a real run, which needs a GPU: scripts/gpu_check.sh runs that one).

The actor is a random-initialised tiny Qwen2 (not a pretrained model). Its tokenizer holds each
whole reply it may give as one added token (``<action>north</action>``, a ``search_and_ask`` tool
call, ...) and the generator's ``sequence_bias`` makes every reply one of them followed by the end
of the turn: which one is the model's own sample.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
from pathlib import Path
from typing import Any

import torch
from _servers import seed_recall_secrets, start_extractor_server
from transformers import AddedToken

from crl_gym.clients import RemoteClient
from crl_gym.envs.recall import task_name
from crl_train.policy.tiny import build_tiny_model, train_tiny_tokenizer

ENV_ID = "crl/Recall-v0"
ENV_KWARGS = {"num_tasks": 4, "length": 2, "num_actions": 2}
ACTIONS = ("north", "east")
REPLIES = tuple(f"<action>{a}</action>" for a in ACTIONS)
TOOL_CALL = '<tool_call>\n{"name": "search_and_ask", "arguments": {"query": "which way first?"}}\n</tool_call>'


def save_tiny_actor(path: Path, replies: tuple[str, ...] = REPLIES) -> tuple[Any, Any]:
    """A tiny actor whose tokenizer knows ``replies`` as single tokens, saved (model and tokenizer) to ``path``."""
    texts = [f"Task: {task_name(i)}. Play its secret sequence of 2 actions, one per turn; a wrong action ends "
             f"the episode.\nValid actions: north, east" for i in range(4)]
    tokenizer = train_tiny_tokenizer(texts, vocab_size=400)
    tokenizer.add_tokens([AddedToken(r, normalized=False, special=False) for r in replies])
    model = build_tiny_model(tokenizer, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer


class CPUServer:
    """``generate(request_id, *, prompt_ids, sampling_params, ...) -> TokenOutput`` on CPU with
    ``model.generate``: one of ``replies`` (the model's sample among them), then the end of the turn."""

    def __init__(self, model: Any, tokenizer: Any, replies: tuple[str, ...] = REPLIES, seed: int = 0) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.reply_ids = tokenizer.convert_tokens_to_ids(list(replies))
        eos = tokenizer.eos_token_id
        # each bias only has to beat a random-init model's logits (|logit| << 1)
        self.bias = [[[i], 40.0] for i in self.reply_ids] + [[[i, eos], 80.0] for i in self.reply_ids]
        self.generator = torch.Generator().manual_seed(seed)
        self.lock = threading.Lock()
        self.calls = 0
        self.weights_step = 0
        """The weight version it reports, as verl's LLMServerClient does (``global_steps`` and the
        ``min_global_steps`` / ``max_global_steps`` of a turn)."""

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kwargs: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        ids, logprobs = await asyncio.to_thread(self._generate, list(prompt_ids), float(sampling_params.get("temperature", 1.0)))
        step = self.weights_step
        return TokenOutput(token_ids=ids, log_probs=logprobs, stop_reason="completed",
                           extra_fields={"global_steps": step, "min_global_steps": step, "max_global_steps": step})

    def _generate(self, prompt_ids: list[int], temperature: float) -> tuple[list[int], list[float]]:
        with self.lock, torch.no_grad():
            self.calls += 1
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator)))
            out = self.model.generate(
                torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=3, do_sample=temperature > 0, temperature=max(temperature, 1e-3), top_k=0,
                sequence_bias=self.bias, eos_token_id=self.tokenizer.eos_token_id,
                pad_token_id=self.tokenizer.pad_token_id, output_scores=True, return_dict_in_generate=True)
            new = out.sequences[0, len(prompt_ids):]
            scores = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)[0]
            return [int(t) for t in new], [float(s) for s in scores[: len(new)]]


def verl_config(model_dir: Path, overrides: list[str]) -> Any:
    """verl's own ``ppo_trainer`` config (its defaults, composed by hydra) with ``overrides``."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=[f"actor_rollout_ref.model.path={model_dir}", *overrides])


def start_service(tmp_path: Path, *, seed_entries: bool = True) -> tuple[subprocess.Popen[bytes], RemoteClient]:
    """``crl-experience serve --extractor`` with the tiny preset on Recall (a real subprocess), seeded
    with one entry per task (what the guided episodes are shown) unless ``seed_entries`` is False."""
    proc, client = start_extractor_server(tmp_path, env_ids=[ENV_ID], env_kwargs=ENV_KWARGS)
    if seed_entries:
        seed_recall_secrets(client, **ENV_KWARGS)
    return proc, client
