"""RolloutRunner: grouping, one batched generation per turn, prefetch, masks, errors, context cut."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _trainer_fixtures import LocalClient, corridor_factory, manager, tiny_policy

from crl_gym.wrappers.examples import CorridorEnv
from crl_train.policy.base import Generation, TrainBatch
from crl_train.rollout.runner import Episode, RolloutRunner, Turn, swap_prompt


@pytest.fixture(scope="module")
def policy() -> Any:
    return tiny_policy()


class CountingPolicy:
    """Delegates to the tiny policy and counts generate calls."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def generate(self, *a: Any, **k: Any) -> Any:
        self.calls += 1
        return self.inner.generate(*a, **k)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_free_rollout_groups_masks_and_one_generation_per_turn(policy: Any) -> None:
    counting = CountingPolicy(policy)
    runner = RolloutRunner(counting, corridor_factory(None, max_turns=3), group_size=4, max_turns=3,
                           max_new_tokens=4, constrained=True)
    eps = runner.collect([("corridor", 1), ("corridor", 2)], guided=False)
    assert [(e.group, e.condition, e.seed) for e in eps] == [(g, "free", s) for g, s in ((0, 1), (1, 2)) for _ in range(4)]
    # all 8 episodes advance together: one generate call per turn, not per episode
    assert counting.calls == max(e.turns for e in eps) <= 3
    for e in eps:
        seq = e.sequence
        assert len(seq.input_ids) == len(seq.loss_mask) == len(seq.old_logprobs)
        assert seq.loss_mask[: len(e.prompt_ids)] == [0] * len(e.prompt_ids)  # prompt never trained
        trained = [lp for lp, m in zip(seq.old_logprobs, seq.loss_mask, strict=True) if m]
        assert len(trained) == sum(len(t.generation.token_ids) for t in e.history) and all(lp <= 0 for lp in trained)
        assert e.turns == len(e.history) and e.success == (e.reward > 0)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_old_logprobs_match_recomputed(policy: Any, prefix_cache: bool) -> None:
    policy.prefix_cache = prefix_cache
    try:
        runner = RolloutRunner(policy, corridor_factory(None, max_turns=3), group_size=4, max_turns=3, max_new_tokens=4,
                               constrained=True)
        eps = runner.collect([("corridor", 0), ("corridor", 1)], guided=False)
        assert policy._kv == {}  # every episode's kept keys/values are released when collect ends
    finally:
        policy.prefix_cache = False
    assert max(e.turns for e in eps) > 1  # later turns started from the kept keys/values
    batch = TrainBatch.from_sequences([e.sequence for e in eps], [0.0] * len(eps), policy.pad_token_id)
    lp = policy.logprobs(batch)
    m = batch.loss_mask.bool()
    assert torch.allclose(lp[m], batch.old_logprobs[m], atol=1e-4)


def test_guided_half_prefetched_with_one_search_many(policy: Any) -> None:
    mgr = manager(("Walk east until the exit.",))
    client = LocalClient(mgr)
    calls: list[list[str]] = []
    orig = client.search_many

    def spy(queries: list[str]) -> Any:
        calls.append(list(queries))
        return orig(queries)

    client.search_many = spy  # type: ignore[method-assign]
    client.search = lambda q: pytest.fail("guided resets must use the prefetched entry")  # type: ignore[method-assign]
    runner = RolloutRunner(policy, corridor_factory(client), client=client, group_size=4, max_turns=3, max_new_tokens=4, constrained=True)
    eps = runner.collect([("corridor", 5), ("corridor", 6)], guided=True)
    assert len(calls) == 1 and len(calls[0]) == 2  # one batch, one query per group
    for e in eps:
        if e.condition == "guided":
            assert e.experience is not None and e.experience.text == "Walk east until the exit."
        else:
            assert e.experience is None
    finished = [e for e in eps if e.request is not None]
    assert finished and all(e.request.condition == e.condition for e in finished)  # type: ignore[union-attr]
    mgr.close()


class ExplodingCorridor(CorridorEnv):
    def step(self, action: str) -> Any:
        if self.turn >= 1:
            raise RuntimeError("simulator crashed")
        return super().step(action)


def test_env_error_ends_only_that_episode(policy: Any, caplog: pytest.LogCaptureFixture) -> None:
    made = []

    def make(env_id: str) -> Any:
        env = ExplodingCorridor(length=5, max_turns=4) if not made else CorridorEnv(length=5, max_turns=4)
        made.append(env)
        return env

    runner = RolloutRunner(policy, make, group_size=2, max_turns=4, max_new_tokens=4, constrained=True)
    eps = runner.collect([("c", 0)], guided=False)
    assert "simulator crashed" in eps[0].info["error"] and eps[0].success is False and eps[0].done
    assert "error" not in eps[1].info and eps[1].turns == 4
    assert runner.errors == 1 and "simulator crashed" in caplog.text


def test_context_policy_ends_episode_before_overflow(policy: Any) -> None:
    runner = RolloutRunner(policy, corridor_factory(None, length=9, max_turns=20), group_size=2, max_turns=20,
                           max_new_tokens=4, max_context_tokens=120, constrained=True)
    eps = runner.collect([("c", 0)], guided=False)
    for e in eps:
        assert len(e.sequence) + 4 <= 120
        assert e.info.get("context_truncated") and not e.success
    assert runner.context_truncations == 2


def test_swap_prompt_drops_search_turns() -> None:
    g1 = Generation(prompt_ids=[1], token_ids=[10, 11], logprobs=[-0.1, -0.2], text="east")
    g2 = Generation(prompt_ids=[1], token_ids=[12], logprobs=[-0.3], text="search")
    g3 = Generation(prompt_ids=[1], token_ids=[13], logprobs=[-0.4], text="east")
    ep = Episode(group=0, condition="guided", env_id="c", seed=0, prompt_ids=[1, 2, 3, 4])
    ep.history = [Turn(g1, [20]), Turn(g2, [21, 22], "search_and_ask"), Turn(g3, [])]
    seq = swap_prompt(ep, [1, 2], drop_search_turns=True)
    assert seq.input_ids == [1, 2, 10, 11, 20, 13]
    assert seq.loss_mask == [0, 0, 1, 1, 0, 1]
    kept = swap_prompt(ep, [7])
    assert kept.input_ids == [7, 10, 11, 20, 12, 21, 22, 13] and kept.old_logprobs[1:3] == [-0.1, -0.2]


def test_group_size_must_be_even(policy: Any) -> None:
    with pytest.raises(ValueError, match="even"):
        RolloutRunner(policy, corridor_factory(None), group_size=3)
