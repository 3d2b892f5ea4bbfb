"""Wrapped envs inside Gymnasium vector envs: SyncVectorEnv with a LocalClient, and
AsyncVectorEnv whose worker processes share one bank through RemoteClient."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv

from crl_gym.clients import LocalClient, RemoteClient
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.server import BackgroundServer
from crl_gym.wrappers import wrap
from crl_gym.wrappers.examples import CorridorEnv

TIP = "Walk east along the corridor; the exit is at its east end."
N = 4


@pytest.fixture()
def manager() -> Any:
    emb = HashingEmbedder(64)
    bank = ExperienceBank(None, dim=64)
    bank.add(TIP, emb.encode([TIP])[0])
    m = ExperienceManager(bank, emb)
    yield m
    m.close()


def factory(client: Any, length: int) -> Callable[[], gym.Env]:
    def make() -> gym.Env:
        return wrap(CorridorEnv(length=length), client)

    return make


def run_until_all_done(vec: Any, actions: list[str]) -> list[Any]:
    """Step every env with its scripted action until each has finished one episode;
    returns the distillation request each one produced (vector envs batch infos)."""
    requests: list[Any] = [None] * vec.num_envs
    for _ in range(20):
        _, _, term, trunc, info = vec.step(actions)
        done = np.logical_or(term, trunc)
        if "distillation_request" in info:
            for i in np.flatnonzero(info["_distillation_request"]):
                requests[i] = requests[i] or info["distillation_request"][i]
        if all(r is not None for r in requests):
            return requests
        assert not done.all() or all(r is not None for r in requests)
    raise AssertionError("episodes did not finish")


def test_sync_vector_env_with_local_client(manager: Any) -> None:
    vec = SyncVectorEnv([factory(LocalClient(manager), length=2) for _ in range(N)])
    try:
        # The trainer's split: half guided, half free, one setting per copy.
        vec.set_attr("default_condition", ["guided", "guided", "free", "free"])
        obs, info = vec.reset(seed=[0, 1, 2, 3])
        assert [o.startswith("Experience from similar tasks") for o in obs] == [True, True, False, False]
        # Gymnasium batches the {id, text, version} dicts key by key, with a mask per key.
        assert list(info["experience"]["_text"]) == [True, True, False, False]
        assert list(info["experience"]["text"][:2]) == [TIP, TIP]
        requests = run_until_all_done(vec, ["east"] * N)
        assert [r.condition for r in requests] == ["guided", "guided", "free", "free"]
        assert all(r.success and r.outcome == 1.0 for r in requests)
        assert manager.pending() == N
    finally:
        vec.close()


def test_async_vector_env_shares_one_bank_through_remote_client(manager: Any) -> None:
    with BackgroundServer(manager) as server:
        client = RemoteClient(server.url, timeout=30)  # pickled into each worker process
        # shared_memory=False: Gymnasium's shared-memory buffers do not carry Text spaces.
        vec = AsyncVectorEnv([factory(client, length=3) for _ in range(N)], shared_memory=False)
        try:
            obs, info = vec.reset(seed=list(range(N)), options={"experience": "guided"})
            assert all(TIP in o for o in obs) and all(info["experience"]["_text"])
            assert list(info["experience"]["text"]) == [TIP] * N
            # One copy asks for help mid-episode; it does not advance that env.
            actions = ["search_and_ask[where is the exit?]", "east", "east", "east"]
            obs, reward, term, trunc, info = vec.step(actions)
            assert "Answer to search_and_ask[where is the exit?]" in obs[0]
            assert list(info["turn"]) == [0, 1, 1, 1]
            requests = run_until_all_done(vec, ["east"] * N)
            assert all(r.success and r.condition == "guided" for r in requests)
            assert [r.trajectory.num_actions for r in requests] == [3] * N
            assert [len(r.trajectory.search_calls) for r in requests] == [1, 0, 0, 0]
            # The workers submitted over HTTP into the one manager of this process (each
            # worker's RemoteClient delivers from a sender thread of its own: wait for all N).
            deadline = time.monotonic() + 30
            while manager.pending() < N and time.monotonic() < deadline:
                time.sleep(0.01)
            got = manager.get_requests(100, timeout=1.0)
            assert sorted(r.request_id for r in got) == sorted(r.request_id for r in requests)
        finally:
            vec.close()
            client.close()
