"""The split-subgroup advantage mixin on OpenRLHF's real ``Experience`` objects, against our pure functions.

Samples are built as OpenRLHF's ``SamplesGenerator._process_response_into_experience`` builds them
from an agent response (rewards, ``extra_logs`` → ``info``), numbered and concatenated into
micro-batches as ``RemoteExperienceMaker.split_rollout_samples`` does, in a shuffled order.
"""

from __future__ import annotations

import argparse
import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("openrlhf.trainer.ppo_utils.experience")

from openrlhf.trainer.ppo_utils.experience import (  # noqa: E402
    Experience,
    make_experience_batch,
    split_experience_batch,
)
from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController  # noqa: E402
from openrlhf.utils.config import hierarchize  # noqa: E402

from crl_train.algorithms import FREE, GUIDED, grpo_advantages, split_subgroup_advantages  # noqa: E402
from crl_train.config import load_config  # noqa: E402
from crl_train.methods import make_method  # noqa: E402
from crl_train.openrlhf.advantages import SplitSubgroupAdvantageMixin, rollout_tensors  # noqa: E402

K = 4


def args(**over: Any) -> Any:
    flat = {"rollout.n_samples_per_prompt": K, "algo.kl.use_loss": False, "reward.overlong_buffer_len": None,
            "reward.stop_properly_penalty_coef": None}
    flat.update(over)
    return hierarchize(argparse.Namespace(**flat))


class Maker(SplitSubgroupAdvantageMixin):
    """The host OpenRLHF's ``RemoteExperienceMaker`` would be (its ``strategy.args`` and ``kl_ctl``)."""

    def __init__(self, method: str, kl: float = 0.0, **over: Any) -> None:
        self.strategy = SimpleNamespace(args=args(**over))
        self.kl_ctl = FixedKLController(kl)
        self.crl_method = make_method(load_config(None, [f"method={method}"]))


def sample(reward: float, guided: bool, valid: bool, prompt_len: int, actions: list[tuple[int, int]],
           total: int) -> Experience:
    """One response as ``_process_response_into_experience`` turns it into an Experience."""
    sequences = torch.randint(3, 100, (total,))
    attention = torch.ones(total, dtype=torch.long)
    action_mask = torch.zeros_like(attention)
    for s, e in actions:
        action_mask[s:e] = 1
    action_mask = action_mask[1:]
    info = {"response_clip_ratio": torch.tensor([False]), "reward": torch.tensor([reward]),
            "score": torch.tensor([reward]), "crl_guided": torch.tensor([float(guided)]),
            "crl_valid": torch.tensor([float(valid)]), "crl_turns": torch.tensor([float(len(actions))])}
    return Experience(sequences=sequences.unsqueeze(0), attention_mask=attention.unsqueeze(0),
                      action_mask=action_mask.unsqueeze(0), rewards=torch.tensor([reward]),
                      scores=torch.tensor([reward]), response_length=torch.tensor([total - prompt_len]),
                      truncated=torch.tensor([False]), total_length=torch.tensor([float(total)]),
                      prompts=["p"], labels=["l"], info=info)


def batch(rewards: list[float], valid: list[bool] | None = None, micro: int = 3,
          seed: int = 0) -> tuple[list[Experience], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Micro-batches of the samples in a shuffled order (index = original position), and the
    (reward, condition, valid) tensors in the original order."""
    rng = random.Random(seed)
    valid = valid or [True] * len(rewards)
    samples = []
    for i, (r, v) in enumerate(zip(rewards, valid, strict=True)):
        prompt = rng.randint(4, 9)
        turns = [(prompt, prompt + rng.randint(2, 5))]
        turns.append((turns[0][1] + 3, turns[0][1] + 3 + rng.randint(1, 4)))
        s = sample(r, i % K < K // 2, v, prompt, turns, turns[-1][1] + rng.randint(0, 2))
        s.index = [i]
        samples.append(s)
    order = list(range(len(samples)))
    rng.shuffle(order)
    shuffled = [samples[i] for i in order]
    exps = [Experience.concat_experiences(shuffled[j:j + micro], pad_token_id=0) for j in range(0, len(shuffled), micro)]
    cond = torch.tensor([GUIDED if i % K < K // 2 else FREE for i in range(len(rewards))])
    return exps, torch.tensor(rewards), cond, torch.tensor(valid)


def per_sample(exps: list[Experience], field: str) -> dict[int, torch.Tensor]:
    out = {}
    for e in exps:
        for row, i in enumerate(e.index):
            out[i] = getattr(e, field)[row]
    return out


REWARDS = [1.0, 0.0, 1.0, 1.0,  # group 0: guided 1 0 | free 1 1 (free has no spread)
           0.0, 0.0, 1.0, 0.0,  # group 1: guided 0 0 | free 1 0
           1.0, 0.0, 0.0, 1.0]  # group 2


def test_mixin_gives_the_split_subgroup_advantages_on_every_action_token() -> None:
    exps, r, cond, valid = batch(REWARDS)
    group = torch.arange(len(REWARDS)) // K
    want = split_subgroup_advantages(r, group, cond, valid=valid)
    assert want.abs().sum() > 0
    out = Maker("complementary").compute_advantages_and_returns(exps)
    adv, masks = per_sample(out, "advantages"), per_sample(out, "action_mask")
    for i in range(len(REWARDS)):
        mask = masks[i].float()
        assert torch.allclose(adv[i], want[i] * mask, atol=1e-6), i
        assert mask.sum() > 0
    for e in out:
        assert torch.equal(e.returns, e.advantages) and e.kl is None
        assert e.advantages.shape == e.action_mask.shape
        assert torch.allclose(e.info["return"], torch.stack([want[i] for i in e.index]))
        assert e.info["group_reward_std"].shape == (len(e.index),)
    # the zero-spread free subgroup of group 0 gets no signal
    assert all(float(adv[i].abs().sum()) == 0.0 for i in (2, 3))


def test_experiences_still_go_through_openrlhfs_replay_buffer_path() -> None:
    exps, *_ = batch(REWARDS)
    out = Maker("complementary").compute_advantages_and_returns(exps)
    items = [item for e in out for item in split_experience_batch(e)]
    merged = make_experience_batch(items)
    assert merged.advantages.shape[0] == len(REWARDS) and len(merged.info["crl_guided"]) == len(REWARDS)


def test_grpo_pools_the_conditions() -> None:
    exps, r, _, valid = batch(REWARDS, seed=3)
    want = grpo_advantages(r, torch.arange(len(REWARDS)) // K, valid=valid)
    adv, masks = per_sample(Maker("grpo").compute_advantages_and_returns(exps), "advantages"), per_sample(exps, "action_mask")
    for i in range(len(REWARDS)):
        assert torch.allclose(adv[i], want[i] * masks[i].float(), atol=1e-6)


def test_env_errors_get_no_advantage_and_stay_out_of_the_statistics() -> None:
    valid = [True] * len(REWARDS)
    valid[1] = False  # group 0, guided: its reward would otherwise set the guided mean
    exps, r, cond, v = batch(REWARDS, valid=valid, seed=5)
    want = split_subgroup_advantages(r, torch.arange(len(REWARDS)) // K, cond, valid=v)
    out = Maker("complementary").compute_advantages_and_returns(exps)
    adv, masks = per_sample(out, "advantages"), per_sample(out, "action_mask")
    assert float(adv[1].abs().sum()) == 0.0 and float(adv[0].abs().sum()) == 0.0  # alone in its subgroup now
    assert want[4:].abs().sum() > 0
    for i in range(len(REWARDS)):
        assert torch.allclose(adv[i], want[i] * masks[i].float(), atol=1e-6)


def test_rollout_tensors_restore_the_original_order() -> None:
    exps, r, cond, valid = batch(REWARDS, micro=5, seed=9)
    reward, group, condition, v, order = rollout_tensors(exps, K)
    assert torch.equal(reward, r) and torch.equal(condition, cond) and torch.equal(v, valid)
    assert group.tolist() == [i // K for i in range(len(REWARDS))]
    with pytest.raises(ValueError, match="whole groups"):
        rollout_tensors(exps, 5)


@pytest.mark.parametrize("over, kl, match", [
    ({}, 0.01, "KL penalty in the reward"),
    ({"reward.overlong_buffer_len": 64.0}, 0.0, "overlong_buffer_len"),
    ({"reward.stop_properly_penalty_coef": 0.5}, 0.0, "stop_properly_penalty_coef"),
])
def test_options_that_change_the_reward_first_are_refused(over: dict[str, Any], kl: float, match: str) -> None:
    exps, *_ = batch(REWARDS)
    with pytest.raises(ValueError, match=match):
        Maker("complementary", kl=kl, **over).compute_advantages_and_returns(exps)


def test_kl_as_a_loss_is_allowed() -> None:
    exps, *_ = batch(REWARDS)
    out = Maker("complementary", kl=0.01, **{"algo.kl.use_loss": True}).compute_advantages_and_returns(exps)
    assert all(e.advantages is not None for e in out)
