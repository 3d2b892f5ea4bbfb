"""Any TextWorld game (``.z8`` / ``.ulx`` / ``.json`` / ``.tw-pddl``) as a ``crl/`` text env.

The game runs through the real ``textworld`` package; the admissible commands come from
``textworld.EnvInfos(admissible_commands=True)`` and are exposed as ``info["admissible_actions"]``.
A command outside that list is an invalid turn: the game is not stepped, the observation says so
and lists the valid commands. :class:`crl_gym.envs.alfworld.ALFWorldEnv` builds on this class.

Usage (needs game files, so the example is not run here):

>>> from crl_gym.envs.textworld_env import TextWorldEnv
>>> env = TextWorldEnv("games/")                     # doctest: +SKIP
>>> obs, info = env.reset(seed=0)                    # doctest: +SKIP
>>> obs, r, term, trunc, info = env.step(info["admissible_actions"][0])  # doctest: +SKIP
"""

from __future__ import annotations

import re
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from crl_gym.envs.base import MAX_TEXT, TextEnv, to_charset
from crl_gym.envs.registry import TEXTWORLD_USAGE, MissingEnvArgumentError
from crl_gym.json_types import EnvInfo, EnvOptions, JSONDict

if TYPE_CHECKING:
    import textworld
    from textworld.core import Environment, GameState

GAME_SUFFIXES: tuple[str, ...] = (".z8", ".ulx", ".json", ".tw-pddl")
RewardMode = Literal["success", "score"]

_PROMPT_LINE = re.compile(r"^\s*>.*$", re.MULTILINE)
_BLANKS = re.compile(r"\n{3,}")


def clean_feedback(text: str) -> str:
    """Drop the interpreter's ``>`` prompt lines and runs of blank lines; keep the content.

    >>> clean_feedback("\\nYou take the pen.\\n\\n\\n\\n>   ")
    'You take the pen.'
    """
    text = _PROMPT_LINE.sub("", text or "")
    text = "\n".join(line.rstrip() for line in text.splitlines())
    return _BLANKS.sub("\n\n", text).strip()


def find_games(source: str | Path | Sequence[str | Path]) -> list[Path]:
    """Resolve a game file, a directory (searched recursively) or a list of either, sorted."""
    items = [source] if isinstance(source, (str, Path)) else list(source)
    games: list[Path] = []
    for item in items:
        path = Path(item).expanduser()
        if path.is_dir():
            found = [p for p in path.rglob("*") if p.suffix in GAME_SUFFIXES and p.is_file()]
            # a tw-make output dir holds game.z8 *and* game.json: keep the playable file only
            playable = {p.with_suffix("") for p in found if p.suffix in (".z8", ".ulx")}
            games += [
                p for p in found if not (p.suffix == ".json" and p.with_suffix("") in playable)
            ]
        elif path.is_file():
            games.append(path)
        else:
            raise FileNotFoundError(f"TextWorld game file or directory not found: {path}")
    if not games:
        raise FileNotFoundError(f"no TextWorld games ({', '.join(GAME_SUFFIXES)}) under {items}")
    return sorted(set(games))


class TextWorldEnv(TextEnv):
    """A TextWorld game (or a pool of games) as a Gymnasium text env.

    Args:
        game_files: one game file, a directory searched recursively, or a list of either
            (required: without it the error says what to pass).
            ``reset`` picks one per episode with the env's seeded RNG (or ``options={"game": i}``).
        max_turns: turn limit; the episode is truncated after that many turns.
        reward_mode: ``"success"`` gives 1 on a win and 0 otherwise; ``"score"`` gives the
            game's score change each turn.
        expert_plan: also compute the game's walkthrough from the current state each turn
            (``info["expert_plan"]``; costs a planner call per turn).
        cache_size: how many loaded games to keep (loading a game costs 0.1-1 s).
    """

    def __init__(
        self,
        game_files: str | Path | Sequence[str | Path] | None = None,
        max_turns: int = 50,
        render_mode: str | None = None,
        reward_mode: RewardMode = "success",
        expert_plan: bool = False,
        cache_size: int = 4,
    ) -> None:
        if game_files is None:
            raise MissingEnvArgumentError(f"{type(self).__name__} needs {TEXTWORLD_USAGE}")
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        if reward_mode not in ("success", "score"):
            raise ValueError(f"reward_mode must be 'success' or 'score', got {reward_mode!r}")
        self.game_files = find_games(game_files)
        self.reward_mode = reward_mode
        self.expert_plan = expert_plan
        self.cache_size = max(1, cache_size)
        self._games: OrderedDict[Path, Any] = OrderedDict()
        self._game: Any = None
        self._state: Any = None
        self.game_file: Path | None = None
        self.task = ""
        self._done = True
        self._won = False
        self._invalid = False
        self._view = ""

    # -- hooks for subclasses -------------------------------------------------------------
    def _request_infos(self) -> textworld.EnvInfos:
        import textworld

        return textworld.EnvInfos(
            admissible_commands=True,
            won=True,
            lost=True,
            score=True,
            max_score=True,
            objective=True,
            policy_commands=self.expert_plan,
        )

    def _load(self, path: Path) -> Environment:
        """Return a textworld ``Environment`` with ``path`` loaded."""
        import textworld

        with warnings.catch_warnings():
            # jericho warns that it cannot diff TextWorld's z-machine games; textworld tracks
            # score and state itself, so the warning is noise
            warnings.filterwarnings("ignore", message=".*is not fully supported.*")
            return textworld.start(str(path), request_infos=self._request_infos())

    def _task_of(self, state: GameState, first_obs: str) -> str:
        return clean_feedback(str(state.get("objective") or "")) or first_obs

    def _terminal_reward(self, won: bool, ended: bool) -> float:
        """Reward added when the episode ends (by win, loss or turn limit)."""
        return 0.0

    # -- gym API -------------------------------------------------------------------------
    def _get_game(self, path: Path) -> Environment:
        if path in self._games:
            self._games.move_to_end(path)
            return self._games[path]
        game = self._load(path)
        self._games[path] = game
        while len(self._games) > self.cache_size:
            _, old = self._games.popitem(last=False)
            old.close()
        return game

    def _pick(self, options: EnvOptions | None) -> Path:
        choice = (options or {}).get("game")
        if choice is None:
            return self.game_files[int(self.np_random.integers(len(self.game_files)))]
        if isinstance(choice, int):
            return self.game_files[choice % len(self.game_files)]
        return Path(choice)

    def reset(
        self, *, seed: int | None = None, options: EnvOptions | None = None
    ) -> tuple[str, EnvInfo]:
        super().reset(seed=seed)
        self.game_file = self._pick(options)
        self._game = self._get_game(self.game_file)
        self._state = self._game.reset()
        self.turn = 0
        self._done = False
        self._won = False
        obs = clean_feedback(str(self._state.feedback))
        self.task = self._task_of(self._state, obs)
        self._view, self._invalid = obs, False
        return self._emit(obs), self._info()

    def admissible_actions(self) -> list[str]:
        if self._state is None:
            return []
        return list(self._state.get("admissible_commands") or [])

    def step(self, action: str) -> tuple[str, float, bool, bool, EnvInfo]:
        if self._state is None:
            raise RuntimeError("call reset() before step()")
        if self._done:
            return self._emit("The episode is over; call reset()."), 0.0, True, False, self._info()
        self.turn += 1
        command = " ".join(str(action).strip().lower().split())
        valid = self.admissible_actions()
        reward = 0.0
        self._invalid = command not in valid
        if self._invalid:
            # the game is not stepped; the agent sees the valid commands and the last view again
            obs = self.invalid_action_observation(action, valid) + "\n\n" + self._view
            terminated = False
        else:
            before = float(self._state.get("score") or 0)
            self._state, _, done = self._game.step(command)
            obs = clean_feedback(str(self._state.feedback)) or "Nothing happens."
            self._view = obs
            self._won = bool(self._state.get("won"))
            terminated = bool(done or self._won or self._state.get("lost"))
            if self.reward_mode == "score":
                reward = float(self._state.get("score") or 0) - before
            elif self._won:
                reward = 1.0
        truncated = not terminated and self.turn >= self.max_turns
        if terminated or truncated:
            self._done = True
            reward += self._terminal_reward(self._won, True)
        return self._emit(obs), reward, terminated, truncated, self._info()

    def _emit(self, obs: str) -> str:
        self._last_obs = to_charset(obs)[:MAX_TEXT]
        return self._last_obs

    def _info(self) -> JSONDict:
        info: EnvInfo = {
            "task": self.task,
            "admissible_actions": self.admissible_actions(),
            "turn": self.turn,
            "success": self._won,
            "invalid_action": self._invalid,
            "game_file": str(self.game_file),
        }
        if self._state is not None:
            info["score"] = self._state.get("score")
            info["max_score"] = self._state.get("max_score")
            if self.expert_plan:
                info["expert_plan"] = list(self._state.get("policy_commands") or [])
        return info

    def close(self) -> None:
        for game in self._games.values():
            game.close()
        self._games.clear()
        self._state = None
