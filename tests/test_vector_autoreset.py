"""Vector envs keep each copy's condition, rollout step and seeds across Gymnasium's autoreset
(sync and async, NEXT_STEP and SAME_STEP): several episodes per copy, checked against what the
inner env received and what the service got."""

from __future__ import annotations

import time
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

from crl_gym.clients import LocalClient, RemoteClient
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.protocol import DistillationRequest
from crl_gym.server import BackgroundServer
from crl_gym.wrappers import ExperienceWrapper
from crl_gym.wrappers.autoreset import episode_seed
from crl_gym.wrappers.examples import CorridorEnv
from crl_gym.wrappers.vector import end_step

TIP = "Walk east along the corridor; the exit is at its east end."
COPIES = 2
EPISODES = 3


class LoggedCorridor(CorridorEnv):
    """A one-turn corridor that logs the seeds and options of its resets and the actions it got."""

    def __init__(self) -> None:
        super().__init__(length=1)
        self.received: list[tuple[str, Any]] = []

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        self.received.append(("reset", (seed, options)))
        return super().reset(seed=seed, options=options)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.received.append(("step", action))
        return super().step(action)

    def log(self) -> list[tuple[str, Any]]:
        return list(self.received)


def make_copy(client: Any) -> Any:
    def make() -> gym.Env:
        return ExperienceWrapper(LoggedCorridor(), client)
    return make


@pytest.fixture()
def manager() -> Any:
    emb = HashingEmbedder(64)
    bank = ExperienceBank(None, dim=64)
    bank.add(TIP, emb.encode([TIP])[0])
    m = ExperienceManager(bank, emb)
    yield m
    m.close()


def play(vec: Any, steps: int) -> None:
    vec.reset(seed=[10, 20], options={"experience": "guided", "rollout_step": 0})
    for _ in range(steps):
        vec.step(["east"] * COPIES)


def check(vec: Any, requests: list[DistillationRequest], mode: AutoresetMode) -> list[list[int | None]]:
    """Every episode of each copy guided, of step 0, with the entry, seeded, one ``east``; the seeds
    the inner env got (per copy) returned."""
    logs = vec.call("log")
    seeds: list[list[int | None]] = []
    for copy, log in enumerate(logs):
        resets = [arg for kind, arg in log if kind == "reset"]
        assert all(options is None for _, options in resets)  # the wrapper's own options never reach the env
        got = [s for s, _ in resets]
        base = [10, 20][copy]
        assert got[0] == base and got[1:] == [episode_seed(base, k) for k in range(1, len(got))]
        assert len(set(got)) == len(got) >= EPISODES
        assert [arg for kind, arg in log if kind == "step"] == ["east"] * EPISODES
        seeds.append(got)
    assert len(requests) == COPIES * EPISODES
    for r in requests:
        assert r.condition == "guided" and r.experience is not None and r.experience.text == TIP
        assert r.rollout_step == 0 and [s.action for s in r.trajectory.steps] == ["east"] and r.success
    by_seed = sorted(r.seed for r in requests)
    assert by_seed == sorted(s for got in seeds for s in got[:EPISODES])
    return seeds


STEPS = {AutoresetMode.NEXT_STEP: 2 * EPISODES - 1, AutoresetMode.SAME_STEP: EPISODES}
"""Steps that end three one-turn episodes per copy (NEXT_STEP spends a step on each reset)."""


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
def test_sync_copies_keep_their_condition_step_and_seeds(manager: Any, mode: AutoresetMode) -> None:
    client = LocalClient(manager)
    runs = []
    for _ in range(2):  # the same seeds on a second run: reproducible
        vec = SyncVectorEnv([make_copy(client)] * COPIES, autoreset_mode=mode)
        try:
            play(vec, STEPS[mode])
            requests = manager.get_requests(100)
            runs.append(check(vec, requests, mode))
        finally:
            vec.close()
    assert runs[0] == runs[1]


def test_an_episode_past_its_closed_step_is_never_credited(manager: Any) -> None:
    client = LocalClient(manager)
    vec = SyncVectorEnv([make_copy(client)] * COPIES, autoreset_mode=AutoresetMode.SAME_STEP)
    try:
        play(vec, 1)
        assert end_step(vec, client, 0).requests == COPIES
        vec.step(["east"] * COPIES)  # autoreset episodes of step 0, which has ended
        assert client.stats().late_requests == COPIES
        vec.reset(seed=[1, 2], options={"experience": "free", "rollout_step": 1})
        vec.step(["east"] * COPIES)
        vec.step(["east"] * COPIES)
        assert end_step(vec, client, 1).requests == 2 * COPIES and client.stats().late_requests == COPIES
    finally:
        vec.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
def test_async_copies_keep_their_condition_step_and_seeds(manager: Any, mode: AutoresetMode) -> None:
    with BackgroundServer(manager) as server:
        client = RemoteClient(server.url, timeout=30)
        vec = AsyncVectorEnv([make_copy(client)] * COPIES, shared_memory=False, autoreset_mode=mode)
        try:
            play(vec, STEPS[mode])
            end = end_step(vec, client, 0)  # every worker's sender flushed first
            assert end.requests == COPIES * EPISODES
            deadline = time.monotonic() + 30
            while manager.pending() < COPIES * EPISODES and time.monotonic() < deadline:
                time.sleep(0.01)
            check(vec, manager.get_requests(100), mode)
        finally:
            vec.close()
            client.close()


def test_an_explicit_reset_without_options_runs_the_default_condition(manager: Any) -> None:
    env = ExperienceWrapper(LoggedCorridor(), LocalClient(manager), default_condition="free")
    env.reset(seed=3, options={"experience": "guided"})
    assert env.step("east")[4]["distillation_request"].condition == "guided"
    assert env.reset()[1]["experience"] is not None  # bare: the guided episode's next one
    env.step("east")
    assert env.reset(seed=4)[1]["experience"] is None  # explicit: the default again
    assert np.all([s is not None for kind, (s, _) in
                   [x for x in env.unwrapped.received if x[0] == "reset"]])  # type: ignore[attr-defined]
