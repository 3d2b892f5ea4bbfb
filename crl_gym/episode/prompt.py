"""What a model reads each turn of an episode, for every training loop: the system text, and the
observation with the admissible actions as a user turn.

One format and one truncation rule: the observation is shortened to :data:`MAX_OBS_CHARS`
characters (its middle elided), then the admissible actions follow on one line that starts with
:data:`ACTIONS_LINE`, unless decoding is constrained to them (a token trie shows them instead).
Outside ``crl_gym/envs/`` (the envs' own invalid-action messages) no other module of the packages
writes that line; a reader of the prompts (``crl_train.policy.reader``) imports it from here.

>>> user_text("abcdefghij", ["north", "south"], max_obs_chars=7)
'ab … ij\\nValid actions: north, south'
>>> user_text("room", ["north"], constrained=True)
'room'
>>> system_text(constrained=True) == SYSTEM_CONSTRAINED, system_text(tools=True) == SYSTEM_TOOLS
(True, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypedDict

from crl_gym.experience.prompts import truncate_middle
from crl_gym.templates import SYSTEM_CONSTRAINED, SYSTEM_REACT, SYSTEM_TOOLS

MAX_OBS_CHARS = 4000
"""Observations are shortened to this many characters (middle elided) before a model reads them."""

ACTIONS_LINE = "\nValid actions: "
"""What separates an observation from the comma-separated admissible actions that follow it."""


class ChatMessage(TypedDict):
    """One message of a chat prompt."""

    role: Literal["system", "user", "assistant"]
    content: str


def system_text(*, constrained: bool = False, tools: bool = False) -> str:
    """The system message: :data:`SYSTEM_CONSTRAINED` for an actor constrained to the admissible
    actions, :data:`SYSTEM_TOOLS` for one that answers by calling tools (TRL's environments),
    else :data:`SYSTEM_REACT` (an answer with its action inside ``<action>...</action>``)."""
    if constrained:
        return SYSTEM_CONSTRAINED
    return SYSTEM_TOOLS if tools else SYSTEM_REACT


def user_text(
    obs: object,
    admissible: Sequence[str],
    *,
    constrained: bool = False,
    max_obs_chars: int = MAX_OBS_CHARS,
) -> str:
    """The user turn of an observation: shortened to ``max_obs_chars``, followed by the admissible
    actions unless decoding is constrained to them."""
    text = truncate_middle(obs if isinstance(obs, str) else str(obs), max_obs_chars)
    if admissible and not constrained:
        return f"{text}{ACTIONS_LINE}{', '.join(str(a) for a in admissible)}"
    return text


def listed_actions(text: str) -> list[str] | None:
    """The admissible actions :func:`user_text` listed at the end of ``text``, or None when it
    lists none.

    >>> listed_actions(user_text("room", ["north", "south"]))
    ['north', 'south']
    >>> listed_actions("room") is None
    True
    """
    if ACTIONS_LINE not in text:
        return None
    line = text.rsplit(ACTIONS_LINE, 1)[1].splitlines()[0]
    return [a.strip() for a in line.split(",") if a.strip()]


def first_messages(system: str, user: str) -> list[ChatMessage]:
    """The first prompt of an episode: the system message and the first user turn."""
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def plain_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """``messages`` as plain dicts (what a chat template's ``apply_chat_template`` takes)."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


__all__ = [
    "ACTIONS_LINE",
    "MAX_OBS_CHARS",
    "SYSTEM_CONSTRAINED",
    "SYSTEM_REACT",
    "SYSTEM_TOOLS",
    "ChatMessage",
    "first_messages",
    "listed_actions",
    "plain_messages",
    "system_text",
    "user_text",
]
