"""One verl sample's episode as the episode driver plays it (no verl import: ``crl_agent``, in
:mod:`~crl_gym.integrations.verl.agent_loop`, keeps only verl's tokens and server calls).

:class:`VerlEpisode` translates between verl's row and chat messages and an
:class:`~crl_gym.episode.EpisodeDriver`: the row's ``extra_info`` becomes the
:class:`~crl_gym.episode.EpisodeSpec` (:func:`row_spec`), the first user turn and each next one
are the driver's, the model's reply is read by the driver, and a cut (``max_turns``, or
``rollout.response_length``) is the driver's.

>>> from crl_gym.wrappers.examples import CorridorEnv
>>> from crl_gym.integrations.verl.rows import task_rows
>>> row = task_rows([0], ["free"], env_id="corridor")[0]
>>> episode = VerlEpisode(CorridorEnv(length=2), max_turns=4)
>>> messages = episode.start(row_spec(row["extra_info"], "corridor", None), row["prompt"])
>>> [m["role"] for m in messages], messages[1]["content"].splitlines()[-1]
(['system', 'user'], 'Valid actions: east, west')
>>> previous = episode.answer("<action>east</action>")
>>> len(previous), len(episode.messages), episode.answer("<action>east</action>")
(3, 4, None)
>>> episode.played.success, episode.cut_label
(True, None)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import gymnasium as gym

from crl_gym.episode import ChatMessage, Episode, EpisodeDriver, EpisodeSpec
from crl_gym.protocol import CONDITIONS, Condition

CUT_LABELS: dict[str, str] = {"turn_cap": "turns", "context_truncated": "context"}
"""``crl_cut``'s value (verl's batch column) for each reason the driver cut an episode."""


def row_spec(extra: Mapping[str, object], env_id: str, global_steps: object) -> EpisodeSpec:
    """The episode of a row's ``extra_info``: its ``experience`` (the condition), ``seed``, and
    ``rollout_step`` = the row's ``global_steps`` (None: the service's open step), or -1 for an
    ``evaluation`` row, which the service never credits."""
    condition = str(extra.get("experience", "free"))
    if condition not in CONDITIONS:
        raise ValueError(f"extra_info.experience must be one of {CONDITIONS}, got {condition!r}")
    step = -1 if bool(extra.get("evaluation", False)) else _rollout_step(global_steps)
    seed = extra.get("seed")
    return EpisodeSpec(
        env_id, None if seed is None else _int(seed), _condition(condition), rollout_step=step
    )


class VerlEpisode:
    """The messages verl tokenises for one episode, and the driver that plays it."""

    def __init__(self, env: gym.Env, *, max_turns: int) -> None:
        self.driver = EpisodeDriver(env, max_turns=max_turns)
        self.messages: list[ChatMessage] = []

    @property
    def played(self) -> Episode:
        """The driver's episode."""
        if self.driver.episode is None:
            raise RuntimeError("the episode has not started")
        return self.driver.episode

    @property
    def cut_label(self) -> str | None:
        """``"turns"`` / ``"context"`` when the episode was cut, else None."""
        episode = self.driver.episode
        return None if episode is None or episode.cut is None else CUT_LABELS[episode.cut]

    def start(self, spec: EpisodeSpec, prompt: Sequence[Mapping[str, str]]) -> list[ChatMessage]:
        """Reset the env; the row's prompt (its system message) and the first user turn."""
        first = self.driver.reset(spec)
        self.messages = [_message(m) for m in prompt]
        self.messages.append({"role": "user", "content": first})
        return self.messages

    def answer(self, text: str) -> list[ChatMessage] | None:
        """The model's reply ``text`` steps the env. None when the episode is over; else the
        messages before the new user turn (what verl's ``ct_merge_context_msg`` compares with
        :attr:`messages`, which now end with it). An env that raises propagates (the driver
        ended the episode as a failure)."""
        shown = self.driver.step(text)
        if shown is None:
            return None
        self.messages.append({"role": "assistant", "content": text})
        previous = list(self.messages)
        self.messages.append({"role": "user", "content": shown})
        return previous

    def cut_context(self) -> None:
        """End the episode because its next turn does not fit ``rollout.response_length``."""
        self.driver.cut("context_truncated")


def _message(m: Mapping[str, str]) -> ChatMessage:
    role, content = m.get("role"), str(m.get("content", ""))
    if role == "system":
        return {"role": "system", "content": content}
    if role == "user":
        return {"role": "user", "content": content}
    if role == "assistant":
        return {"role": "assistant", "content": content}
    raise ValueError(f"raw_prompt: a message's role is system, user or assistant, got {role!r}")


def _condition(value: str) -> Condition:
    return "guided" if value == "guided" else "free"


def _int(value: object) -> int:
    item = getattr(value, "item", None)  # a numpy scalar (a parquet row's)
    plain = item() if callable(item) else value
    if isinstance(plain, bool) or not isinstance(plain, int | float | str):
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    return int(plain)


def _rollout_step(value: object) -> int | None:
    """The row's ``global_steps`` as an int; None (the service's open step) when the row has
    none."""
    return None if value is None else _int(value)


__all__ = ["CUT_LABELS", "VerlEpisode", "row_spec"]
