"""ALFWorld (text) through the real ``alfworld`` + ``textworld`` packages.

Each game is an ALFRED ``game.tw-pddl`` file (PDDL domain + problem + TextWorld grammar) next to
its ``traj_data.json``, as ``alfworld-download`` lays them out under ``$ALFWORLD_DATA/json_2.1.1``.
Games are loaded the way ``alfworld.agents.environment.alfred_tw_env.AlfredTWEnv`` loads them:
``textworld.envs.PddlEnv`` wrapped in ``AlfredDemangler`` (object ids such as
``Apple_bar__minus_01_dot_65...`` become ``apple 1``) and ``AlfredInfos``.

Reward follows the paper: +1 when the goal is reached, -1 when the episode ends without it
(40-turn limit). See docs/environments.md, section "ALFWorld", for getting the 1,466 / 134 split.

>>> from crl_gym.envs.alfworld import ALFWorldEnv
>>> env = ALFWorldEnv(split="train")                 # doctest: +SKIP
>>> obs, info = env.reset(seed=0)                    # doctest: +SKIP
>>> info["task"]                                     # doctest: +SKIP
'put a clean apple in fridge.'
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from crl_gym.envs.textworld_env import TextWorldEnv
from crl_gym.json_types import JSONDict

if TYPE_CHECKING:
    import textworld
    from textworld.core import Environment, GameState

log = logging.getLogger(__name__)

DATA_ENV_VAR = "ALFWORLD_DATA"
DOCS_SECTION = "docs/environments.md#alfworld"

TASK_TYPES: dict[int, str] = {
    1: "pick_and_place_simple",
    2: "look_at_obj_in_light",
    3: "pick_clean_then_place_in_recep",
    4: "pick_heat_then_place_in_recep",
    5: "pick_cool_then_place_in_recep",
    6: "pick_two_obj_and_place",
}
# The paper trains on ``train`` (3,553 games before filtering; 1,466 with the split the
# paper cites) and evaluates on ``valid_unseen`` (134 games), as alfworld's own configs do.
SPLITS: dict[str, str] = {
    "train": "train",
    "eval_in_distribution": "valid_seen",
    "valid_seen": "valid_seen",
    "eval_out_of_distribution": "valid_unseen",
    "valid_unseen": "valid_unseen",
}


class ALFWorldDataError(FileNotFoundError):
    """The ALFWorld data directory is missing or holds no playable game."""


def resolve_data_dir(data_dir: str | Path | None) -> Path:
    """``data_dir`` if given, else ``$ALFWORLD_DATA``; raise a clear error if neither exists."""
    raw = data_dir if data_dir is not None else os.environ.get(DATA_ENV_VAR)
    if not raw:
        raise ALFWorldDataError(
            f"ALFWorld needs its game files: set {DATA_ENV_VAR} (or pass data_dir=) to the "
            f"directory that alfworld-download filled. See {DOCS_SECTION}."
        )
    path = Path(raw).expanduser()
    if not path.is_dir():
        raise ALFWorldDataError(
            f"{DATA_ENV_VAR} / data_dir points to {path}, which is not a directory. See "
            f"{DOCS_SECTION}."
        )
    return path


def task_category_of(game_file: Path) -> str:
    """The ALFWorld task type of a game, from its folder's name
    (``<task type>-<object>-<...>-<scene>/<trial>/game.tw-pddl``).

    >>> task_category_of(
    ...     Path("valid_seen/pick_and_place_simple-Book-None-Desk-301/trial_T1/game.tw-pddl"))
    'pick_and_place_simple'
    """
    return game_file.parent.parent.name.split("-", 1)[0]


def collect_games(root: Path, task_types: tuple[int, ...] = tuple(TASK_TYPES)) -> list[Path]:
    """Solvable ``game.tw-pddl`` files under ``root``, with AlfredTWEnv's filters.

    Skipped, as alfworld does: movable-receptacle and sliced trials, task types not asked for,
    missing game files, and games whose ``solvable`` flag is absent or false. Skips are logged.
    """
    wanted = {TASK_TYPES[t] for t in task_types if t in TASK_TYPES}
    games: list[Path] = []
    skipped = 0
    for traj_path in sorted(root.rglob("traj_data.json")):
        trial = traj_path.parent
        game = trial / "game.tw-pddl"
        if "movable" in str(trial) or "Sliced" in str(trial) or not game.is_file():
            skipped += 1
            continue
        try:
            task_type = json.loads(traj_path.read_text())["task_type"]
            solvable = json.loads(game.read_text()).get("solvable")
        except (OSError, ValueError, KeyError) as exc:
            log.warning("skipping unreadable ALFWorld trial %s: %s", trial, exc)
            skipped += 1
            continue
        if task_type not in wanted or not solvable:
            skipped += 1
            continue
        games.append(game)
    if skipped:
        log.info("ALFWorld: %d games kept, %d skipped under %s", len(games), skipped, root)
    return games


class ALFWorldEnv(TextWorldEnv):
    """ALFWorld household tasks: reward +1 on success, -1 otherwise, 40 turns.

    Args:
        data_dir: the ALFWorld data root (defaults to ``$ALFWORLD_DATA``). Games are searched
            under ``<data_dir>/json_2.1.1/<split dir>`` if that exists, else
            ``<data_dir>/<split dir>``, else ``<data_dir>`` itself.
        split: ``train``, ``eval_in_distribution`` / ``valid_seen`` or
            ``eval_out_of_distribution`` / ``valid_unseen``.
        task_types: ALFWorld task-type ids (1-6) to keep.
        max_turns: turn limit (the paper: 40).
        expert_plan: expose the PDDL planner's plan from the current state as
            ``info["expert_plan"]``.
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        split: str = "train",
        task_types: tuple[int, ...] = tuple(TASK_TYPES),
        max_turns: int = 40,
        render_mode: str | None = None,
        expert_plan: bool = False,
        cache_size: int = 8,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
        root = resolve_data_dir(data_dir)
        search_root = root
        for candidate in (root / "json_2.1.1" / SPLITS[split], root / SPLITS[split]):
            if candidate.is_dir():
                search_root = candidate
                break
        games = collect_games(search_root, task_types)
        if not games:
            raise ALFWorldDataError(
                f"no solvable ALFWorld games (traj_data.json + game.tw-pddl) under {search_root}; "
                f"check {DATA_ENV_VAR} and run alfworld-download. See {DOCS_SECTION}."
            )
        self.data_dir = root
        self.split = split
        super().__init__(
            games,
            max_turns=max_turns,
            render_mode=render_mode,
            reward_mode="success",
            expert_plan=expert_plan,
            cache_size=cache_size,
        )

    def _request_infos(self) -> textworld.EnvInfos:
        import textworld

        return textworld.EnvInfos(
            won=True,
            admissible_commands=True,
            extras=["gamefile"],
            policy_commands=self.expert_plan,
        )

    def _load(self, path: Path) -> Environment:
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
        from textworld.envs import PddlEnv

        # shuffle=False: object numbering is fixed, so a seed reproduces an episode exactly
        env = AlfredInfos(AlfredDemangler(PddlEnv(self._request_infos()), shuffle=False))
        env.load(str(path))
        return env

    def _task_of(self, state: GameState, first_obs: str) -> str:
        marker = "Your task is to:"
        if marker in first_obs:
            return first_obs.split(marker, 1)[1].strip()
        return first_obs

    def _info(self) -> JSONDict:
        info = super()._info()
        if self.game_file is not None:
            info["task_category"] = task_category_of(Path(self.game_file))
        return info

    def _terminal_reward(self, won: bool, ended: bool) -> float:
        # the +1 of a win is already given by the base class; a failure costs -1 (paper)
        return 0.0 if won else -1.0

    def admissible_actions(self) -> list[str]:
        # "help" is a meta command of the grammar, not an action in the paper's setting
        return [a for a in super().admissible_actions() if a != "help"]
