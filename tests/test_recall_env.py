"""Recall text env: rules, noise, seeding (the secret belongs to the task), task names, registry, check_env."""

from __future__ import annotations

import math
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import crl_gym  # noqa: F401  (registers crl/ ids)
from crl_gym.envs import make
from crl_gym.envs.recall import (
    ACTION_WORDS,
    FIRST_WORDS,
    HIDDEN,
    MAX_TASKS,
    SECOND_WORDS,
    RecallEnv,
    task_name,
    task_secret,
)


def binomial_bounds(n: int, p: float, z: float = 4.0) -> tuple[float, float]:
    """A share of n Bernoulli(p) draws lies in p ± z·sqrt(p(1-p)/n) (z = 4: a false alarm ~ 1 in 16 000)."""
    half = z * math.sqrt(p * (1 - p) / n)
    return p - half, p + half


def wrong(env: RecallEnv, k: int) -> str:
    """An admissible action that is not the k-th of the secret."""
    return next(a for a in env._admissible if a != env.secret[k])


def test_check_env_passes_without_warnings() -> None:
    env = gym.make("crl/Recall-v0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped)
    assert [str(w.message) for w in caught] == []
    env.close()


def test_registry_make_passes_the_options() -> None:
    env = make("crl/Recall-v0", num_tasks=4, length=2, num_actions=3, noise=0.5)
    assert env.spec is not None and env.spec.id == "crl/Recall-v0"
    inner = env.unwrapped
    assert isinstance(inner, RecallEnv)
    assert (inner.num_tasks, inner.length, inner.num_actions, inner.noise) == (4, 2, 3, 0.5)
    _, info = env.reset(seed=0)
    assert info["admissible_actions"] == ("north", "east", "south")
    env.close()


@pytest.mark.parametrize("length,num_actions", [(1, 2), (3, 4), (5, 8)])
def test_the_secret_sequence_succeeds_on_its_last_action(length: int, num_actions: int) -> None:
    env = RecallEnv(num_tasks=8, length=length, num_actions=num_actions)
    obs, info = env.reset(seed=3)
    assert info["success"] is False and info["progress"] == 0
    for k, action in enumerate(env.secret):
        obs, reward, terminated, truncated, info = env.step(action)
        last = k == length - 1
        assert (reward, terminated, truncated, info["success"]) == ((1.0, True, False, True) if last else (0.0, False, False, False))
        assert info["progress"] == k + 1 and info["invalid_action"] is False
    assert "Task complete!" in obs
    # a finished episode repeats its result and pays nothing more
    assert env.step(env.secret[0])[1:4] == (0.0, True, False)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_the_first_wrong_action_ends_the_episode_with_zero(k: int) -> None:
    env = RecallEnv(num_tasks=8, length=3, num_actions=4)
    env.reset(seed=5)
    for action in env.secret[:k]:
        assert env.step(action)[2] is False
    obs, reward, terminated, truncated, info = env.step(wrong(env, k))
    assert (reward, terminated, truncated, info["success"], info["progress"]) == (0.0, True, False, False, k)
    assert f"not action {k + 1} of the secret sequence" in obs
    assert env.step(env.secret[k])[1:4] == (0.0, True, False)  # over: the right action comes too late


def test_the_observation_shows_task_turn_and_history() -> None:
    env = RecallEnv(num_tasks=8, length=3, num_actions=4)
    obs, info = env.reset(seed=2)
    assert f"Task: {env.name}." in obs and "Actions so far: (none)" in obs and "Turn 1: action 1 of 3?" in obs
    obs, *_ = env.step(env.secret[0])
    obs, *_ = env.step(env.secret[1])
    assert f"Actions so far: {env.secret[0]}, {env.secret[1]}\n" in obs and "Turn 3: action 3 of 3?" in obs
    # the action words are not listed (info carries them), so a guided prompt's entry is where they appear
    assert info["admissible_actions"] == ACTION_WORDS[:4]
    assert info["task"] == f"Task {env.name}: repeat the 3 secret actions of {env.name}."
    assert info["task_category"] == env.name and info["task_index"] == 2


def test_an_invalid_action_is_a_turn_that_changes_nothing() -> None:
    env = RecallEnv(num_tasks=4, length=2, num_actions=2, max_turns=3)
    env.reset(seed=1)
    obs, reward, terminated, truncated, info = env.step("jump")
    assert obs.startswith("Invalid action: 'jump'. Valid actions: north, east.")
    assert (reward, terminated, truncated, info["invalid_action"], info["turn"], info["progress"]) == (0.0, False, False, True, 1, 0)
    obs, *_, info = env.step(f"  {env.secret[0].upper()} ")  # case and spaces are ignored
    assert info["progress"] == 1 and info["invalid_action"] is False
    obs, reward, terminated, truncated, info = env.step(12)  # type: ignore[arg-type]
    assert (terminated, truncated, info["invalid_action"]) == (False, True, True)  # max_turns reached
    assert RecallEnv(length=3).max_turns == 6  # default: 2 × length


def test_noise_hides_the_history_on_the_expected_share_of_observations() -> None:
    noise, episodes = 0.3, 400
    env = RecallEnv(num_tasks=8, length=3, num_actions=2, noise=noise)
    hidden = shown = 0
    for seed in range(episodes):
        obs, info = env.reset(seed=seed)
        observations = [(obs, info)]
        for action in env.secret:
            obs, _, terminated, _, info = env.step(action)
            observations.append((obs, info))
        for obs, info in observations:
            assert (HIDDEN in obs) == info["history_hidden"]
            hidden += info["history_hidden"]
            shown += not info["history_hidden"]
    n = hidden + shown
    low, high = binomial_bounds(n, noise)
    assert low <= hidden / n <= high, (hidden, n)
    # drawn from the episode's RNG: the same seed hides the same turns
    a, b = RecallEnv(noise=noise, length=6), RecallEnv(noise=noise, length=6)
    for env_ in (a, b):
        env_.reset(seed=11)
    pattern = [[env_.step(s)[4]["history_hidden"] for s in env_.secret] for env_ in (a, b)]
    assert pattern[0] == pattern[1]


@pytest.mark.parametrize("noise,expected", [(0.0, False), (1.0, True)])
def test_noise_extremes(noise: float, expected: bool) -> None:
    env = RecallEnv(length=3, noise=noise)
    _, info = env.reset(seed=0)
    flags = [info["history_hidden"]] + [env.step(a)[4]["history_hidden"] for a in env.secret]
    assert flags == [expected] * 4


def test_same_seed_same_task_and_secret() -> None:
    a, b = RecallEnv(num_tasks=16, length=4), RecallEnv(num_tasks=16, length=4)
    for seed in (0, 7, 123):
        oa, ia = a.reset(seed=seed)
        ob, ib = b.reset(seed=seed)
        assert (oa, ia, a.secret) == (ob, ib, b.secret)


def test_a_tasks_secret_is_identical_across_seeds() -> None:
    env = RecallEnv(num_tasks=16, length=5, num_actions=4)
    for task in range(16):
        seen = set()
        for seed in (task, task + 16, task + 16 * 1000, task + 16 * 62_500):  # the last one: an eval seed
            _, info = env.reset(seed=seed)
            assert info["task_index"] == task and env.name == task_name(task)
            seen.add(env.secret)
        assert seen == {task_secret(task, 5, 4)}


def test_secrets_depend_on_the_task_and_the_secret_seed() -> None:
    secrets = [task_secret(i, 6, 4) for i in range(16)]
    assert len(set(secrets)) == 16  # 4^6 sequences: these 16 are distinct
    assert [task_secret(i, 6, 4, secret_seed=1) for i in range(16)] != secrets
    env = RecallEnv(num_tasks=16, length=6, secret_seed=1)
    env.reset(seed=3)
    assert env.secret == task_secret(3, 6, 4, secret_seed=1)


def test_reset_without_seed_draws_a_task() -> None:
    env = RecallEnv(num_tasks=5)
    env.reset(seed=0)
    drawn = set()
    for _ in range(60):
        _, info = env.reset()
        drawn.add(info["task_index"])
    assert drawn <= set(range(5)) and len(drawn) > 1


def test_task_names_are_distinct_and_the_first_sixteen_share_no_word() -> None:
    names = [task_name(i) for i in range(MAX_TASKS)]
    assert len(set(names)) == MAX_TASKS
    words = [w for n in names[:16] for w in n.split()]
    assert len(set(words)) == 32
    assert all(n.split()[0] in FIRST_WORDS and n.split()[1] in SECOND_WORDS for n in names)
    with pytest.raises(ValueError, match="task index"):
        task_name(MAX_TASKS)


def test_a_random_agent_succeeds_with_probability_one_over_a_to_the_l() -> None:
    length, num_actions, episodes = 2, 3, 3000
    env = RecallEnv(num_tasks=32, length=length, num_actions=num_actions)
    rng = np.random.default_rng(0)
    wins = 0
    for seed in range(episodes):
        env.reset(seed=seed)
        terminated = False
        while not terminated:
            _, reward, terminated, truncated, _ = env.step(str(rng.choice(env._admissible)))
            assert not truncated
        wins += reward == 1.0
    p = (1 / num_actions) ** length
    low, high = binomial_bounds(episodes, p)
    assert low <= wins / episodes <= high, wins


@pytest.mark.parametrize("kwargs,match", [
    ({"num_tasks": 0}, "num_tasks"), ({"num_tasks": MAX_TASKS + 1}, "num_tasks"), ({"length": 0}, "length"),
    ({"num_actions": 1}, "num_actions"), ({"num_actions": 9}, "num_actions"), ({"noise": 1.5}, "noise"),
])
def test_bad_options_are_refused(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RecallEnv(**kwargs)  # type: ignore[arg-type]


def test_step_before_reset_raises() -> None:
    with pytest.raises(RuntimeError, match="reset"):
        RecallEnv().step("north")
