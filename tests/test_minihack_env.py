"""MiniHack text env on the real nle/minihack packages: check_env, seeding, invalid actions,
a scripted policy that reaches the goal, and that closing frees NetHack's resources."""

from __future__ import annotations

import os
import warnings
from collections import deque
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import crl_gym  # noqa: F401  (registers crl/ ids)
from crl_gym.envs.minihack import TASKS, MiniHackEnv, glyph_description

IDS = [f"crl/MiniHack-{task}-v0" for task in TASKS]


def parse(obs: str) -> tuple[dict[str, list[str]], list[str], str]:
    """Split an observation into legend {symbol: [meanings]}, map rows and message."""
    head, rest = obs.split("Map:\n", 1)
    grid, message = rest.split("\nMessage: ", 1)
    legend: dict[str, list[str]] = {}
    for line in head.splitlines():
        if len(line) > 3 and line[1:3] == ": ":
            legend.setdefault(line[0], []).append(line[3:])
    return legend, grid.split("\n"), message.split("\n")[0]


def find(grid: list[str], symbol: str) -> tuple[int, int] | None:
    for r, row in enumerate(grid):
        c = row.find(symbol)
        if c >= 0:
            return r, c
    return None


DIRECTIONS = {
    (-1, 0): "north", (1, 0): "south", (0, 1): "east", (0, -1): "west",
    (-1, 1): "northeast", (1, 1): "southeast", (1, -1): "southwest", (-1, -1): "northwest",
}  # fmt: skip


def walk_to_stairs(obs: str) -> str:
    """Scripted policy: read the map and step (diagonally when possible) towards ``>``."""
    _, grid, _ = parse(obs)
    me, goal = find(grid, "@"), find(grid, ">")
    assert me is not None and goal is not None, obs
    dr, dc = int(np.sign(goal[0] - me[0])), int(np.sign(goal[1] - me[1]))
    return DIRECTIONS[(dr, dc)]


@pytest.mark.parametrize("env_id", IDS)
def test_check_env_passes_without_warnings(env_id: str) -> None:
    env = gym.make(env_id)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped)
    assert [str(w.message) for w in caught if "pkg_resources" not in str(w.message)] == []
    env.close()


@pytest.mark.parametrize("task", ["Room-Ultimate-5x5", "MazeWalk-9x9", "River-Narrow"])
def test_same_seed_and_actions_reproduce_the_episode(task: str) -> None:
    def episode(seed: int) -> list[tuple[str, float, bool, bool]]:
        env = MiniHackEnv(task, max_turns=40)
        obs, _ = env.reset(seed=seed)
        rng = np.random.default_rng(123)
        out = [(obs, 0.0, False, False)]
        for _ in range(40):
            obs, reward, term, trunc, _ = env.step(env.actions[int(rng.integers(8))])
            out.append((obs, reward, term, trunc))
            if term or trunc:
                break
        # an unseeded reset continues the seeded stream reproducibly
        out.append((env.reset()[0], 0.0, False, False))
        env.close()
        return out

    assert episode(5) == episode(5)
    assert episode(5) != episode(6)


def test_different_seeds_give_different_levels() -> None:
    # Room-5x5 is a fixed room (start top-left, stairs bottom-right); the others are random.
    env = MiniHackEnv("MazeWalk-9x9")
    starts = {env.reset(seed=s)[0] for s in range(8)}
    env.close()
    assert len(starts) > 1


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_scripted_policy_reaches_the_stairs_in_room_5x5(seed: int) -> None:
    env = gym.make("crl/MiniHack-Room-5x5-v0")
    obs, info = env.reset(seed=seed)
    assert info["task"].endswith("Reach the staircase down (>).") and info["success"] is False
    rewards = []
    for _ in range(30):
        obs, reward, terminated, truncated, info = env.step(walk_to_stairs(obs))
        rewards.append(reward)
        if terminated or truncated:
            break
    env.close()
    assert terminated and not truncated and info["success"] is True
    # NLE blanks its buffers when the game ends: the last view is kept, the message says why.
    assert obs.endswith("Message: You reached the staircase down. Task complete!")
    assert "Map:\n" in obs and obs in env.observation_space
    assert rewards[-1] == 1.0 and set(rewards[:-1]) <= {0.0}
    assert info["turn"] == len(rewards) <= 4  # 5x5 room: at most 4 diagonal/straight moves


def test_observation_legend_covers_every_symbol_on_the_map() -> None:
    for task in TASKS:
        env = MiniHackEnv(task)
        obs, info = env.reset(seed=3)
        rng = np.random.default_rng(0)
        for _ in range(10):
            legend, grid, message = parse(obs)
            symbols = set("".join(grid)) - {" "}
            assert symbols <= set(legend), (task, symbols - set(legend), obs)
            assert legend["@"] == ["you (the agent)"] and message
            obs, *_ = env.step(env.actions[int(rng.integers(len(env.actions)))])
        env.close()


def test_glyph_descriptions_use_nethack_names() -> None:
    from nle import nethack

    stairs = nethack.GLYPH_CMAP_OFF + 24  # S_dnstair: cmap index 24 in NetHack 3.6 (S_room is 19)
    assert glyph_description(stairs) == "staircase down"
    assert glyph_description(nethack.GLYPH_CMAP_OFF + 19) == "floor of a room"


def test_invalid_action_costs_a_turn_and_lists_valid_actions() -> None:
    env = MiniHackEnv("Room-5x5", max_turns=3)
    obs0, _ = env.reset(seed=1)
    obs, reward, terminated, truncated, info = env.step("dance")
    assert obs.startswith("Invalid action: 'dance'. Valid actions: north, east, south, west,")
    assert obs.endswith(obs0)  # the current view is repeated; NetHack was not stepped
    assert (reward, terminated, truncated, info["turn"], info["invalid_action"]) == (
        0.0,
        False,
        False,
        1,
        True,
    )
    obs, *_ = env.step(None)  # type: ignore[arg-type]
    assert obs.startswith("Invalid action: 'None'")
    obs, reward, terminated, truncated, info = env.step("z" * 70_000)
    assert obs in env.observation_space and truncated and not terminated
    assert env.step("north")[:4] == (obs, 0.0, False, True)  # finished: nothing changes
    env.close()


def test_aliases_keyroom_actions_and_render() -> None:
    env = MiniHackEnv("KeyRoom-Dark-S5", render_mode="ansi")
    obs, info = env.reset(seed=2)
    assert list(info["admissible_actions"][-2:]) == ["pick_up", "apply"]
    assert "Inventory: " in obs and env.render() == obs
    obs, *_, info = env.step("Pick Up")  # the agent starts on the up staircase
    assert info["invalid_action"] is False and "stairs are solidly fixed" in obs
    obs, *_, info = env.step("apply")  # no key yet: NetHack answers, nothing raises
    assert info["invalid_action"] is False
    for alias in ("N", "se", "south-west", "NorthWest"):
        assert env.step(alias)[4]["invalid_action"] is False
    env.close()
    assert MiniHackEnv("Room-5x5").render() is None


def test_unknown_task_and_use_after_close_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="known tasks: Room-5x5"):
        MiniHackEnv("Room-99x99")
    env = MiniHackEnv()
    env.close()
    env.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        env.reset()


def test_closing_frees_nethack_resources() -> None:
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    warm = MiniHackEnv()
    warm.reset(seed=0)
    warm.close()
    before = open_fds()
    envs = [MiniHackEnv() for _ in range(8)]
    for env in envs:
        env.reset(seed=0)
    assert open_fds() > before  # each NetHack holds files while open
    for env in envs:
        env.close()
    assert open_fds() == before


ORTHOGONAL = {(-1, 0): "north", (1, 0): "south", (0, 1): "east", (0, -1): "west"}
WALKABLE = set(".(<>")


def _cell(grid: list[str], r: int, c: int) -> str:
    return grid[r][c] if 0 <= r < len(grid) and 0 <= c < len(grid[r]) else " "


def _first_step(grid: list[str], start: tuple[int, int], goal: Any) -> str | None:
    """Breadth-first over walkable cells (orthogonal moves: doors forbid diagonals)."""
    queue, prev = deque([start]), {start: start}
    while queue:
        p = queue.popleft()
        if p != start and goal(p):
            while prev[p] != start:
                p = prev[p]
            return ORTHOGONAL[(p[0] - start[0], p[1] - start[1])]
        for dr, dc in ORTHOGONAL:
            n = (p[0] + dr, p[1] + dc)
            if n not in prev and _cell(grid, *n) in WALKABLE:
                prev[n] = p
                queue.append(n)
    return None


def keyroom_policy(obs: str, state: dict[str, Any]) -> str:
    """Scripted KeyRoom player: fetch the key, pick_up, apply at the door, walk in, reach ``>``."""
    _, grid, _ = parse(obs)
    me = find(grid, "@")
    assert me is not None
    has_key = "key" in obs.split("Inventory: ")[-1]
    if state.pop("on_key", False) and not has_key:
        return "pick_up"
    if "through" in state:  # second step through the opened door
        return str(state.pop("through"))
    key, stairs, door = find(grid, "("), find(grid, ">"), find(grid, "+")
    if not has_key and key is not None:
        step = _first_step(grid, me, lambda p: p == key)
        if step is not None:
            dr, dc = next(d for d, name in ORTHOGONAL.items() if name == step)
            state["on_key"] = (me[0] + dr, me[1] + dc) == key
            return step
    if stairs is not None and (step := _first_step(grid, me, lambda p: p == stairs)):
        return step
    if has_key:
        for (dr, dc), name in ORTHOGONAL.items():
            if _cell(grid, me[0] + dr, me[1] + dc) == "+":
                state["door"] = name
                return "apply"
        if "door" in state:  # it opened (an open door looks like a wall): walk through
            state["through"] = state.pop("door")
            return str(state["through"])
        if door is not None:
            adjacent = _first_step(
                grid, me, lambda p: abs(p[0] - door[0]) + abs(p[1] - door[1]) == 1
            )
            if adjacent:
                return adjacent
    unexplored = _first_step(
        grid, me, lambda p: any(_cell(grid, p[0] + dr, p[1] + dc) == " " for dr, dc in ORTHOGONAL)
    )
    return unexplored or "north"


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_scripted_policy_picks_up_and_applies_the_key_in_keyroom(seed: int) -> None:
    env = MiniHackEnv("KeyRoom-Dark-S5")
    obs, _ = env.reset(seed=seed)
    state: dict[str, Any] = {}
    used: list[str] = []
    for _ in range(env.max_turns):
        used.append(keyroom_policy(obs, state))
        obs, reward, terminated, truncated, info = env.step(used[-1])
        if terminated or truncated:
            break
    env.close()
    assert "pick_up" in used and "apply" in used
    assert terminated and info["success"] is True and reward == 1.0, obs


def test_docstring_example_runs() -> None:
    import doctest

    import crl_gym.envs.minihack as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
