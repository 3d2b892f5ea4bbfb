"""A text env as a user brings it: its own text untouched in guided episodes, honest success,
non-text spaces refused, outages kept, and the same size limits in process and over HTTP."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest
from gymnasium import spaces

from crl_gym.clients import LocalClient, RemoteClient, RequestTooLarge, SubmitUndelivered
from crl_gym.envs.base import TEXT_CHARSET
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.config import ManagerConfig
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.protocol import AddOp, DistillationRequest, Trajectory
from crl_gym.server import BackgroundServer
from crl_gym.wrappers import ExperienceWrapper, SearchAndAskWrapper
from crl_gym.wrappers.accepted_envs import require_gym_env

TIP = "Halve the range with each guess: café, Größe, 数字 — and always answer with one number."
EMB = HashingEmbedder(64)


class UserEnv(gym.Env[str, str]):
    """A user's text env: fixed first observation, scripted rewards, info["success"] optional."""

    def __init__(self, first: str, space: gym.Space[Any], rewards: tuple[float, ...] = (1.0,),
                 success: bool | None = None) -> None:
        self.observation_space = space
        self.action_space = spaces.Text(max_length=64)
        self.first, self.rewards, self.success = first, rewards, success
        self.turn = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self.turn = 0
        return self.first, {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        reward = self.rewards[self.turn]
        self.turn += 1
        done = self.turn == len(self.rewards)
        info: dict[str, Any] = {} if self.success is None or not done else {"success": self.success}
        return "next", reward, done, False, info


@pytest.fixture()
def manager() -> Any:
    bank = ExperienceBank(None, dim=64)
    m = ExperienceManager(bank, EMB)
    m.apply_ops([AddOp(TIP)])
    yield m
    m.close()


GERMAN = "Zahlenraten: Errate die Zahl im Bereich 1–100 · 数字 ist gesucht · café, Größe."
SPACED = "Zahlenraten game: guess a number between 1 and 100, then answer with the number only."
LONG = ("You play Zahlenraten. " * 6)[:137] + " Answer with one number."  # 161 characters


@pytest.mark.parametrize("first, space", [
    (GERMAN, spaces.Text(max_length=200, charset=TEXT_CHARSET)),  # non-ASCII outside the charset
    (SPACED, spaces.Text(max_length=200)),  # Gymnasium's default charset: alphanumerics only
    (LONG, spaces.Text(max_length=len(LONG) + 2, charset=TEXT_CHARSET)),  # a tight max_length
])
def test_the_guided_observation_holds_the_envs_own_text_unchanged(manager: Any, first: str, space: Any) -> None:
    env = ExperienceWrapper(UserEnv(first, space), LocalClient(manager))
    free, _ = env.reset(seed=0, options={"experience": "free"})
    guided, info = env.reset(seed=0, options={"experience": "guided"})
    assert free == first
    assert guided.endswith("\n\n" + first), guided  # the same task text as the free half reads
    assert info["experience"]["text"] == TIP
    assert "Halve the range with each guess" in guided  # the entry is shown, fitted
    if space.contains(first):  # the env keeps to its space: so does the guided observation
        assert env.observation_space.contains(guided)


def test_search_and_ask_never_changes_the_envs_observation(manager: Any) -> None:
    env = SearchAndAskWrapper(UserEnv(GERMAN, spaces.Text(max_length=400, charset=TEXT_CHARSET)), LocalClient(manager))
    env.reset(seed=0)
    obs, *_ = env.step("search_and_ask[which range?]")
    assert obs.endswith(GERMAN)


@pytest.mark.parametrize("rewards, declared, expected", [
    ((0.0, 0.2), None, False),  # partial credit for a wrong answer
    ((0.947,), None, False),  # a loss scored by the game
    ((0.0, 1.0), None, True),
    ((0.2,), True, True),  # the env's own word wins
    ((3.0,), False, False),
])
def test_success_is_the_envs_word_else_a_full_return(manager: Any, rewards: tuple[float, ...],
                                                       declared: bool | None, expected: bool) -> None:
    env = ExperienceWrapper(UserEnv("Guess.", spaces.Text(64), rewards, declared), LocalClient(manager))
    env.reset(seed=0)
    info: dict[str, Any] = {}
    for _ in rewards:
        *_, info = env.step("5")
    assert info["distillation_request"].success is expected


def test_fractional_rewards_without_success_warn_once_naming_the_env(manager: Any, caplog: Any) -> None:
    env = ExperienceWrapper(UserEnv("Guess.", spaces.Text(64), (0.2,)), LocalClient(manager), env_id="user/Partial-v7")
    with caplog.at_level(logging.WARNING, logger="crl_gym.wrappers.success"):
        for _ in range(3):
            env.reset(seed=0)
            env.step("5")
    warned = [r for r in caplog.records if "user/Partial-v7" in r.getMessage()]
    assert len(warned) == 1 and "info['success']" in warned[0].getMessage()


def test_an_unregistered_env_records_its_class_name(manager: Any) -> None:
    env = ExperienceWrapper(UserEnv("Guess.", spaces.Text(64)), LocalClient(manager))
    env.reset(seed=0)
    assert env.step("5")[4]["distillation_request"].env_id == "UserEnv"


@pytest.mark.parametrize("what, space", [
    ("observation", spaces.Dict({"board": spaces.Text(64), "player": spaces.Discrete(2)})),
    ("action", spaces.Discrete(4)),
])
@pytest.mark.parametrize("wrapper", [ExperienceWrapper, SearchAndAskWrapper])
def test_non_text_spaces_are_refused_at_construction(manager: Any, what: str, space: Any, wrapper: Any) -> None:
    env = UserEnv("Guess.", spaces.Text(64))
    setattr(env, f"{what}_space", space)
    with pytest.raises(TypeError, match=rf"needs text {what}s.*adapter.*Your own env"):
        wrapper(env, LocalClient(manager))


class TurnGame:
    """Not a gymnasium.Env: a turn-based game API."""

    def reset(self, num_players: int) -> None: ...

    def step(self, action: str) -> tuple[bool, dict[str, Any]]:
        return False, {}


class SeededGame:
    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return "", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "", 0.0, True, False, {}


def test_the_gem_adapter_is_suggested_only_for_what_it_can_drive() -> None:
    with pytest.raises(TypeError) as no_gem:
        require_gym_env(TurnGame(), "ExperienceWrapper")
    assert "GEMEnv" not in str(no_gem.value) and "Your own env" in str(no_gem.value)
    with pytest.raises(TypeError, match=r"GEMEnv\(env=obj\)"):
        require_gym_env(SeededGame(), "ExperienceWrapper")


# ----------------------------------------------------------------------------- outages


def _episode(env: ExperienceWrapper) -> dict[str, Any]:
    env.reset(seed=0)
    return env.step("5")[4]


def test_a_closed_manager_is_an_outage_the_request_is_kept(tmp_path: Path) -> None:
    manager = ExperienceManager(ExperienceBank(tmp_path / "bank", dim=64), EMB)
    env = ExperienceWrapper(UserEnv("Guess.", spaces.Text(64)), LocalClient(manager))
    manager.close()
    info = _episode(env)
    assert env.rejected_count == 0 and env.error_count == 1 and len(env.unsent) == 1
    assert "ExperienceManager is closed" in info["experience_error"]
    manager.bank.close()
    reopened = ExperienceManager(ExperienceBank(tmp_path / "bank", dim=64), EMB)
    env.client = LocalClient(reopened)
    assert env.retry_unsent() == 0 and reopened.pending() == 1
    reopened.close()
    reopened.bank.close()


def test_a_full_disk_is_an_outage_the_request_is_kept(tmp_path: Path) -> None:
    manager = ExperienceManager(ExperienceBank(tmp_path / "bank", dim=64), EMB, ManagerConfig(queue_size=1))
    env = ExperienceWrapper(UserEnv("Guess.", spaces.Text(64)), LocalClient(manager))
    _episode(env)  # the queue's memory holds one: the next one spills to its file
    manager.queue._writer.close()
    manager.queue._writer = open("/dev/full", "a", encoding="utf-8")  # noqa: SIM115 - writes fail with ENOSPC
    info = _episode(env)
    assert env.rejected_count == 0 and len(env.unsent) == 1 and "disk full" in info["experience_error"]
    manager.queue._writer = open(manager.queue.spill_path, "a", encoding="utf-8")  # noqa: SIM115 - disk has room again
    assert env.retry_unsent() == 0 and manager.pending() == 2
    manager.close()
    manager.bank.close()


def test_a_dead_server_spills_and_the_flush_says_so(tmp_path: Path) -> None:
    from _servers import free_port

    client = RemoteClient(f"http://127.0.0.1:{free_port()}", timeout=2, retries=0, spill_path=tmp_path / "unsent.jsonl")
    env = ExperienceWrapper(UserEnv("Guess.", spaces.Text(64)), client)
    _episode(env)
    report = env.flush_experience()
    assert report["undelivered"] is not None and "unsent.jsonl" in report["undelivered"]
    assert client.submit_counts.spilled == 1 and len((tmp_path / "unsent.jsonl").read_text().splitlines()) == 1
    client.close()


# ----------------------------------------------------------------------------- limits


@pytest.fixture()
def server(manager: Any) -> Any:
    with BackgroundServer(manager) as srv:
        yield srv


def test_a_huge_observation_searches_the_same_way_local_and_remote(manager: Any, server: Any) -> None:
    huge = "Zahlenraten. " * 80_000  # ~1 MB: above what one /search body field may hold
    for client in (LocalClient(manager), RemoteClient(server.url, timeout=30)):
        env = ExperienceWrapper(UserEnv(huge, spaces.Text(max_length=2_000_000)), client)
        obs, info = env.reset(seed=0, options={"experience": "guided"})
        assert "experience_error" not in info, info.get("experience_error")
        assert info["experience"]["text"] == TIP and obs.endswith(huge)
        client.close()


def test_search_many_takes_more_queries_than_one_http_call_holds(manager: Any, server: Any) -> None:
    client = RemoteClient(server.url, timeout=60)
    refs = client.search_many([f"guess number {i}" for i in range(4100)])
    assert len(refs) == 4100 and all(r is not None and r.text == TIP for r in refs)
    client.close()


def _request(text: str) -> DistillationRequest:
    return DistillationRequest("guess", Trajectory(initial_observation=text), 1.0, True, None)


def test_a_request_above_the_body_limit_is_refused_at_submit_on_both_clients(manager: Any, server: Any) -> None:
    big = _request("x" * (4 * 1024 * 1024 + 1))
    for client in (LocalClient(manager), RemoteClient(server.url)):
        with pytest.raises(RequestTooLarge, match="body limit"):
            client.submit(big)
    env = ExperienceWrapper(UserEnv("x" * (4 * 1024 * 1024 + 1), spaces.Text(max_length=5_000_000)), LocalClient(manager))
    info = _episode(env)
    assert env.rejected_count == 1 and "body limit" in info["experience_error"]
    assert info["distillation_request"] is not None  # refused, said so, still in the caller's hands


def test_a_request_that_encodes_above_the_body_limit_is_spilled_not_dropped(server: Any, tmp_path: Path) -> None:
    client = RemoteClient(server.url, timeout=30, spill_path=tmp_path / "unsent.jsonl")
    client.submit(_request("数" * 2_000_000))  # 2 M characters, 6 MB of UTF-8
    with pytest.raises(SubmitUndelivered, match="body limit"):
        client.flush()
    assert client.submit_counts.spilled == 1 and client.submit_counts.rejected == 0
    assert len((tmp_path / "unsent.jsonl").read_text(encoding="utf-8").splitlines()) == 1
    client.close()
