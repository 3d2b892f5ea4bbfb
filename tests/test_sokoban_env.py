"""Sokoban text env: reverse-play generation (proved solvable by BFS), rules, seeding, check_env."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import crl_gym  # noqa: F401  (registers crl/ ids)
from crl_gym.envs.sokoban import (
    ACTIONS,
    Level,
    SokobanEnv,
    _distance,
    generate_level,
    push,
    solve,
)

ROOM = """\
WWWWWW
W....W
W.A@.W
W.A..W
W.CC.W
WWWWWW"""


def test_check_env_passes_without_warnings() -> None:
    env = gym.make("crl/Sokoban-6x6-v0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped)
    assert [str(w.message) for w in caught] == []
    env.close()


@pytest.mark.parametrize("seed", range(300))
def test_generated_levels_are_solvable_within_the_turn_limit(seed: int) -> None:
    env = SokobanEnv()
    env.reset(seed=seed)
    level = env.level
    assert level is not None and level.size == 6
    assert len(level.boxes) == 2 and len(level.targets) == 2
    assert not level.boxes & level.targets  # no box starts on a target
    assert level.player not in level.boxes and level.player not in level.walls
    border = {(r, c) for r in range(6) for c in range(6) if r in (0, 5) or c in (0, 5)}
    assert border <= level.walls
    plan = solve(level)
    assert plan is not None, f"seed {seed}: unsolvable level\n{level.render()}"
    assert 3 <= len(plan) <= env.max_turns


@pytest.mark.parametrize("seed", [0, 1, 7, 42, 1234])
def test_solver_plan_played_through_env_succeeds(seed: int) -> None:
    env = SokobanEnv()
    _, info = env.reset(seed=seed)
    assert info["success"] is False
    plan = solve(env.level)  # type: ignore[arg-type]
    assert plan
    for i, action in enumerate(plan):
        obs, reward, terminated, truncated, info = env.step(action)
        last = i == len(plan) - 1
        assert terminated is last and truncated is False
        assert reward == (1.0 if last else 0.0)
    assert info["success"] is True and info["turn"] == len(plan)
    assert "Boxes on targets: 2/2" in obs and "puzzle solved" in obs


def test_same_seed_same_level_and_episode() -> None:
    a, b = SokobanEnv(), SokobanEnv()
    obs_a, _ = a.reset(seed=11)
    obs_b, _ = b.reset(seed=11)
    assert obs_a == obs_b
    rng = np.random.default_rng(0)
    for action in rng.choice(ACTIONS, size=20).tolist():
        assert a.step(action) == b.step(action)
    # an unseeded reset continues the seeded stream reproducibly
    assert a.reset()[0] == b.reset()[0]
    levels = {SokobanEnv().reset(seed=s)[0] for s in range(20)}
    assert len(levels) > 15  # seeds give different levels


def test_push_rules_on_a_hand_written_level() -> None:
    level = Level.parse(ROOM)
    assert level.player == (2, 3) and level.boxes == {(2, 2), (3, 2)}
    assert level.targets == {(4, 2), (4, 3)}
    moved, msg = push(level, "up")
    assert moved.player == (1, 3) and msg == "You move up."
    blocked, msg = push(moved, "up")  # wall ahead
    assert blocked == moved and "wall" in msg
    pushed, msg = push(level, "left")  # box (2,2) -> (2,1)
    assert pushed.boxes == {(2, 1), (3, 2)} and pushed.player == (2, 2)
    stuck, msg = push(pushed, "left")  # box (2,1) would go into the wall (2,0)
    assert stuck == pushed and "does not move" in msg
    at_box = Level(6, level.walls, level.targets, level.boxes, (1, 2))
    two, msg = push(at_box, "down")  # box behind a box
    assert two == at_box and "does not move" in msg
    onto = Level(6, level.walls, level.targets, frozenset({(3, 3), (2, 2)}), (2, 3))
    done, msg = push(onto, "down")
    assert (4, 3) in done.boxes and msg == "You push the box onto a target."


def test_solver_finds_the_optimal_plan_and_none_for_a_dead_level() -> None:
    plan = solve(Level.parse(ROOM))
    assert plan is not None
    level = Level.parse(ROOM)
    for action in plan:
        level, _ = push(level, action)
    assert level.solved()
    # Breadth-first is optimal: no sequence of len(plan) - 1 moves solves it (exhaustive check
    # over all reachable states, deduplicated).
    frontier = {Level.parse(ROOM)}
    for _ in range(len(plan) - 1):
        frontier = {push(lv, a)[0] for lv in frontier for a in ACTIONS}
        assert not any(lv.solved() for lv in frontier)
    dead = Level.parse("WWWWW\nWA..W\nW.@.W\nW..CW\nWWWWW")
    assert solve(dead) is None  # a box in a corner can never move


def test_distance_by_hand() -> None:
    # boxes (1,1),(3,4); targets (4,2),(2,4)
    # (1,1): to (4,2) = 3+1 = 4, to (2,4) = 1+3 = 4 -> 4
    # (3,4): to (4,2) = 1+2 = 3, to (2,4) = 1+0 = 1 -> 1
    assert _distance({(1, 1), (3, 4)}, frozenset({(4, 2), (2, 4)})) == 5


def test_generate_level_keeps_its_guarantees_for_other_sizes() -> None:
    rng = np.random.default_rng(3)
    level = generate_level(rng, size=7, num_boxes=3, reverse_steps=40)
    assert len(level.boxes) == 3 and not level.boxes & level.targets
    plan = solve(level)
    assert plan is not None and len(plan) <= 40
    with pytest.raises(ValueError, match="size"):
        generate_level(rng, size=3)
    with pytest.raises(ValueError, match="num_boxes"):
        generate_level(rng, size=4, num_boxes=3)


def test_invalid_action_is_a_turn_that_changes_nothing() -> None:
    env = SokobanEnv(max_turns=3)
    obs0, _ = env.reset(seed=5)
    grid = obs0.split("Map:\n")[1].split("\nBoxes")[0]
    obs, reward, terminated, truncated, info = env.step("jump")
    assert "Invalid action: 'jump'" in obs and "Valid actions: up, down, left, right" in obs
    assert grid in obs and reward == 0.0 and not terminated and not truncated
    assert info["invalid_action"] is True and info["turn"] == 1
    obs, *_ = env.step(7)  # type: ignore[arg-type]  (non-text action: still just invalid)
    assert "Invalid action: '7'" in obs
    obs, _, terminated, truncated, info = env.step("x" * 100_000)
    assert len(obs) < 1000 and obs in env.observation_space
    assert truncated and not terminated  # third turn hits max_turns=3
    # stepping past the end repeats the terminal result and changes nothing
    assert env.step("up")[:4] == (obs, 0.0, False, True)


def test_aliases_and_admissible_actions() -> None:
    env = SokobanEnv()
    env.reset(options={"level": ROOM})
    obs, _, _, _, info = env.step(" North ")
    assert info["invalid_action"] is False and env.level.player == (1, 3)  # type: ignore[union-attr]
    env.step("R")
    assert env.level.player == (1, 4)  # type: ignore[union-attr]
    env.step("move-down")
    assert env.level.player == (2, 4)  # type: ignore[union-attr]
    assert list(info["admissible_actions"]) == ["up", "down", "left", "right"]
    assert info["task"].startswith("Push every box")


def test_observation_has_legend_map_and_message_and_renders_ansi() -> None:
    env = SokobanEnv(render_mode="ansi")
    obs, _ = env.reset(options={"level": ROOM})
    assert obs.startswith("Legend:\nW: wall\n.: empty floor\n@: you (the agent)\nA: box\nC: target")
    assert "Map:\n" + ROOM in obs and obs.endswith("Message: Push both boxes onto the targets.")
    assert env.render() == obs
    assert SokobanEnv().render() is None


def test_bad_levels_and_modes_have_clear_errors() -> None:
    with pytest.raises(ValueError, match="square"):
        Level.parse("WWW\nW@W")
    with pytest.raises(ValueError, match="row 2, column 3: unknown symbol 'x'"):
        Level.parse("WWWW\nW@xW\nWACW\nWWWW")
    with pytest.raises(ValueError, match="exactly one agent"):
        Level.parse("WWWW\nW..W\nWACW\nWWWW")
    with pytest.raises(ValueError, match="as many boxes as targets"):
        Level.parse("WWWW\nW@AW\nWA.W\nWWWW")
    with pytest.raises(ValueError, match="render_mode"):
        SokobanEnv(render_mode="human")
    with pytest.raises(RuntimeError, match="reset"):
        SokobanEnv().step("up")


def test_docstring_examples_run() -> None:
    import doctest

    import crl_gym.envs.base as base
    import crl_gym.envs.sokoban as sokoban

    for module in (sokoban, base):
        assert doctest.testmod(module).failed == 0
