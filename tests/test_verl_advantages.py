"""``crl_split_subgroup`` through verl's own ``compute_advantage``, against hand-computed values.

Runs in the verl environment (``make test-verl``). A batch of one task, six episodes: the guided
row's copies got r = 1, 0 (guided) and 0 (its search failed: it ran free), the free row's 0, 1
and 1, the last from an episode the env broke (``crl_valid`` False).

With the episodes' own conditions (what ``ComplementaryTrainer`` reads): guided {1, 0}: mean 1/2,
population std 1/2 → Â = ±1 (÷ (1/2 + 1e-6)); free {0, 0, 1}: mean 1/3, std √2/3 → Â = −1/√2,
−1/√2, √2; the broken episode 0. By ``uid`` alone (rows as subgroups): the guided row {1, 0, 0}
→ √2, −1/√2, −1/√2; the free row {0, 1, 1} (nothing says the last one broke) → −√2, 1/√2, 1/√2. ``crl_sync`` reads the
episodes' fields back in the form verl's TransferQueue rollout stores them.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import transfer_queue as tq
from omegaconf import OmegaConf
from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.utils.tensordict_utils import list_of_dict_to_tensordict

from crl_train.integrations.verl import (
    ADV_ESTIMATOR,
    ComplementaryTrainer,
    batch_outcomes,
    estimating,
    method_named,
    rollout_n,
    rows_for,
)

REWARDS = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
UIDS = ["g", "g", "g", "f", "f", "f"]
EXTRA = [{"crl_group": 0, "crl_condition": c, "crl_valid": v}
         for c, v in [("guided", True), ("guided", True), ("free", True), ("free", True), ("free", True),
                      ("free", False)]]
T = 3


def _batch() -> DataProto:
    scores = torch.zeros(len(REWARDS), T)
    scores[:, -1] = torch.tensor(REWARDS)
    mask = torch.ones(len(REWARDS), T, dtype=torch.long)
    mask[0, -1] = 0  # a response shorter than the width: its padding gets no advantage
    return DataProto.from_dict(tensors={"token_level_rewards": scores, "response_mask": mask},
                               non_tensors={"uid": np.array(UIDS, dtype=object)})


def _first_token(data: DataProto) -> list[float]:
    adv = data.batch["advantages"]
    assert torch.equal(adv, adv * data.batch["response_mask"])
    return adv[:, 0].tolist()


def _with_conditions() -> list[float]:
    s = 0.5 / (0.5 + 1e-6)
    m, sd = 1 / 3, math.sqrt(2) / 3
    return [s, -s, -m / (sd + 1e-6), -m / (sd + 1e-6), (1 - m) / (sd + 1e-6), 0.0]


def test_with_the_episodes_conditions() -> None:
    with estimating(batch_outcomes(EXTRA, UIDS)):
        got = _first_token(compute_advantage(_batch(), adv_estimator=ADV_ESTIMATOR))
    assert got == pytest.approx(_with_conditions(), abs=1e-6)


def test_crl_sync_reads_the_episodes_fields_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # The rows as verl's AgentLoopWorkerTQ stores them (list_of_dict_to_tensordict); the store itself
    # (TransferQueue, Ray actors of a cluster) and verl's own _compute_advantage around the estimator,
    # which reads the rewards from it, are replaced by what this batch holds.
    stored = list_of_dict_to_tensordict([{"uid": u, "extra_fields": e} for u, e in zip(UIDS, EXTRA, strict=True)])

    def kv_batch_get(keys: list[str], partition_id: str, select_fields: list[str]) -> Any:
        assert partition_id == "train" and len(keys) == len(UIDS)
        return stored.select(*select_fields)

    seen: dict[str, Any] = {}

    def verl_compute_advantage(self: Any, batch: Any, metrics: dict[str, Any]) -> Any:
        seen["adv"] = _first_token(compute_advantage(_batch(), adv_estimator=ADV_ESTIMATOR))
        return batch

    monkeypatch.setattr(tq, "kv_batch_get", kv_batch_get)
    monkeypatch.setattr(PPOTrainer, "_compute_advantage", verl_compute_advantage)
    trainer = ComplementaryTrainer.__new__(ComplementaryTrainer)
    trainer.config = OmegaConf.create({"crl": {"method": "complementary"}})
    batch = SimpleNamespace(keys=[f"{u}_{i}_0" for i, u in enumerate(UIDS)], partition_id="train")
    assert trainer._compute_advantage(batch, {}) is batch
    assert seen["adv"] == pytest.approx(_with_conditions(), abs=1e-6)
    # outside the trainer's call the estimator is back to the rows alone
    assert _first_token(compute_advantage(_batch(), adv_estimator=ADV_ESTIMATOR)) != pytest.approx(_with_conditions())


def test_by_uid_alone() -> None:
    got = _first_token(compute_advantage(_batch(), adv_estimator=ADV_ESTIMATOR))
    m, sd = 1 / 3, math.sqrt(2) / 3
    # the free row's three: {0, 1, 1}: mean 2/3, the same std
    want = [(1 - m) / (sd + 1e-6), -m / (sd + 1e-6), -m / (sd + 1e-6),
            -(2 / 3) / (sd + 1e-6), (1 / 3) / (sd + 1e-6), (1 / 3) / (sd + 1e-6)]
    assert got == pytest.approx(want, abs=1e-6)


def test_a_method_without_experience_pools_the_task() -> None:
    grpo = method_named("grpo")
    with estimating(batch_outcomes(EXTRA, UIDS), grpo):
        got = _first_token(compute_advantage(_batch(), adv_estimator=ADV_ESTIMATOR))
    r = torch.tensor(REWARDS[:5])  # the broken episode left out of the mean and std
    want = ((r - r.mean()) / (r.std(unbiased=False) + 1e-6)).tolist() + [0.0]
    assert got == pytest.approx(want, abs=1e-6)
    assert [row["extra_info"]["experience"] for row in rows_for([5, 6], grpo)] == ["free", "free"]
    assert rollout_n(6, grpo) == 6 and rollout_n(6) == 3
    with pytest.raises(ValueError, match="even"):
        rollout_n(5)


def test_outcomes_must_match_the_batch() -> None:
    with estimating(batch_outcomes(EXTRA[:4], UIDS[:4])), pytest.raises(ValueError, match="4 rows"):
        compute_advantage(_batch(), adv_estimator=ADV_ESTIMATOR)
