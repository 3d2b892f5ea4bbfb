"""MiniHack as a text environment, on the real ``nle``/``minihack`` packages.

As in the paper (appendix C.1), every observation is a legend of the NetHack symbols in view, the
visible map trimmed to what the agent has seen, and the game message::

    Legend:
    @: you (the agent)
    .: floor of a room
    >: staircase down
    Map:
    @....
    .....
    ....>
    Message: Hello Agent, welcome to NetHack!  You are a chaotic male human Rogue.

Actions are names: ``north east south west northeast southeast southwest northwest`` and, where
the task needs them (KeyRoom), ``pick_up`` and ``apply``. Boulders (River) are pushed by walking
into them. Reward is 1.0 on reaching the staircase down, else 0.0; the episode is truncated after
``max_turns`` turns (30, as in the paper).

An invalid action costs a turn (so an agent that only writes garbage still ends its episode) but
does not step NetHack; the observation says it was invalid, lists the valid actions and repeats
the current view. Seeding: ``reset(seed=s)`` draws NetHack's core/disp seeds from the env's
``np_random`` with anti-TAS reseeding off and the moon phase fixed, so the same seed and the same
actions give the same observations.

>>> env = MiniHackEnv("Room-5x5")
>>> obs, info = env.reset(seed=0)
>>> list(info["admissible_actions"][:4])
['north', 'east', 'south', 'west']
>>> "Map:" in obs and "@" in obs
True
>>> env.close()
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from crl_gym.envs.base import TextEnv, lookup_action, to_charset
from crl_gym.json_types import EnvInfo, EnvOptions

with warnings.catch_warnings():
    # minihack imports pkg_resources, which warns on import under recent setuptools.
    warnings.simplefilter("ignore")
    import gymnasium as gym
    import minihack  # noqa: F401  (registers the MiniHack-* ids with Gymnasium)
    from nle import nethack


@dataclass(frozen=True)
class MiniHackTask:
    """One MiniHack task: the upstream id, its description for the agent, extra NLE keys."""

    env_id: str
    description: str
    extra_keys: tuple[str, ...] = ()
    """Observation keys the upstream env needs beyond ours (KeyRoom's apply reads them)."""
    show_inventory: bool = False


_GOAL = "Reach the staircase down (>)."
TASKS: dict[str, MiniHackTask] = {
    "Room-5x5": MiniHackTask(
        "MiniHack-Room-5x5-v0",
        f"You are in a 5x5 room. {_GOAL}",
    ),
    "Room-Ultimate-5x5": MiniHackTask(
        "MiniHack-Room-Ultimate-5x5-v0",
        "You are in a dark 5x5 room with hidden traps and monsters; you only see the cells around "
        f"you. Avoid the traps and monsters. {_GOAL}",
    ),
    "MazeWalk-9x9": MiniHackTask(
        "MiniHack-MazeWalk-9x9-v0",
        "You are in a dark 9x9 maze; you only see the cells around you. Find the way "
        f"through. {_GOAL}",
    ),
    "KeyRoom-Dark-S5": MiniHackTask(
        "MiniHack-KeyRoom-Dark-S5-v0",
        "You are in a dark room. Find the key ((), stand on it and pick_up, go next to the locked "
        f"door (+) and apply the key to open it, then enter the small room behind it. {_GOAL}",
        extra_keys=("inv_strs", "inv_letters", "screen_descriptions"),
        show_inventory=True,
    ),
    "River-Narrow": MiniHackTask(
        "MiniHack-River-Narrow-v0",
        "A river of water (}) blocks the way. Push a boulder (`) into the water by walking into it "
        f"to make a crossing, cross the river, then {_GOAL[0].lower()}{_GOAL[1:]}",
    ),
}

# NLE action -> our name; the order follows the upstream env's action list.
_ACTION_NAMES: dict[int, str] = {
    int(nethack.CompassDirection.N): "north",
    int(nethack.CompassDirection.E): "east",
    int(nethack.CompassDirection.S): "south",
    int(nethack.CompassDirection.W): "west",
    int(nethack.CompassDirection.NE): "northeast",
    int(nethack.CompassDirection.SE): "southeast",
    int(nethack.CompassDirection.SW): "southwest",
    int(nethack.CompassDirection.NW): "northwest",
    int(nethack.Command.PICKUP): "pick_up",
    int(nethack.Command.APPLY): "apply",
}
ALIASES: dict[str, str] = {
    "n": "north", "e": "east", "s": "south", "w": "west",
    "ne": "northeast", "se": "southeast", "sw": "southwest", "nw": "northwest",
    "north_east": "northeast", "south_east": "southeast",
    "south_west": "southwest", "north_west": "northwest",
    "pickup": "pick_up", "pick": "pick_up", "use": "apply",
}  # fmt: skip
"""Accepted spellings besides the names (case, spaces and hyphens are ignored too)."""

_BASE_KEYS = ("glyphs", "chars", "message", "blstats")
_SPACE = 32


def glyph_description(glyph: int) -> str:
    """What a NetHack glyph shows, in words (``nethack`` tables; no per-step screen text)."""
    if nethack.glyph_is_monster(glyph):
        name = nethack.permonst(nethack.glyph_to_mon(glyph)).mname
        return f"tame {name}" if nethack.glyph_is_pet(glyph) else name
    if nethack.glyph_is_statue(glyph):
        return "statue"
    if nethack.glyph_is_object(glyph):
        obj = nethack.objclass(nethack.glyph_to_obj(glyph))
        name = nethack.OBJ_NAME(obj) or nethack.OBJ_DESCR(obj) or "object"
        return str(name)
    if nethack.glyph_is_cmap(glyph) or nethack.glyph_is_trap(glyph):
        return str(nethack.symdef.from_idx(nethack.glyph_to_cmap(glyph)).explanation)
    if nethack.glyph_is_invisible(glyph):
        return "remembered, unseen monster"
    return "unknown"


class MiniHackEnv(TextEnv):
    """A MiniHack task with text observations and named actions.

    Args:
        task: one of :data:`TASKS` (``Room-5x5``, ``Room-Ultimate-5x5``, ``MazeWalk-9x9``,
            ``KeyRoom-Dark-S5``, ``River-Narrow``).
        max_turns: turns before truncation (invalid actions count).
        render_mode: ``None`` or ``"ansi"`` (returns the last observation).
        legend: include the symbol legend in observations.
        **minihack_kwargs: passed to the upstream MiniHack env (e.g. ``reward_lose``).
    """

    def __init__(
        self,
        task: str = "Room-5x5",
        max_turns: int = 30,
        render_mode: str | None = None,
        legend: bool = True,
        **minihack_kwargs: object,
    ) -> None:
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        if task not in TASKS:
            raise ValueError(f"unknown MiniHack task {task!r}; known tasks: {', '.join(TASKS)}")
        self.task_name = task
        self.spec_task = TASKS[task]
        self.legend = legend
        upstream = gym.spec(self.spec_task.env_id)
        kwargs: dict[str, Any] = {
            "observation_keys": _BASE_KEYS + self.spec_task.extra_keys,
            # Our own turn limit truncates; NetHack's is only a backstop.
            "max_episode_steps": max_turns + 10,
            # Moon phase / Friday 13th come from the seed, not the clock (reproducibility).
            "fix_moon_phase": True,
            **minihack_kwargs,
        }
        # Build the upstream class directly: gym.make's wrappers would add per-step overhead.
        entry = upstream.entry_point
        creator: Any = (
            gym.envs.registration.load_env_creator(entry) if isinstance(entry, str) else entry
        )
        self._nle: Any = creator(**{**upstream.kwargs, **kwargs})
        self._codes: list[int] = [int(a) for a in self._nle.actions]
        self.actions: list[str] = [_ACTION_NAMES[c] for c in self._codes]
        self._index: dict[str, int] = {name: i for i, name in enumerate(self.actions)}
        # One shared immutable tuple: per-step copies would be kept alive by recorders (GC cost).
        self._admissible = tuple(self.actions)
        for alias, name in ALIASES.items():
            if name in self._index:
                self._index[alias] = self._index[name]
        self._legend_cache: dict[int, str] = {}
        self._state_text = ""
        self._view = ""  # legend + map of the last live observation
        self._done = False
        self._truncated = False
        self._success = False

    # ------------------------------------------------------------------ gym API
    def reset(
        self, *, seed: int | None = None, options: EnvOptions | None = None
    ) -> tuple[str, EnvInfo]:
        super().reset(seed=seed)
        if self._nle is None:
            raise RuntimeError("MiniHackEnv is closed")
        core, disp = (int(x) for x in self.np_random.integers(0, 2**62, size=2))
        self._nle.seed(core, disp, reseed=False)
        obs, _ = self._nle.reset()
        self.turn = 0
        self._done = self._truncated = self._success = False
        self._state_text = self._render_state(obs)
        self._last_obs = self._state_text
        return self._last_obs, self._info(invalid=False)

    def step(self, action: str) -> tuple[str, float, bool, bool, EnvInfo]:
        if self._nle is None:
            raise RuntimeError("MiniHackEnv is closed")
        if self._done or self._truncated:
            # Stepping a finished episode changes nothing; the terminal result is repeated.
            return self._last_obs, 0.0, self._done, self._truncated, self._info(invalid=False)
        self.turn += 1
        index = self._parse(action)
        reward = 0.0
        if index is None:
            prefix = self.invalid_action_observation(action, self.actions) + "\n"
            self._last_obs = prefix + self._state_text
        else:
            obs, _, done, _, nle_info = self._nle.step(index)
            self._success = nle_info["end_status"] == self._nle.StepStatus.TASK_SUCCESSFUL
            reward = 1.0 if self._success else 0.0
            self._done = bool(done) or self._success
            if self._done:
                # NLE has quit the game by now and blanked its buffers: keep the last view.
                self._state_text = f"{self._view}\nMessage: {self._outcome(nle_info['end_status'])}"
            else:
                self._state_text = self._render_state(obs)
            self._last_obs = self._state_text
        self._truncated = not self._done and self.turn >= self.max_turns
        return self._last_obs, reward, self._done, self._truncated, self._info(index is None)

    def close(self) -> None:
        """Close NetHack (its temp dir and loaded library); safe to call twice."""
        if self._nle is not None:
            self._nle.close()
            self._nle = None
        super().close()

    # ------------------------------------------------------------------ helpers
    @property
    def task(self) -> str:
        """The task description given to the agent."""
        return self.spec_task.description

    def _info(self, invalid: bool) -> EnvInfo:
        return {
            "task": self.spec_task.description,
            "admissible_actions": self._admissible,
            "turn": self.turn,
            "success": self._success,
            "invalid_action": invalid,
        }

    def _parse(self, action: object) -> int | None:
        return lookup_action(self._index, action)

    def _render_state(self, obs: dict[str, np.ndarray]) -> str:
        """Legend + trimmed map + message. Only the seen part of the 21x79 map is touched."""
        chars = obs["chars"]
        seen = chars > _SPACE  # blank cells are spaces (0 only in a quit game's buffers)
        rows = np.flatnonzero(seen.any(axis=1))
        parts: list[str] = []
        if rows.size:
            r0, r1 = int(rows[0]), int(rows[-1]) + 1
            cols = np.flatnonzero(seen[r0:r1].any(axis=0))  # only the rows in use
            c0, c1 = int(cols[0]), int(cols[-1]) + 1
            sub = chars[r0:r1, c0:c1]
            flat, width = sub.tobytes().decode("latin-1"), c1 - c0  # one decode, then slices
            grid = "\n".join(flat[i : i + width].rstrip() for i in range(0, len(flat), width))
            if self.legend:
                parts.append(self._legend(obs, sub, r0, c0))
            parts.append("Map:\n" + grid)
        else:
            parts.append("Map:\n(nothing visible)")
        self._view = "\n".join(parts)
        message = obs["message"].tobytes().rstrip(b"\0").decode("latin-1").strip()
        parts.append("Message: " + (message or "(none)"))
        if self.spec_task.show_inventory:
            parts.append("Inventory: " + self._inventory())
        text = "\n".join(parts)
        return text if text.isascii() else to_charset(text)

    def _legend(self, obs: dict[str, np.ndarray], sub: np.ndarray, r0: int, c0: int) -> str:
        glyphs = obs["glyphs"][r0 : r0 + sub.shape[0], c0 : c0 + sub.shape[1]]
        x, y = int(obs["blstats"][0]), int(obs["blstats"][1])  # agent column, row
        agent_glyph = int(obs["glyphs"][y, x])
        lines: dict[str, None] = {}  # ordered set: one line per (symbol, meaning)
        # A set over the small crop is ~8x cheaper than np.unique on a masked copy.
        for glyph in sorted(set(glyphs.ravel().tolist())):
            line = self._legend_cache.get(glyph)
            if line is None:
                r, c = np.argwhere(glyphs == glyph)[0]
                symbol = chr(sub[r, c])
                # Blank cells (solid rock, unseen) need no legend line.
                line = "" if symbol == " " else f"{symbol}: {glyph_description(glyph)}"
                self._legend_cache[glyph] = line
            if glyph == agent_glyph:
                line = "@: you (the agent)"
            if line:
                lines[line] = None
        return "Legend:\n" + "\n".join(lines)

    def _outcome(self, end_status: object) -> str:
        if self._success:
            return "You reached the staircase down. Task complete!"
        if end_status == self._nle.StepStatus.DEATH:
            return "You died. The episode is over."
        return f"The game ended ({getattr(end_status, 'name', end_status)})."

    def _inventory(self) -> str:
        keys = self._nle._observation_keys
        inv = self._nle.last_observation[keys.index("inv_strs")]
        items = [line.tobytes().rstrip(b"\0").decode("latin-1") for line in inv if line[0] != 0]
        return "; ".join(items) if items else "(empty)"
