"""ALFWorld env over small ALFRED-format games that the test builds itself.

The games are real ``game.tw-pddl`` files: alfworld's own PDDL domain and TextWorld grammar
(shipped in the ``alfworld`` package), a PDDL problem with ALFRED-mangled object ids
(``Apple_bar__minus_01_dot_65_...``) and the task text filled in by alfworld's
``add_task_to_grammar`` from a ``traj_data.json``, laid out as ``alfworld-download`` does.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

pytest.importorskip("alfworld")
pytest.importorskip("textworld")

import alfworld  # noqa: E402
from alfworld.agents.utils.misc import add_task_to_grammar  # noqa: E402

import crl_gym  # noqa: E402,F401
from crl_gym.envs.alfworld import ALFWorldDataError, ALFWorldEnv, collect_games  # noqa: E402

LOGIC = Path(alfworld.__file__).parent / "data"


def mangle(alfred_id: str) -> str:
    """ALFRED object id -> PDDL name, as ALFRED's problem files spell them."""
    for a, b in (("|", "_bar_"), ("-", "_minus_"), ("+", "_plus_"), (".", "_dot_")):
        alfred_id = alfred_id.replace(a, b)
    return alfred_id


def write_game(trial: Path, obj: str, target: str, *, solvable: bool = True) -> Path:
    """One pick_and_place_simple game: take the ``obj`` from the countertop, put it in ``target``."""
    item = mangle(f"{obj}|-01.65|+00.81|+00.07")
    recs = {
        mangle("CounterTop|-01.87|+00.95|-01.21"): ("CounterTopType", "loc_bar__minus_5_bar__minus_7_bar_3_bar_45", False),
        mangle("Fridge|-02.10|+00.00|+01.07"): ("FridgeType", "loc_bar__minus_4_bar_4_bar_3_bar_60", True),
        mangle("Cabinet|-01.55|+00.50|+00.38"): ("CabinetType", "loc_bar__minus_4_bar_2_bar_3_bar_60", True),
        mangle("Microwave|-00.24|+01.69|-02.53"): ("MicrowaveType", "loc_bar__minus_1_bar__minus_7_bar_2_bar_0", True),
    }
    counter = next(iter(recs))
    start = "loc_bar_4_bar_5_bar_3_bar_30"
    objects = [f"{item} - object", f"{obj}Type - otype", "agent1 - agent"]
    objects += [f"{t} - rtype" for t, _, _ in recs.values()]
    objects += [f"{r} - receptacle" for r in recs]
    objects += [f"{loc} - location" for loc in sorted({loc for _, loc, _ in recs.values()} | {start})]
    init = ["(= (totalCost) 0)", f"(atLocation agent1 {start})", f"(objectType {item} {obj}Type)",
            f"(pickupable {item})", f"(inReceptacle {item} {counter})",
            f"(objectAtLocation {item} {recs[counter][1]})"]
    for r, (rtype, loc, openable) in recs.items():
        init += [f"(receptacleType {r} {rtype})", f"(receptacleAtLocation {r} {loc})",
                 f"(canContain {rtype} {obj}Type)"]
        if openable:
            init.append(f"(openable {r})")
    goal = (f"(exists (?o - object ?r - receptacle) (and (objectType ?o {obj}Type) "
            f"(receptacleType ?r {target}Type) (inReceptacle ?o ?r)))")
    problem = ("(define (problem plan_test)\n (:domain alfred)\n (:objects\n  " + "\n  ".join(objects)
               + ")\n (:init\n  " + "\n  ".join(init) + ")\n (:goal (and " + goal + ")))\n")
    traj = {"task_type": "pick_and_place_simple",
            "pddl_params": {"object_target": obj, "parent_target": target, "toggle_target": "",
                            "mrecep_target": "", "object_sliced": False},
            "turk_annotations": {"anns": [{"task_desc": f"Put the {obj.lower()} away."}]}}
    trial.mkdir(parents=True, exist_ok=True)
    (trial / "traj_data.json").write_text(json.dumps(traj))
    grammar = add_task_to_grammar((LOGIC / "alfred.twl2").read_text(), traj, rng=random.Random(0))
    game = {"pddl_domain": (LOGIC / "alfred.pddl").read_text(), "grammar": grammar,
            "pddl_problem": problem, "solvable": solvable, "walkthrough": None}
    (trial / "game.tw-pddl").write_text(json.dumps(game))
    return trial / "game.tw-pddl"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("alfworld_data")
    split = root / "json_2.1.1"
    write_game(split / "train" / "pick_and_place_simple-Apple-None-Fridge-1" / "trial_T1", "Apple", "Fridge")
    write_game(split / "train" / "pick_and_place_simple-Mug-None-Cabinet-2" / "trial_T1", "Mug", "Cabinet")
    # filtered out like AlfredTWEnv does: unsolvable, and movable-receptacle trials
    write_game(split / "train" / "pick_and_place_simple-Egg-None-Fridge-3" / "trial_T1", "Egg", "Fridge", solvable=False)
    write_game(split / "train" / "pick_and_place_simple-Cup-None-Fridge-movable-4" / "trial_T1", "Cup", "Fridge")
    write_game(split / "valid_unseen" / "pick_and_place_simple-Apple-None-Microwave-5" / "trial_T1", "Apple", "Microwave")
    return root


def test_collect_games_applies_alfworld_filters(data_dir: Path) -> None:
    games = collect_games(data_dir / "json_2.1.1" / "train")
    assert [g.parent.parent.name for g in games] == [
        "pick_and_place_simple-Apple-None-Fridge-1", "pick_and_place_simple-Mug-None-Cabinet-2"]
    assert collect_games(data_dir / "json_2.1.1" / "train", task_types=(2,)) == []


def test_env_checker_passes(data_dir: Path) -> None:
    env = ALFWorldEnv(data_dir=data_dir, render_mode="ansi")
    check_env(env.unwrapped)
    env.close()


def test_planner_plan_wins_with_plus_one(data_dir: Path) -> None:
    env = ALFWorldEnv(data_dir=data_dir, expert_plan=True)
    obs, info = env.reset(options={"game": 0})
    # alfworld picks one of its goal templates at random when the game is written
    assert "Your task is to: " in obs and obs.endswith(info["task"])
    assert "apple" in info["task"] and "fridge" in info["task"]
    # ALFRED ids are demangled by alfworld's AlfredDemangler: names like "countertop 1"
    assert "go to countertop 1" in info["admissible_actions"] and "help" not in info["admissible_actions"]
    plan = info["expert_plan"]
    assert plan[-1] == "move apple 1 to fridge 1"
    total, steps = 0.0, 0
    for action in plan:
        obs, reward, terminated, truncated, info = env.step(action)
        total += reward
        steps += 1
    assert terminated and not truncated and info["success"] is True
    assert total == 1.0 and steps == len(plan) == info["turn"]
    assert env.render() is None  # no render_mode given
    env.close()


def test_failure_at_turn_limit_gives_minus_one(data_dir: Path) -> None:
    assert ALFWorldEnv(data_dir=data_dir).max_turns == 40  # the paper's limit
    env = ALFWorldEnv(data_dir=data_dir, max_turns=3)
    env.reset(seed=1)
    rewards = [env.step("look")[1] for _ in range(2)]
    obs, reward, terminated, truncated, info = env.step("look")
    # two non-final turns give 0; the third hits the limit without success: -1
    assert rewards == [0.0, 0.0] and reward == -1.0
    assert truncated and not terminated and info["success"] is False
    env.close()


def test_invalid_action_is_a_turn_that_lists_valid_actions(data_dir: Path) -> None:
    env = ALFWorldEnv(data_dir=data_dir, render_mode="ansi")
    _, info = env.reset(options={"game": 0})
    obs, reward, terminated, truncated, info2 = env.step("fly to the moon")
    assert obs.startswith("Invalid action: 'fly to the moon'")
    assert "go to fridge 1" in obs and reward == 0.0 and not (terminated or truncated)
    assert info2["turn"] == 1 and info2["admissible_actions"] == info["admissible_actions"]
    assert info2["invalid_action"] is True and obs.endswith(info["task"])  # the view is shown again
    assert env.render() == obs
    # case and spacing are normalised before matching
    obs, *_, info3 = env.step("  Go to  Fridge 1 ")
    assert obs.startswith("You arrive at fridge 1") and info3["invalid_action"] is False
    env.close()


def test_seed_reproduces_episode(data_dir: Path) -> None:
    env = ALFWorldEnv(data_dir=data_dir)

    def run(seed: int) -> list[str]:
        obs, info = env.reset(seed=seed)
        out = [obs]
        for _ in range(3):
            action = info["admissible_actions"][int(env.np_random.integers(len(info["admissible_actions"])))]
            obs, _, _, _, info = env.step(action)
            out.append(obs)
        return out

    first = run(3)
    assert run(3) == first  # same instance, game reloaded from the cache
    fresh = ALFWorldEnv(data_dir=data_dir)
    assert fresh.reset(seed=3)[0] == first[0]
    firsts = {env.reset(seed=s)[0] for s in range(6)}
    assert len(firsts) == 2  # both train games get drawn across seeds
    env.close()
    fresh.close()


def test_split_selects_valid_unseen(data_dir: Path) -> None:
    env = ALFWorldEnv(data_dir=data_dir, split="eval_out_of_distribution")
    _, info = env.reset(seed=0)
    assert "apple" in info["task"] and "microwave" in info["task"]
    env.close()


def test_missing_data_dir_names_variable_and_docs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    with pytest.raises(ALFWorldDataError, match=r"ALFWORLD_DATA.*docs/environments.md#alfworld"):
        ALFWorldEnv()
    with pytest.raises(ALFWorldDataError, match="ALFWORLD_DATA"):
        ALFWorldEnv(data_dir=tmp_path / "nope")
    with pytest.raises(ALFWorldDataError, match="no solvable ALFWorld games"):
        ALFWorldEnv(data_dir=tmp_path)


def test_registered_id_reads_env_var(monkeypatch: pytest.MonkeyPatch, data_dir: Path) -> None:
    monkeypatch.setenv("ALFWORLD_DATA", str(data_dir))
    env = gym.make("crl/ALFWorld-v0")
    obs, info = env.reset(seed=0)
    assert "apple" in info["task"] or "mug" in info["task"]
    env.close()
