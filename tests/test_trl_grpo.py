"""TRL's real GRPOTrainer trains an actor through the adapter against ``crl-experience serve --extractor``.

Two optimizer steps of ``ComplementaryGRPOTrainer`` on CPU, ``crl/Recall-v0`` wrapped by
``crl_gym.integrations.trl`` over a ``RemoteClient``, the tiny preset's extractor behind a real
server subprocess. The actor is a tiny random-initialised Qwen2 (not a pretrained model): it cannot
write a tool call of its own, so its tokenizer holds the call's fixed text as two added tokens and
``GenerationConfig.sequence_bias`` (passed through ``GRPOConfig.generation_kwargs``) steers its
sampling into ``<tool_call>{"name": "take_action", "arguments": {"action": A}}</tool_call>``; the
action A is the model's own sample among the env's actions. TRL parses the calls with its Qwen2.5
response template, runs them on the env, and takes the env's reward.

Asserted: the env was driven by parsed tool calls, two optimizer steps ran and each ended its
rollout step on the service, the service distilled and credited (``/stats``), and the advantages
the trainer trained on equal ``split_subgroup_advantages`` of the envs' rewards with the guided /
free halves the envs ran (not TRL's pooled group normalisation); an evaluation afterwards sends
its episodes as held out (``rollout_step`` -1).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from _servers import seed_recall_secrets, start_extractor_server, stop_server, wait_healthy  # noqa: E402
from _waiting import settle  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AddedToken  # noqa: E402
from trl import GRPOConfig  # noqa: E402
from trl.chat_template_utils import qwen2_5_chat_template  # noqa: E402

import crl_gym  # noqa: E402,F401  (registers the crl/ envs)
from crl_gym.envs.recall import task_name  # noqa: E402
from crl_gym.integrations.trl import TRLExperience, dataset_rows  # noqa: E402
from crl_train.algorithms import split_subgroup_advantages  # noqa: E402
from crl_train.algorithms.advantages import FREE, GUIDED  # noqa: E402
from crl_train.integrations.trl import PAPER_SETTINGS, ComplementaryGRPOTrainer  # noqa: E402
from crl_train.policy.tiny import build_tiny_model, train_tiny_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

ENV_KWARGS = {"num_tasks": 4, "length": 2, "num_actions": 2}
ACTIONS = ("north", "east")
CALL_OPEN = '<tool_call>\n{"name": "take_action", "arguments": {"action": "'
CALL_CLOSE = '"}}\n</tool_call>'
GENERATIONS = 4


def tool_calling_tiny_actor() -> tuple[Any, Any, list[list[Any]]]:
    """A tiny random-init Qwen2, its tokenizer (Qwen2.5's chat template, the call's text as two
    added tokens) and the ``sequence_bias`` that makes every sample a ``take_action`` call."""
    texts = [f"Task: {task_name(i)}. Play its secret sequence of 2 actions, one per turn; a wrong action ends "
             f"the episode.\nActions so far: (none)\nTurn 1: action 1 of 2?"
             "\nValid actions: north, east"
             for i in range(4)]
    tokenizer = train_tiny_tokenizer(texts + [qwen2_5_chat_template], vocab_size=512)
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in (CALL_OPEN, CALL_CLOSE)])
    tokenizer.chat_template = qwen2_5_chat_template  # TRL's add_response_schema knows it: calls parse
    model = build_tiny_model(tokenizer, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    open_id, close_id = tokenizer.convert_tokens_to_ids([CALL_OPEN, CALL_CLOSE])
    action_ids = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in ACTIONS]
    # Each bias only has to beat a random-init model's logits (|logit| << 1): start the call, then
    # an action (each of the same bias: the model's own logits pick), close it, end the turn.
    bias: list[list[Any]] = [[[open_id], 20.0]]
    for ids in action_ids:
        bias.append([[open_id, ids[0]], 40.0])
        bias += [[[*ids[:k], ids[k]], 40.0] for k in range(1, len(ids))]
        bias.append([[*ids, close_id], 60.0])
    bias.append([[close_id, tokenizer.eos_token_id], 80.0])
    return model, tokenizer, bias


class RecordingTrainer(ComplementaryGRPOTrainer):
    """Keeps, per generation batch, what the envs say (reward, condition, turns) and the advantages trained on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[dict[str, Any]] = []

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)
        envs = self.environments
        self.batches.append({
            "rewards": [env.get_reward() for env in envs],  # idempotent once the episode ended
            "conditions": [env.condition for env in envs],
            "turns": [env.turns for env in envs],
            "requests": [env.request for env in envs],
            "advantages": output["advantages"].detach().clone(),
        })
        return output


def test_trl_grpo_trainer_drives_the_served_extractor(tmp_path: Path) -> None:
    proc, client = start_extractor_server(tmp_path, env_ids=["crl/Recall-v0"], env_kwargs=ENV_KWARGS, wait=False)
    try:
        model, tokenizer, bias = tool_calling_tiny_actor()  # built while the server starts
        wait_healthy(client, proc)
        seed_recall_secrets(client, **ENV_KWARGS)
        session = TRLExperience(client, "crl/Recall-v0", env_kwargs=ENV_KWARGS)
        args = GRPOConfig(
            output_dir=str(tmp_path / "trl"), max_steps=2, per_device_train_batch_size=2 * GENERATIONS,
            gradient_accumulation_steps=1, num_generations=GENERATIONS, max_completion_length=192,
            max_tool_calling_iterations=3, learning_rate=1e-3, logging_steps=1, report_to="none",
            save_strategy="no", use_cpu=True, seed=0, generation_kwargs={"sequence_bias": bias},
            per_device_eval_batch_size=2 * GENERATIONS,
            **PAPER_SETTINGS,
        )
        trainer = RecordingTrainer(
            model=model, processing_class=tokenizer, args=args, experience=session,
            train_dataset=Dataset.from_list(dataset_rows(list(range(4)))),
        )
        trainer.train()

        assert trainer.state.global_step == 2
        assert [r.step for r in session.ended] == [0, 1]
        assert len(trainer.batches) == 2
        for batch in list(trainer.batches):
            assert sum(batch["turns"]) > 0, "no tool call was parsed and run"
            assert all(r is not None for r in batch["requests"]), "every episode is submitted"
            conds = batch["conditions"]
            # two prompts x four generations: the first half of each group guided, the rest free
            assert conds == ["guided", "guided", "free", "free"] * 2
            rewards = torch.tensor(batch["rewards"])
            group = torch.arange(len(conds)) // GENERATIONS
            cond = torch.tensor([GUIDED if c == "guided" else FREE for c in conds])
            expected = split_subgroup_advantages(rewards, group, cond)
            assert torch.allclose(batch["advantages"], expected, atol=1e-5), (batch["advantages"], expected)
            # TRL's own: one pool per prompt, Bessel std + 1e-4; it differs once a group's halves differ
            pooled = rewards.view(-1, GENERATIONS)
            trl_own = ((pooled - pooled.mean(1, keepdim=True)) / (pooled.std(1, keepdim=True) + 1e-4)).flatten()
            if not torch.allclose(trl_own, expected, atol=1e-3):
                assert not torch.allclose(batch["advantages"], trl_own, atol=1e-3)
            assert trainer.last_split is not None
        steps = {r.rollout_step for b in trainer.batches for r in b["requests"]}
        assert steps == {0, 1}
        # held-out evaluation: its episodes reach the service with rollout_step -1 (never credited)
        trainer.evaluate(eval_dataset=Dataset.from_list(dataset_rows([0, 1])))
        assert len(trainer.batches) == 3 and len(session.ended) == 2
        assert {r.rollout_step for r in trainer.batches[-1]["requests"]} == {-1}
        assert session.step == 1

        settle(client, lambda s: s.distilled > 0 and s.credited > 0, "a distillation and a credit", timeout=120.0,
               poll=1.0)
    finally:
        err = stop_server(proc, client)
    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
