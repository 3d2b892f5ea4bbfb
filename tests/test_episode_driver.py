"""The episode driver's parts by hand: the prompt, the answer, and one episode's life."""

from __future__ import annotations

from typing import Any

import pytest
from _trainer_fixtures import LocalClient, manager

from crl_gym.episode import (
    ACTIONS_LINE,
    MAX_OBS_CHARS,
    EpisodeDriver,
    EpisodeSpec,
    condition_of,
    read_answer,
    search_turns,
    system_text,
    user_text,
)
from crl_gym.episode.prompt import listed_actions
from crl_gym.templates import SYSTEM_CONSTRAINED, SYSTEM_REACT, SYSTEM_TOOLS
from crl_gym.wrappers.examples import CorridorEnv
from crl_gym.wrappers.experience import ExperienceWrapper

# ------------------------------------------------------------------------------ prompt


def test_user_text_truncates_then_lists_the_actions() -> None:
    assert user_text("room", ["north", "south"]) == "room\nValid actions: north, south"
    assert user_text("room", []) == "room"
    assert user_text("room", ["north"], constrained=True) == "room"
    long = "a" * 3000 + "b" * 3000
    text = user_text(long, ["x"])
    head, _, actions = text.partition(ACTIONS_LINE)
    # 4,000 characters: 1,999 of the head, " … ", 1,998 of the tail
    assert len(head) == MAX_OBS_CHARS and head == "a" * 1999 + " … " + "b" * 1998
    assert actions == "x" and listed_actions(text) == ["x"]


def test_one_system_text_per_answer_format() -> None:
    assert system_text() == SYSTEM_REACT
    assert system_text(tools=True) == SYSTEM_TOOLS
    assert system_text(constrained=True) == SYSTEM_CONSTRAINED


# ------------------------------------------------------------------------------ answer


@pytest.mark.parametrize(
    ("text", "action", "readable", "tool"),
    [
        ("go <action>east</action>", "east", True, False),
        ("<action>a</action> then <action> b </action>", "b", True, False),
        # a draft is no action: unreadable, so the whole answer goes to the env
        (
            "<think><action>x</action></think> east",
            "<think><action>x</action></think> east",
            False,
            False,
        ),
        ("  east\n", "east", False, False),
        ("<action>search_and_ask[where?]</action>", "search_and_ask[where?]", True, True),
        ("<action>search_and_ask[wher", "<action>search_and_ask[wher", False, True),  # cut off
    ],
)
def test_read_answer(text: str, action: str, readable: bool, tool: bool) -> None:
    answer = read_answer(text)
    assert (answer.action, answer.readable, answer.tool_call) == (action, readable, tool)


def test_a_constrained_answer_is_the_action() -> None:
    assert read_answer(" east ", constrained=True).action == "east"
    assert read_answer("<action>east</action>", constrained=True).action == "<action>east</action>"


def test_condition_of_splits_each_group_in_halves() -> None:
    assert [condition_of(c, 4) for c in range(8)] == ["guided", "guided", "free", "free"] * 2
    assert [condition_of(c, 3) for c in range(3)] == ["guided", "free", "free"]
    with pytest.raises(ValueError, match="group_size"):
        condition_of(0, 0)


# ------------------------------------------------------------------------------ driver


def wrapped(
    entries: tuple[str, ...] = ("Walk east.",), **kwargs: Any
) -> tuple[ExperienceWrapper, Any]:
    mgr = manager(entries)
    return ExperienceWrapper(
        CorridorEnv(length=2), LocalClient(mgr), env_id="corridor", **kwargs
    ), mgr


def test_an_episode_the_env_ends() -> None:
    env, mgr = wrapped()
    driver = EpisodeDriver(env, max_turns=5)
    first = driver.reset(EpisodeSpec("corridor", 0, "guided", rollout_step=2, copy=0, group_size=2))
    assert first.startswith("Experience from similar tasks") and "Walk east." in first
    assert driver.messages() == [
        {"role": "system", "content": SYSTEM_REACT},
        {"role": "user", "content": first},
    ]
    assert driver.step("<action>east</action>") == (
        "You are at cell 1 of a corridor; the exit is at cell 2, to the east."
        "\nValid actions: east, west"
    )
    assert driver.step("east") is None  # unreadable, passed on whole: the env ends the episode
    ep = driver.episode
    assert ep is not None and ep.done and ep.success and ep.cut is None and ep.unreadable == 1
    assert [t.action for t in ep.turns] == ["east", "east"] and ep.ret == 1.0
    req = ep.request
    assert req is not None and req.success and req.rollout_step == 2 and req.condition == "guided"
    assert req.meta == {"group_copy": 0, "group_size": 2}
    assert mgr.pending() == 1  # the wrapper submitted it
    mgr.close()


def test_the_turn_cap_cuts_and_the_wrapper_submits_a_failure() -> None:
    env, mgr = wrapped()
    driver = EpisodeDriver(env, max_turns=2)
    driver.reset(EpisodeSpec("corridor", 0))
    assert driver.step("<action>west</action>") is not None
    assert driver.step("<action>west</action>") is None
    ep = driver.episode
    assert ep is not None and ep.cut == "turn_cap" and not ep.success
    assert (
        ep.request is not None and ep.request.meta == {"turn_cap": True} and not ep.request.success
    )
    assert len(ep.request.trajectory.steps) == 2 and mgr.pending() == 1
    with pytest.raises(RuntimeError, match="over"):
        driver.act("east")
    assert driver.cut("context_truncated") is ep.request  # an ended episode stays as it ended
    mgr.close()


def test_a_loop_cut_and_an_unwrapped_env() -> None:
    driver = EpisodeDriver(CorridorEnv(length=3))
    driver.reset(EpisodeSpec("corridor", 0, "guided"))
    driver.step("<action>east</action>")
    assert driver.cut("context_truncated") is None  # no wrapper: no request
    ep = driver.episode
    assert ep is not None and ep.cut == "context_truncated" and ep.done
    with pytest.raises(ValueError, match="reason"):
        driver.cut("bored")


class Broken(CorridorEnv):
    def step(self, action: str) -> Any:
        raise RuntimeError("crashed")


def test_an_env_error_ends_the_episode_without_a_request() -> None:
    env, mgr = wrapped()
    env = ExperienceWrapper(Broken(length=2), LocalClient(mgr), env_id="broken")
    driver = EpisodeDriver(env)
    driver.reset(EpisodeSpec("broken", 0))
    with pytest.raises(RuntimeError, match="crashed"):
        driver.act("<action>east</action>")
    ep = driver.episode
    assert (
        ep is not None
        and ep.done
        and ep.error == "step: RuntimeError: crashed"
        and ep.request is None
    )
    episode = EpisodeDriver(ExperienceWrapper(Broken(length=2), LocalClient(mgr))).run(
        EpisodeSpec("broken", 0), lambda messages: "<action>east</action>"
    )
    assert episode.error is not None and not episode.success  # run() records it, never raises
    mgr.close()


def test_per_turn_searches_of_many_drivers_are_one_search_many() -> None:
    mgr = manager(("Walk east.",))
    client = LocalClient(mgr)
    calls: list[list[str]] = []
    search_many = client.search_many

    def spy(queries: list[str]) -> Any:
        calls.append(list(queries))
        return search_many(queries)

    client.search_many = spy  # type: ignore[method-assign]
    drivers = [
        EpisodeDriver(
            ExperienceWrapper(
                CorridorEnv(length=3), client, retrieve="turn", defer_turn_search=True
            )
        )
        for _ in range(3)
    ]
    for d in drivers:
        d.reset(EpisodeSpec("corridor", 0, "guided"))
        d.act("<action>east</action>")
        assert d.turn_query is not None
        with pytest.raises(RuntimeError, match="search"):
            d.observe()
    assert search_turns(drivers, client) == 0 and len(calls) == 1 and len(calls[0]) == 3
    for d in drivers:
        shown = d.observe()
        assert (
            shown is not None
            and shown.startswith("Experience for this step")
            and "Walk east." in shown
        )
        assert d.episode is not None and [g.turn for g in d.episode.turn_experience] == [0, 1]
    mgr.close()


def test_end_submits_what_the_loop_stopped() -> None:
    env, mgr = wrapped()
    driver = EpisodeDriver(env, tools=True)
    assert driver.system == SYSTEM_TOOLS
    driver.reset(EpisodeSpec("corridor", 0))
    driver.step("east")
    request = driver.end()
    assert request is not None and not request.success and not request.meta
    assert driver.episode is not None and driver.episode.done and not driver.episode.success
    mgr.close()
