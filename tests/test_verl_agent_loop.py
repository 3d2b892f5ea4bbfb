"""verl's own agent-loop machinery drives ``crl_agent`` over ``crl/Recall-v0`` and a real ``crl-experience serve``.

Runs in the verl environment (``make test-verl``: ``.venv-verl``, docs/wrappers.md "From verl").
verl's ``AgentLoopWorker`` (the class its ``AgentLoopManager`` runs as a Ray actor) is built from
verl's own composed ``ppo_trainer`` config with the agent-loop YAML of examples/verl; it
instantiates our loop through hydra for each sample, pads and batches the outputs into a
``DataProto``. The model behind ``server_manager`` is a tiny random-init Qwen2 generating on CPU
(tests/_verl_fixtures.py), the stand-in for the vLLM server of a real run.

The bank starts empty. Asserted: every copy ran its row's condition; in step 1 the guided ones were
shown nothing (the bank had no entry), the extractor distilled step 1's episodes into entries, and in
step 2 the guided ones were shown one; generated tokens are trained (mask 1), observation tokens
not (mask 0); ``rm_scores`` hold the env's success; verl's ``compute_advantage`` with
``crl_split_subgroup`` gives ``split_subgroup_advantages`` of the rewards over (task, condition the
episode ran) with the episodes' fields, and over the rows without them; the trainer's
``on_step_end`` ends each step once on the service, which then credits the entries step 2 used;
evaluation rows carry ``rollout_step`` -1 and are held out of every step (``/stats`` printed).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from _servers import stop_server
from _verl_fixtures import (
    ENV_ID,
    ENV_KWARGS,
    REPLIES,
    CPUServer,
    save_tiny_actor,
    start_service,
    verl_config,
)
from _waiting import settle
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

from crl_gym.integrations.verl.service import close_clients
from crl_train.algorithms import split_subgroup_advantages
from crl_train.integrations.verl import (
    ADV_ESTIMATOR,
    ComplementaryTrainer,
    batch_outcomes,
    estimating,
    rollout_n,
    rows_for,
)
from crl_train.rollout.contract import condition_ids

pytestmark = pytest.mark.slow

GROUP_SIZE = 4
SEEDS = [0, 1]


def loop_yaml(tmp_path: Path, url: str) -> Path:
    """The agent-loop YAML of examples/verl/agent_loops.yaml, pointed at this test's service."""
    entries = yaml.safe_load((Path(__file__).parents[1] / "examples" / "verl" / "agent_loops.yaml").read_text())
    entries[0].update({"service_url": url, "env_kwargs": ENV_KWARGS, "env_id": ENV_ID})
    path = tmp_path / "agent_loops.yaml"
    path.write_text(yaml.safe_dump(entries))
    return path


def batch_of(rows: list[dict[str, Any]], n: int, step: int, config: Any, tokenizer: Any, path: Path) -> DataProto:
    """Rows as verl's trainer hands them to the rollout: written to parquet, read by verl's
    ``RLHFDataset`` and its ``collate_fn``, a ``uid`` per row, each row repeated ``n`` times next
    to itself (``repeat(interleave=True)``) and ``global_steps`` on every row (the v1 trainer's)."""
    pd.DataFrame(rows).to_parquet(path)
    dataset = RLHFDataset(str(path), tokenizer, config.data)
    batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(dataset))]))
    batch.non_tensor_batch["uid"] = np.array([f"{path.stem}-{i}" for i in range(len(rows))], dtype=object)
    batch.non_tensor_batch["global_steps"] = np.full(len(rows), step)
    batch.pop(batch_keys=["dummy_tensor"])
    return batch.repeat(n, interleave=True)


def test_verl_worker_runs_crl_agent_against_the_service(tmp_path: Path) -> None:
    proc, client = start_service(tmp_path, seed_entries=False)  # an empty bank: the extractor writes it
    try:
        model, tokenizer = save_tiny_actor(tmp_path / "actor")
        n = rollout_n(GROUP_SIZE)
        config = verl_config(tmp_path / "actor", [
            "actor_rollout_ref.rollout.name=vllm",  # what a real run serves with; nothing here starts it
            f"actor_rollout_ref.rollout.n={n}", "actor_rollout_ref.rollout.prompt_length=256",
            "actor_rollout_ref.rollout.response_length=96",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loop_yaml(tmp_path, client.url)}",
        ])
        server = CPUServer(model, tokenizer)
        worker = AgentLoopWorker(config, server)
        rows = rows_for(SEEDS)
        assert [r["extra_info"]["experience"] for r in rows] == ["guided", "free"] * len(SEEDS)
        size = len(rows) * n

        # step 1: the bank is empty, so the guided episodes are shown nothing
        server.weights_step = 0  # the weights the servers hold while step 1 rolls out
        first = asyncio.run(worker.generate_sequences(batch_of(rows, n, 1, config, tokenizer, tmp_path / "1.parquet")))
        assert len(first) == size and server.calls >= size
        assert list(first.non_tensor_batch["crl_condition"]) == [r["extra_info"]["experience"] for r in rows
                                                                 for _ in range(n)]
        assert all(e is None for e in first.non_tensor_batch["crl_entry"])
        check_batch(first, rows, n, tokenizer, step=1)

        # the trainer ends each step once (verl's fit calls on_step_end once per training step)
        trainer = ComplementaryTrainer.__new__(ComplementaryTrainer)
        trainer.config = config
        trainer.timing_raw = {}
        trainer.checkpoint_manager = _WeightSync()  # the GPU weight sync to the inference servers
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("CRL_EXPERIENCE_URL", client.url)
            trainer.global_steps = 1
            trainer.on_step_end()
            assert client.stats().steps_ended == 1
            stats = settle(client, lambda s: s.distilled >= size, f"{size} distilled", timeout=180.0, poll=1.0)
            assert stats.bank_size > 0, f"the extractor wrote no entry from step 1's episodes: {stats}"

            # step 2: every copy runs its row's condition; the guided ones are shown what the extractor wrote
            server.weights_step = 1  # on_step_end synced step 1's update
            second = asyncio.run(worker.generate_sequences(batch_of(rows, n, 2, config, tokenizer,
                                                                    tmp_path / "2.parquet")))
            conds = list(second.non_tensor_batch["crl_condition"])
            assert conds == [r["extra_info"]["experience"] for r in rows for _ in range(n)]
            assert [e is not None for e in second.non_tensor_batch["crl_entry"]] == [c == "guided" for c in conds]
            check_batch(second, rows, n, tokenizer, step=2)
            trainer.global_steps = 2
            trainer.on_step_end()
        assert trainer.checkpoint_manager.synced == [1, 2]
        stats = settle(client, lambda s: s.credited > 0, "a credit", timeout=180.0, poll=1.0)  # the entries step 2's guided episodes used
        assert stats.steps_ended == 2 and stats.last_ended_step == 2

        # held-out evaluation: rollout_step -1; the service holds those requests out of every step
        evaluation = asyncio.run(worker.generate_sequences(batch_of(rows_for(SEEDS, evaluation=True), n, 2, config,
                                                                    tokenizer, tmp_path / "val.parquet")))
        assert set(evaluation.non_tensor_batch["crl_rollout_step"]) == {-1}
        assert client.stats().held_out_requests == size
        assert client.end_step(3).requests == 0
        stats = client.stats()
        assert stats.distilled > 0 and stats.credited > 0
        print(f"\n/stats: {stats}")
    finally:
        close_clients()
        err = stop_server(proc, client)
    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]


def check_batch(out: DataProto, rows: list[dict[str, Any]], n: int, tokenizer: Any, *, step: int) -> None:
    """Masks, rewards and advantages of one rollout batch of ``rows`` run ``n`` times each."""
    nt, size = out.non_tensor_batch, len(out)
    assert all(nt["crl_valid"]) and set(nt["crl_rollout_step"]) == {step}
    # the weight versions the server reported reach the batch (verl's v1 trainer reads them per sample)
    assert set(nt["min_global_steps"]) == set(nt["max_global_steps"]) == {step - 1}
    turns = np.array(nt["crl_turns"], dtype=int)
    assert (turns >= 1).all()
    mask, responses = out.batch["response_mask"], out.batch["responses"]
    reply_ids = set(tokenizer.convert_tokens_to_ids(list(REPLIES)))
    for i in range(size):
        trained = responses[i][mask[i].bool()].tolist()
        # the trained tokens are the replies the model generated (and the end of each turn) only
        assert sum(t in reply_ids for t in trained) == turns[i]
        assert set(trained) <= reply_ids | {tokenizer.eos_token_id}
        if turns[i] > 1:  # an observation came between two replies: in the response, masked out
            length = int(out.batch["attention_mask"][i, -mask.shape[1]:].sum())
            assert (mask[i, :length] == 0).any()
    rewards = out.batch["rm_scores"].sum(-1)
    assert rewards.tolist() == [1.0 if s else 0.0 for s in nt["crl_success"]]

    # verl's compute_advantage with our estimator, on the batch the loop produced
    data = DataProto(batch=out.batch.clone(), non_tensor_batch=dict(nt))
    data.batch["token_level_rewards"] = data.batch["rm_scores"]
    conds = condition_ids(list(nt["crl_condition"]))
    group = torch.tensor([r["extra_info"]["group"] for r in rows for _ in range(n)])
    row = torch.arange(size) // n
    fields = [{k: nt[k][i] for k in ("crl_group", "crl_condition", "crl_valid")} for i in range(size)]
    with estimating(batch_outcomes(fields, list(nt["uid"]))):  # what crl_sync reads from the episodes
        by_task = compute_advantage(data, adv_estimator=ADV_ESTIMATOR).batch["advantages"]
    by_uid = compute_advantage(data, adv_estimator=ADV_ESTIMATOR).batch["advantages"]  # the rows alone
    first = mask.float().argmax(1)
    for adv, want in ((by_task, split_subgroup_advantages(rewards, group, conds)),
                      (by_uid, split_subgroup_advantages(rewards, row, torch.zeros_like(row)))):
        assert torch.allclose(adv[torch.arange(size), first], want, atol=1e-6), (adv[:, 0], want)
        assert torch.equal(adv != 0, (adv != 0) & mask.bool())  # nothing outside the response tokens


class _WeightSync:
    """Stands in for verl's CheckpointEngineManager (it pushes the trained weights to the GPU servers)."""

    def __init__(self) -> None:
        self.synced: list[int] = []

    def update_weights(self, step: int) -> None:
        self.synced.append(step)


