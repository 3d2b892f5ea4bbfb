"""One actor-side contract, three loops: the same rewards give the same advantages under our runner
(``RolloutRunner`` + the trainer's ``Rollout``), OpenRLHF's experience maker (``ConditionAssigner`` +
the advantage mixin on real ``Experience`` objects) and TRL's trainer (``split_conditions`` +
``trl_advantages``), for ``grpo``, ``complementary`` and ``edge``.

Each env of the runner's pool ends after one action with a preset success (the pool is built in
episode order, copy c of group g is env g·K + c), so the rewards are the test's, not a random actor's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _trainer_fixtures import tiny_policy

pytest.importorskip("openrlhf.trainer.ppo_utils.experience")
pytest.importorskip("trl")

from test_openrlhf_advantages import Maker, sample  # noqa: E402

from crl_gym.wrappers.examples import CorridorEnv  # noqa: E402
from crl_train.algorithms import FREE, GUIDED, sequence_weights, split_subgroup_advantages  # noqa: E402
from crl_train.config import load_config  # noqa: E402
from crl_train.integrations.trl import split_conditions, trl_advantages  # noqa: E402
from crl_train.methods import make_method  # noqa: E402
from crl_train.openrlhf.tasks import ConditionAssigner, TaskLabel  # noqa: E402
from crl_train.rollout.contract import (  # noqa: E402
    Outcomes,
    Rollout,
    condition_ids,
    condition_of,
    trained_advantages,
)
from crl_train.rollout.runner import RolloutRunner  # noqa: E402

K = 4
REWARDS = [1.0, 0.0, 0.0, 0.0,  # group 0: guided 1 0 | free 0 0  (EDGE's gate opens: gain 0.5)
           0.0, 0.0, 1.0, 0.0,  # group 1: guided 0 0 | free 1 0  (closed: gain -0.5)
           1.0, 0.0, 1.0, 0.0]  # group 2: guided 1 0 | free 1 0  (closed: gain 0)
METHODS = ("grpo", "complementary", "edge")


class PresetEnv(CorridorEnv):
    """Any action ends the episode with this env's preset success."""

    def __init__(self, success: bool) -> None:
        super().__init__(length=1, max_turns=1)
        self.success = success

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        return "done", float(self.success), True, False, {**self._info(), "success": self.success}


@pytest.fixture(scope="module")
def policy() -> Any:
    return tiny_policy()


def method_of(name: str) -> Any:
    return make_method(load_config(None, [f"method={name}"]))


def runner_loop(method: Any, policy: Any) -> tuple[torch.Tensor, torch.Tensor]:
    presets = iter(REWARDS)
    runner = RolloutRunner(policy, lambda env_id: PresetEnv(next(presets) > 0.5), group_size=K, max_turns=1,
                           max_new_tokens=2, constrained=True)
    tasks = [("preset", g) for g in range(len(REWARDS) // K)]
    rollout = Rollout.of(runner.collect(tasks, guided=method.guided))
    assert rollout.reward.tolist() == REWARDS
    return trained_advantages(method, rollout), rollout.condition


def openrlhf_loop(name: str, method: Any) -> tuple[torch.Tensor, torch.Tensor]:
    assigner = ConditionAssigner(K, guided=method.guided)
    samples = []
    for i, r in enumerate(REWARDS):
        label = TaskLabel("preset", i // K, i // K).encode()
        guided = assigner.assign(label) == "guided"
        s = sample(r, guided, True, 4, [(4, 7)], 8)
        s.index = [i]
        samples.append(s)
    maker = Maker(name)
    maker.crl_method = method
    out = maker.compute_advantages_and_returns(samples[::-1])  # any order: the mixin reads experience.index
    returns = {i: float(e.info["return"][row]) for e in out for row, i in enumerate(e.index)}
    assert all(torch.equal(e.advantages, e.info["return"][:, None] * e.action_mask) for e in out)
    guided_of = {i: float(e.info["crl_guided"][0]) for e in out for i in e.index}
    cond = torch.tensor([GUIDED if guided_of[i] > 0.5 else FREE for i in range(len(REWARDS))])
    return torch.tensor([returns[i] for i in range(len(REWARDS))]), cond


def trl_loop(method: Any) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(REWARDS)
    conditions = split_conditions(["split"] * n, [i % K for i in range(n)], K, guided=method.guided)
    cond = condition_ids(conditions)
    adv = trl_advantages(torch.tensor(REWARDS), torch.arange(n) // K, cond, valid=torch.ones(n, dtype=torch.bool),
                         method=method)
    return adv, cond


@pytest.mark.parametrize("name", METHODS)
def test_same_rewards_same_advantages_under_every_loop(name: str, policy: Any) -> None:
    method = method_of(name)
    ours, cond = runner_loop(method, policy)
    want_cond = torch.tensor([GUIDED if method.guided and i % K < K // 2 else FREE for i in range(len(REWARDS))])
    assert cond.tolist() == want_cond.tolist()
    assert ours.abs().sum() > 0
    openrlhf_adv, openrlhf_cond = openrlhf_loop(name, method)
    assert openrlhf_cond.tolist() == want_cond.tolist()
    assert torch.allclose(openrlhf_adv, ours, atol=1e-6), (name, openrlhf_adv.tolist(), ours.tolist())
    # TRL's loss is a plain mean over the N sequences: it is handed Â · N · w, with w the Eq. 5 weights
    # our trainer puts in its loss (run/trainer.py: sequence_weights over the trained episodes)
    trl_adv, trl_cond = trl_loop(method)
    assert trl_cond.tolist() == want_cond.tolist()
    n, g = len(REWARDS), torch.arange(len(REWARDS)) // K
    mask = method.train_mask(Outcomes(torch.tensor(REWARDS), g, cond, torch.ones(n, dtype=torch.bool)))
    w = torch.zeros(n)
    w[mask] = sequence_weights(g[mask], cond[mask] if method.guided else None)
    assert torch.allclose(trl_adv, ours * n * w, atol=1e-6), (name, trl_adv.tolist(), ours.tolist())
    if name != "edge":  # every group trains both halves of K/2: N · w = 1, the very same numbers
        assert torch.allclose(trl_adv, ours, atol=1e-6)


def test_the_loops_differ_by_method_as_the_method_says(policy: Any) -> None:
    """The values above by hand: grpo pools each group, complementary splits it, edge also drops the
    guided halves of the groups whose gate stays closed (groups 1 and 2)."""
    r, g = torch.tensor(REWARDS), torch.arange(len(REWARDS)) // K
    split = split_subgroup_advantages(r, g, condition_ids([condition_of(i, K) for i in range(len(REWARDS))]))
    assert torch.allclose(runner_loop(method_of("complementary"), policy)[0], split)
    edge = runner_loop(method_of("edge"), policy)[0]
    assert edge[4:6].tolist() == [0.0, 0.0] and edge[8:10].tolist() == [0.0, 0.0]  # closed gates' guided halves
    grpo = runner_loop(method_of("grpo"), policy)[0]
    # group 0 pooled: mean 1/4, population std √3/4 → (1 − 1/4)/(√3/4) = √3, (0 − 1/4)/(√3/4) = −1/√3
    assert grpo[:4].tolist() == pytest.approx([3 ** 0.5] + [-(3 ** -0.5)] * 3, rel=1e-4)


def test_a_rollout_is_never_half_built() -> None:
    t = torch.zeros(2)
    with pytest.raises(ValueError, match="one episode per row"):
        Rollout(t, t.long(), t.long(), t.bool(), [])
    with pytest.raises(ValueError, match="of one N"):
        Outcomes(t, t.long(), torch.zeros(3).long(), t.bool())
    with pytest.raises(ValueError, match="'guided' or 'free'"):
        condition_ids(["guided", "half"])
