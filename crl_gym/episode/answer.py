"""How a model's answer becomes the env's action, for every training loop: one parser, one rule
for an answer it cannot read.

* A constrained actor's answer is the action itself (a token trie kept it admissible).
* Otherwise the action is the text inside the answer's last ``<action>...</action>``; reasoning
  inside ``<think>...</think>`` is ignored when the answer closes it.
* **Unreadable answers** (no tag): the whole answer, stripped, goes to the env as the action (the
  env's invalid-action message tells the model), and the answer counts as unreadable
  (:attr:`Answer.readable` False; :class:`~crl_gym.episode.driver.EpisodeDriver` counts them).
* An action that is a ``search_and_ask[...]`` call (or a cut-off one) is a tool call: the
  ``SearchAndAskWrapper`` answers it without stepping the env.

>>> read_answer("I should go up. <action>north</action>")
Answer(action='north', readable=True, tool_call=False)
>>> read_answer(" east ")
Answer(action='east', readable=False, tool_call=False)
>>> read_answer("<action>search_and_ask[where is the key?]</action>").tool_call
True
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from crl_gym.wrappers.search_and_ask import first_query, is_malformed_call

ACTION_PATTERN = r"<action>(.*?)</action>"
"""Default ReAct action tag: the action is the text inside the last ``<action>…</action>``."""


def parse_action(text: str, pattern: str = ACTION_PATTERN) -> str | None:
    """The stripped content of the last match of ``pattern`` (group 1, else the whole match).

    Reasoning inside ``<think>…</think>`` is ignored when the text closes it, so a thinking
    model's drafts do not count as its action. Returns None when nothing matches.

    >>> parse_action("<think>maybe <action>west</action></think> <action> east </action>")
    'east'
    >>> parse_action("no tags") is None
    True
    """
    try:
        regex = re.compile(pattern, re.DOTALL)
    except re.error as exc:
        raise ValueError(f"parse_action: invalid pattern {pattern!r}: {exc}") from exc
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    matches = list(regex.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    return (last.group(1) if regex.groups else last.group(0)).strip()


@dataclass(frozen=True)
class Answer:
    """What one answer of the model asks for."""

    action: str
    """The text the env (or its ``search_and_ask`` wrapper) is stepped with."""
    readable: bool
    """False when the answer had no action tag and was passed on whole."""
    tool_call: bool
    """True when the action is a ``search_and_ask`` call (cut off or not)."""


def read_answer(text: str, *, constrained: bool = False) -> Answer:
    """The action an answer asks for (module docstring); ``constrained``: the answer is the
    action."""
    found = None if constrained else parse_action(text)
    action = text.strip() if found is None else found
    tool = first_query(action) is not None or is_malformed_call(action)
    return Answer(action=action, readable=constrained or found is not None, tool_call=tool)


__all__ = ["ACTION_PATTERN", "Answer", "parse_action", "read_answer"]
