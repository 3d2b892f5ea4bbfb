"""Shared base for the project's text environments.

Every env here has a text observation and a text action, puts the task under ``info["task"]``,
the valid actions under ``info["admissible_actions"]`` where it knows them, ``info["success"]``
at the end of the episode, and ``info["turn"]`` every step. An invalid action is a turn, never
an exception: the observation says so and lists the valid actions.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any, TypeVar

import gymnasium as gym
from gymnasium import spaces

# Printable ASCII plus a few symbols NetHack/Sokoban maps use; Text spaces check the charset.
TEXT_CHARSET: frozenset[str] = frozenset(string.printable) | frozenset("·░▓█—–’‘“”…×°")
MAX_TEXT = 1 << 16
T = TypeVar("T")
MAX_ECHO = 80
"""An invalid action is echoed up to this many characters (a sampled ``Text`` action can be 64k)."""


def text_space(max_length: int = MAX_TEXT) -> spaces.Text:
    """A Gymnasium ``Text`` space wide enough for free-form observations and actions."""
    return spaces.Text(max_length=max_length, min_length=0, charset=TEXT_CHARSET)


def lookup_action(index: Mapping[str, T], action: object) -> T | None:
    """Look ``action`` up in an alias table, exactly first, then case/space/hyphen-normalised.

    >>> lookup_action({"pick_up": 7}, " Pick-Up ")
    7
    >>> lookup_action({"north": 0}, 3) is None
    True
    """
    if not isinstance(action, str):
        return None
    found = index.get(action)
    if found is None:
        found = index.get(action.strip().lower().replace(" ", "_").replace("-", "_"))
    return found


def to_charset(text: str) -> str:
    """Replace characters outside :data:`TEXT_CHARSET` so observations stay in the space."""
    return "".join(c if c in TEXT_CHARSET else "?" for c in text)


class TextEnv(gym.Env[str, str]):
    """Base class: text spaces, ``ansi`` rendering of the last observation, a turn counter."""

    metadata: dict[str, Any] = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, max_turns: int, render_mode: str | None = None) -> None:
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(
                f"render_mode must be one of {self.metadata['render_modes']}, got {render_mode!r}"
            )
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self.render_mode = render_mode
        self.observation_space = text_space()
        self.action_space = text_space()
        self.turn = 0
        self._last_obs = ""

    def render(self) -> str | None:  # type: ignore[override]
        if self.render_mode == "ansi":
            return self._last_obs
        return None

    def invalid_action_observation(self, action: object, valid: list[str], prefix: str = "") -> str:
        """The observation for an action the env cannot take; it lists the valid ones.

        The action is echoed shortened and mapped into the charset, so the observation stays
        inside the observation space whatever the agent wrote.

        >>> TextEnv(1).invalid_action_observation("jump", ["north", "south"])
        "Invalid action: 'jump'. Valid actions: north, south."
        """
        shown = action if isinstance(action, str) else repr(action)
        if len(shown) > MAX_ECHO:
            shown = shown[:MAX_ECHO] + "..."
        listing = ", ".join(valid) if valid else "(none)"
        return to_charset(f"{prefix}Invalid action: {shown!r}. Valid actions: {listing}.")
