"""One episode of a text env, the same under every training loop (docs: the driver's module).

* :mod:`~crl_gym.episode.prompt`: the system text and the user turn of an observation;
* :mod:`~crl_gym.episode.answer`: the model's answer → the env's action (or a tool call);
* :mod:`~crl_gym.episode.driver`: :class:`EpisodeDriver` over :class:`EpisodeSpec`,
  :class:`Turn` and :class:`Episode`, and :func:`condition_of`.
"""

from __future__ import annotations

from crl_gym.episode.answer import ACTION_PATTERN, Answer, parse_action, read_answer
from crl_gym.episode.driver import (
    CUT_REASONS,
    Episode,
    EpisodeDriver,
    EpisodeSpec,
    Model,
    Turn,
    condition_of,
    search_entries,
    search_turns,
)
from crl_gym.episode.prompt import (
    ACTIONS_LINE,
    MAX_OBS_CHARS,
    ChatMessage,
    first_messages,
    plain_messages,
    system_text,
    user_text,
)

__all__ = [
    "ACTIONS_LINE",
    "ACTION_PATTERN",
    "CUT_REASONS",
    "MAX_OBS_CHARS",
    "Answer",
    "ChatMessage",
    "Episode",
    "EpisodeDriver",
    "EpisodeSpec",
    "Model",
    "Turn",
    "condition_of",
    "first_messages",
    "parse_action",
    "plain_messages",
    "read_answer",
    "search_entries",
    "search_turns",
    "system_text",
    "user_text",
]
