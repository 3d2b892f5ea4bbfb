"""Nothing misread silently: a cut-off tool call is a tool error (never an env action), success
comes from the env or a declared rule (else one warning saying what is counted), both clients'
``stats()`` give the same fields, and code written against earlier releases keeps working."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import gymnasium as gym
import pytest

from crl_gym.clients import LocalClient, RemoteClient
from crl_gym.envs.base import text_space
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.results import Health, OpsApplied, ServiceStats, StepEnded
from crl_gym.experience.service import RetrievalService
from crl_gym.protocol import AddOp
from crl_gym.server import BackgroundServer
from crl_gym.wrappers import ExperienceWrapper, SearchAndAskWrapper, wrap
from crl_gym.wrappers.examples import CorridorEnv

EMB = HashingEmbedder(64)


@pytest.fixture()
def manager() -> Any:
    m = ExperienceManager(ExperienceBank(None, dim=64), EMB)
    m.apply_ops([AddOp("Walk east to the exit.")])
    yield m
    m.close()


class Moves(gym.Env[str, str]):
    """+1 for each legal move (``step``), no ``info["success"]``; the episode ends after ``moves`` turns."""

    def __init__(self, moves: int = 3) -> None:
        self.observation_space, self.action_space = text_space(), text_space(max_length=64)
        self.moves, self.turn, self.actions = moves, 0, []

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self.turn = 0
        return "Move the pieces.", {"task": "Move the pieces."}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.actions.append(action)
        self.turn += 1
        return "moved", float(action == "step"), self.turn >= self.moves, False, {}


@pytest.mark.parametrize("cut", ["search_and", "search_and_ask", "search_and_ask[where is the ex",
                                 "  search_and_ask[  "])
def test_a_cut_off_tool_call_is_a_tool_error_not_an_env_action(manager: Any, cut: str, caplog: Any) -> None:
    inner = Moves()
    env = ExperienceWrapper(SearchAndAskWrapper(inner, LocalClient(manager)), LocalClient(manager))
    env.reset(seed=0)
    with caplog.at_level(logging.WARNING, logger="crl_gym.wrappers.search_and_ask"):
        obs, reward, terminated, truncated, info = env.step(cut)
        env.step(cut)
    assert inner.actions == [] and reward == 0.0 and not (terminated or truncated)
    assert info["search_and_ask"]["status"] == "malformed" and "cut off or malformed" in obs
    assert obs.endswith("Move the pieces.")  # the current observation, unchanged
    tool = env.get_wrapper_attr("malformed_count")
    assert tool == 2 and info["search_and_ask"]["calls_left"] == 2  # no call used
    assert len([r for r in caplog.records if "cut-off or malformed" in r.getMessage()]) == 1  # logged once
    for action in ("step", "search", "step"):  # ordinary actions (a short prefix too) reach the env
        *_, info = env.step(action)
    assert inner.actions == ["step", "search", "step"]
    request = info["distillation_request"]
    assert [s.kind for s in request.trajectory.steps] == ["search_and_ask"] * 2 + ["env"] * 3


def test_an_undeclared_success_rule_warns_once_saying_what_is_counted(manager: Any, caplog: Any) -> None:
    env = ExperienceWrapper(Moves(), LocalClient(manager), env_id="user/Moves-v0")
    with caplog.at_level(logging.WARNING, logger="crl_gym.wrappers.success"):
        for _ in range(3):
            env.reset(seed=0)
            for _ in range(3):
                *_, info = env.step("step")
    warned = [r.getMessage() for r in caplog.records if "user/Moves-v0" in r.getMessage()]
    assert len(warned) == 1 and "return >= 1.0" in warned[0] and "success_rule=" in warned[0]
    assert info["distillation_request"].success  # what the warning said: 3 >= 1


@pytest.mark.parametrize("kwargs, success", [({"success_reward": 3.5}, False), ({"success_reward": 3.0}, True),
                                             ({"success_rule": lambda rewards, info: len(rewards) > 5}, False)])
def test_a_declared_rule_decides_without_a_warning(manager: Any, caplog: Any, kwargs: dict[str, Any],
                                                  success: bool) -> None:
    env = ExperienceWrapper(Moves(), LocalClient(manager), env_id=f"user/Declared-{len(caplog.records)}-v0", **kwargs)
    with caplog.at_level(logging.WARNING, logger="crl_gym.wrappers.success"):
        env.reset(seed=0)
        for _ in range(3):
            *_, info = env.step("step")
    assert info["distillation_request"].success is success
    assert not [r for r in caplog.records if "no success rule is declared" in r.getMessage()]


def test_a_rule_that_raises_counts_no_success_and_is_named(manager: Any, caplog: Any) -> None:
    def rule(rewards: list[float], info: dict[str, Any]) -> bool:
        raise KeyError("solved")

    env = ExperienceWrapper(Moves(moves=1), LocalClient(manager), env_id="user/Raises-v0", success_rule=rule)
    env.reset(seed=0)
    with caplog.at_level(logging.WARNING, logger="crl_gym.wrappers.experience"):
        *_, info = env.step("step")
    assert info["distillation_request"].success is False
    assert any("success_rule of env 'user/Raises-v0' raised KeyError" in r.getMessage() for r in caplog.records)


def test_local_and_remote_stats_give_the_same_fields(manager: Any) -> None:
    service = RetrievalService(manager)  # one service, two faces
    local = LocalClient(service)
    env = wrap(CorridorEnv(length=1), local)
    env.reset(seed=0, options={"experience": "guided", "rollout_step": 0})
    env.step("east")
    with BackgroundServer(service) as server:
        remote = RemoteClient(server.url, timeout=30)
        try:
            a, b = local.stats(), remote.stats()
            assert a == b and a.to_dict() == b.to_dict() and list(a.items()) == list(b.items())
            assert a.queue_depth == b.queue_depth == 1
            assert local.health() == remote.health()
        finally:
            remote.close()


def test_typed_answers_keep_a_read_only_mapping_face(manager: Any) -> None:
    client = LocalClient(manager)
    stats = client.stats()
    assert stats["queue_depth"] == stats.queue_depth and stats.get("bank_size", 0) == 1
    assert stats.get("no_such_figure", 7) == 7 and "bank_size" in stats and dict(stats.items())["bank_size"] == 1
    assert client.health()["pending"] == 0 and client.health().get("status") == "ok"
    ended = client.end_step(0)
    assert ended["step"] == 0 and ended["ended"] == [0] and set(ended) == set(ended.to_dict())
    applied = client.apply_ops([AddOp("Another tip.")])
    assert applied["added"] == 1 and len(applied) == len(applied.to_dict())
    with pytest.raises(KeyError):
        stats["no_such_figure"]
    with pytest.raises(TypeError):
        stats["bank_size"] = 3  # type: ignore[index]
    for cls in (ServiceStats, Health, StepEnded, OpsApplied):
        assert not hasattr(cls, "__setitem__")


def test_removed_remote_counters_still_answer_with_a_deprecation_warning(manager: Any) -> None:
    with BackgroundServer(manager) as server:
        client = RemoteClient(server.url, timeout=30)
        try:
            env = ExperienceWrapper(CorridorEnv(length=1), client)
            env.reset(seed=0)
            env.step("east")
            client.flush()
            counts = client.submit_counts
            for old, new in (("delivered", "delivered"), ("spilled", "spilled"), ("lost", "lost"),
                             ("buffered", "buffered"), ("rejected", "rejected"), ("submit_failures", "failures")):
                with pytest.warns(DeprecationWarning, match=rf"RemoteClient\.{old} is deprecated.*submit_counts\.{new}"):
                    assert getattr(client, old) == getattr(counts, new)
            assert counts.delivered == 1
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert client.submit_counts.delivered == 1  # the new form warns nothing
        finally:
            client.close()


def test_every_trainer_path_reads_success_one_way(manager: Any, caplog: Any) -> None:
    from crl_gym.wrappers.success import ended_success

    env = ExperienceWrapper(Moves(moves=1), LocalClient(manager), env_id="user/Paths-v0", success_reward=2.0)
    env.reset(seed=0)
    *_, info = env.step("step")
    assert ended_success(info, [1.0], "user/Paths-v0") is False  # the request's: the declared threshold 2
    assert ended_success({"success": True}, [0.0], "user/Paths-v0") is True  # the env's word
    with caplog.at_level(logging.WARNING, logger="crl_gym.wrappers.success"):
        assert ended_success({}, [1.0, 1.0], "user/Unwrapped-v0") is True  # the default rule, said once
        assert ended_success({}, [0.5], "user/Unwrapped-v0") is False
    assert len([r for r in caplog.records if "user/Unwrapped-v0" in r.getMessage()]) == 1
