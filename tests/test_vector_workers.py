"""Wrapped envs in ``AsyncVectorEnv`` workers (fork and spawn) over a real ``crl-experience serve``:
a ``LocalClient`` fails at once naming ``RemoteClient``; with ``RemoteClient`` every episode of a
step reaches the server before the step ends (``crl_gym.wrappers.vector.end_step``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from _servers import free_port, stop_server, wait_healthy
from gymnasium.vector import AsyncVectorEnv

from crl_gym.clients import LocalClient, ProcessBoundaryError, RemoteClient
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.protocol import AddOp
from crl_gym.wrappers import wrap
from crl_gym.wrappers.examples import CorridorEnv
from crl_gym.wrappers.vector import end_step

TIP = "Walk east along the corridor; the exit is at its east end."


def factory(client: Any) -> Callable[[], gym.Env]:
    def make() -> gym.Env:
        return wrap(CorridorEnv(length=2), client)

    return make


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteClient]:
    port = free_port()
    bank = tmp_path_factory.mktemp("served") / "bank"
    cmd = [sys.executable, "-m", "crl_gym.cli", "serve", "--bank", str(bank), "--port", str(port), "--embedder", "hashing:64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    client = RemoteClient(f"http://127.0.0.1:{port}", timeout=30)
    try:
        wait_healthy(client, proc)
        client.apply_ops([AddOp(TIP)])
        yield client
    finally:
        err = stop_server(proc, client)
        assert proc.returncode == 0, err.decode(errors="replace")[-3000:]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_every_episode_of_a_step_reaches_the_server_before_the_step_ends(served: RemoteClient, context: str) -> None:
    n = 4 if context == "fork" else 2  # spawned workers import everything again: keep them few
    step = {"fork": 0, "spawn": 1}[context]
    worker_client = RemoteClient(served.url, timeout=30)  # pickled into (or inherited by) each worker
    vec = AsyncVectorEnv([factory(worker_client) for _ in range(n)], shared_memory=False, context=context)
    try:
        obs, info = vec.reset(seed=list(range(n)), options={"experience": "guided", "rollout_step": step})
        assert all(TIP in o for o in obs)
        for _ in range(10):
            _, _, term, trunc, info = vec.step(["east"] * n)
            if np.logical_or(term, trunc).all():
                break
        assert all(info["_distillation_request"])
        ended = end_step(vec, served, step)  # each worker's sender is flushed first
        assert ended.requests == n, ended
        assert [w["undelivered"] for w in ended.workers or []] == [None] * n
        assert served.stats().late_requests == 0
    finally:
        vec.close()
        worker_client.close()


@pytest.fixture()
def manager() -> Iterator[ExperienceManager]:
    emb = HashingEmbedder(64)
    m = ExperienceManager(ExperienceBank(None, dim=64), emb)
    m.apply_ops([AddOp(TIP)])
    yield m
    m.close()


@pytest.mark.filterwarnings("ignore::UserWarning")  # Gymnasium reports the workers' error as warnings too
def test_a_local_client_in_a_forked_worker_fails_at_once_naming_remote_client(manager: ExperienceManager) -> None:
    vec = AsyncVectorEnv([factory(LocalClient(manager)) for _ in range(2)], shared_memory=False, context="fork")
    started = time.monotonic()
    try:
        with pytest.raises(ProcessBoundaryError, match="RemoteClient"):
            vec.reset(seed=0, options={"experience": "guided"})
        assert time.monotonic() - started < 60  # not a search's 120 s timeout
    finally:
        vec.close(terminate=True)


def test_a_local_client_cannot_be_sent_to_a_spawned_worker(manager: ExperienceManager) -> None:
    with pytest.raises(ProcessBoundaryError, match="RemoteClient"):
        AsyncVectorEnv([factory(LocalClient(manager)) for _ in range(2)], shared_memory=False, context="spawn")


def test_a_sync_vector_env_with_a_local_client_still_works(manager: ExperienceManager, tmp_path: Path) -> None:
    client = LocalClient(manager)
    vec = gym.vector.SyncVectorEnv([factory(client) for _ in range(2)])
    vec.reset(seed=0, options={"rollout_step": 0})
    vec.step(["east", "east"])
    vec.step(["east", "east"])
    assert end_step(vec, client, 0).requests == 2
    vec.close()
