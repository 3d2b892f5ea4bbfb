"""The TRL adapter's parts, without a training run: the env contract TRL reads, the end-step
callback, the guided/free split of a row's generations and the advantages handed to TRL."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from transformers import TrainerControl, TrainerState, TrainingArguments

from crl_gym.clients import LocalClient
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.service import RetrievalService
from crl_gym.integrations.trl import (
    ExperienceEnv,
    SearchAndAskEnv,
    TRLExperience,
    dataset_rows,
)
from crl_gym.protocol import AddOp
from crl_gym.wrappers.examples import CorridorEnv
from crl_gym.wrappers.experience import ExperienceWrapper
from crl_train.algorithms import split_subgroup_advantages
from crl_train.integrations.trl import split_conditions, trl_advantages


@pytest.fixture
def service() -> RetrievalService:
    svc = RetrievalService(ExperienceManager(ExperienceBank(None, dim=64), HashingEmbedder(64)))
    yield svc
    svc.close()


def _tools(cls: type) -> list[str]:
    """What TRL 1.16 exposes as tools: the class's public functions but reset / get_reward
    (GRPOTrainer.__init__ lists ``inspect.getmembers(type(instance), inspect.isfunction)``)."""
    return [n for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if n not in ("reset", "get_reward") and not n.startswith("_")]


def test_tools_are_the_action_and_search_and_ask_only() -> None:
    assert _tools(ExperienceEnv) == ["take_action"]
    assert _tools(SearchAndAskEnv) == ["search_and_ask", "take_action"]
    # TRL renders each tool from its docstring: the argument must be described
    from transformers.utils import get_json_schema
    schema = get_json_schema(ExperienceEnv.take_action)
    assert schema["function"]["parameters"]["properties"]["action"]["description"]


def test_reset_refuses_a_split_row_and_an_unknown_value(service: RetrievalService) -> None:
    env = TRLExperience(LocalClient(service), lambda: CorridorEnv(length=1)).environment_factory()
    with pytest.raises(ValueError, match="ComplementaryGRPOTrainer"):
        env.reset(**dataset_rows([0])[0])
    with pytest.raises(ValueError, match="must be one of"):
        env.reset(prompt=[], seed=0, experience="half")
    with pytest.raises(ValueError, match="must be one of"):
        dataset_rows([0], experience="both")


def test_get_reward_ends_an_open_episode_and_submits_it(service: RetrievalService) -> None:
    client = LocalClient(service)
    session = TRLExperience(client, lambda: CorridorEnv(length=3))
    session.step = 5
    env = session.environment_factory()
    env.reset(prompt=[], seed=1, experience="free")
    env.take_action("east")  # one of three: the model then stopped calling the tool
    assert env.request is None
    assert env.get_reward() == 0.0
    request = env.request
    assert request is not None and request.success is False and request.rollout_step == 5
    assert request.condition == "free" and len(request.trajectory.steps) == 1
    assert env.get_reward() == 0.0 and env.request is request  # idempotent: one request per episode
    assert "over" in env.take_action("east")  # a call after the end steps nothing
    assert service.stats().open_requests == 1


def test_success_and_return_rewards(service: RetrievalService) -> None:
    client = LocalClient(service)
    for reward, expected in (("success", 1.0), ("return", 1.0)):
        env = TRLExperience(client, lambda: CorridorEnv(length=1), reward=reward).environment_factory()
        env.reset(prompt=[], seed=0, experience="free")
        assert env.take_action("east").endswith("The episode is over: success.")
        assert env.get_reward() == expected
    with pytest.raises(ValueError, match="reward"):
        TRLExperience(client, lambda: CorridorEnv(), reward="shaped")


def test_reset_of_an_open_episode_submits_it_first(service: RetrievalService) -> None:
    env = TRLExperience(LocalClient(service), lambda: CorridorEnv(length=2)).environment_factory()
    env.reset(prompt=[], seed=0, experience="free")
    env.reset(prompt=[], seed=1, experience="free")  # TRL reuses pooled instances
    assert service.stats().open_requests == 1


def test_guided_episode_shows_the_entry_and_search_and_ask_answers(service: RetrievalService) -> None:
    client = LocalClient(service)
    client.apply_ops([AddOp("In a corridor, keep walking east.")])
    env = TRLExperience(client, lambda: CorridorEnv(length=2), search_and_ask=True).environment_factory()
    assert isinstance(env, SearchAndAskEnv)
    first = env.reset(prompt=[], seed=0, experience="guided")
    assert "keep walking east" in first and first.endswith("Valid actions: east, west")
    answer = env.search_and_ask("which way?")
    assert answer.startswith("Answer to search_and_ask[which way?]") and env.turns == 1
    env.take_action("east")
    env.take_action("east")
    assert env.get_reward() == 1.0 and env.condition == "guided"
    kinds = [s.kind for s in env.request.trajectory.steps]
    assert kinds.count("search_and_ask") == 1


def test_callback_sets_the_open_step_and_ends_each_optimizer_step(service: RetrievalService,
                                                                  tmp_path: object) -> None:
    session = TRLExperience(LocalClient(service), lambda: CorridorEnv(length=1))
    callback = session.callback()
    args, control = TrainingArguments(output_dir=str(tmp_path), report_to="none"), TrainerControl()
    state = TrainerState()
    for step in range(3):
        state.global_step = step
        callback.on_step_begin(args, state, control)
        assert session.step == step
        env = session.environment_factory()
        env.reset(prompt=[], seed=step, experience="free")
        env.take_action("east")
        state.global_step = step + 1  # the Trainer counts the step before on_step_end
        callback.on_step_end(args, state, control)
    assert [r.step for r in session.ended] == [0, 1, 2]
    assert [r.requests for r in session.ended] == [1, 1, 1]


def test_end_episode_of_the_wrapper(service: RetrievalService) -> None:
    env = ExperienceWrapper(CorridorEnv(length=3), LocalClient(service))
    assert env.end_episode() is None  # nothing open
    env.reset(seed=0, options={"experience": "free", "rollout_step": 2})
    env.step("east")
    request = env.end_episode()
    assert request is not None and request.success is False and request.rollout_step == 2
    assert env.end_episode() is None  # ended once


def test_split_conditions_by_hand() -> None:
    # G = 4: positions 0, 1 guided, 2, 3 free; an odd G = 3 gives 1 guided, 2 free
    assert split_conditions(["split"] * 4, [0, 1, 2, 3], 4) == ["guided", "guided", "free", "free"]
    assert split_conditions([None] * 3, [0, 1, 2], 3) == ["guided", "free", "free"]
    assert split_conditions(["guided", "free"], [3, 0], 4) == ["guided", "free"]
    with pytest.raises(ValueError, match="experience"):
        split_conditions(["sometimes"], [0], 2)


def test_trl_advantages_equal_split_subgroup_for_even_halves() -> None:
    # two groups of 4 (2 guided, 2 free): guided [1, 0] -> ±1, free [0, 0] -> 0; group 1: guided
    # [1, 1] -> 0, free [1, 0] -> ±1. Weights 1/(2 groups * 2 conditions * 2) = 1/8, N = 8: scale 1.
    r = torch.tensor([1., 0., 0., 0., 1., 1., 1., 0.])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    c = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1])
    a = trl_advantages(r, g, c)
    assert torch.allclose(a, split_subgroup_advantages(r, g, c))
    assert [round(x, 4) for x in a.tolist()] == [1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 1.0, -1.0]


def test_trl_advantages_weight_uneven_halves_by_hand() -> None:
    # one group, 1 guided + 3 free: free r = [1, 0, 0]: mean 1/3, population std √2/3 ->
    # Â = [√2, -1/√2, -1/√2]; guided singleton -> 0. Weights: free 1/(2·3) = 1/6, N = 4 -> ×2/3.
    r = torch.tensor([1., 1., 0., 0.])
    a = trl_advantages(r, torch.zeros(4, dtype=torch.long), torch.tensor([0, 1, 1, 1]))
    expected = [0.0, math.sqrt(2) * 2 / 3, -2 / 3 / math.sqrt(2), -2 / 3 / math.sqrt(2)]
    assert a.tolist() == pytest.approx(expected, abs=1e-5)


def test_trl_advantages_leave_an_unscorable_episode_out() -> None:
    # G = 4, guided [1, nan (no reward)], free [1, 0]: the invalid one gets 0 and is left out of the
    # weights: guided 1 valid (a singleton: Â 0, weight 1/2), free ±1 with weight 1/4, N = 4 -> ×1.
    r = torch.tensor([1., float("nan"), 1., 0.])
    valid = torch.tensor([True, False, True, True])
    a = trl_advantages(r, torch.zeros(4, dtype=torch.long), torch.tensor([0, 0, 1, 1]), valid=valid)
    assert a.tolist() == pytest.approx([0.0, 0.0, 1.0, -1.0], abs=1e-5)


@pytest.mark.slow
def test_the_library_imports_without_trl() -> None:
    # TRL (and transformers' Trainer) load only with the integration modules themselves
    import subprocess
    import sys
    code = ("import sys, crl_gym, crl_train, crl_gym.integrations, crl_train.integrations, crl_gym.wrappers; "
            "loaded = sorted(m for m in sys.modules if m == 'trl' or m.startswith('trl.')); "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True)
