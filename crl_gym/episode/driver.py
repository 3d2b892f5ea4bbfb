"""One episode of a text env, the same in every training loop: :class:`EpisodeDriver`.

The driver owns what an episode is; a loop (our runner, OpenRLHF's executor, TRL's environments,
verl's agent loop) only translates between its library and the driver:

* **the condition** of each copy of a group (:func:`condition_of`) and the reset options that
  carry it, the rollout step and the request's ``meta`` to the env's ``ExperienceWrapper``
  (:class:`EpisodeSpec`);
* **retrieval at reset** (the wrapper's search, or an entry the loop fetched for many episodes at
  once: ``EpisodeSpec.prefetched``) and **per turn** when the wrapper retrieves per turn (a loop
  that batches the turns' searches calls :func:`search_turns` once for all its drivers);
* **the prompt**: :func:`~crl_gym.episode.prompt.system_text` and
  :func:`~crl_gym.episode.prompt.user_text` (one format, one truncation rule);
* **the answer**: :func:`~crl_gym.episode.answer.read_answer` (one parser; unreadable answers
  counted in :attr:`Episode.unreadable`);
* **the end**: the env ends the episode (the wrapper submits its distillation request), the turn
  cap or the loop cuts it (:meth:`EpisodeDriver.cut`: the wrapper's ``end_episode`` submits the
  request as a failure, with the reason in its ``meta``), or the env raises
  (:meth:`EpisodeDriver.fail`: no request; the episode is a failure that is never trained on).

A loop that generates one episode at a time calls :meth:`EpisodeDriver.run` with a
:class:`Model`; one that batches generations over many episodes calls :meth:`~EpisodeDriver.reset`,
:meth:`~EpisodeDriver.act` and :meth:`~EpisodeDriver.observe` itself.

>>> from crl_gym.wrappers.examples import CorridorEnv
>>> driver = EpisodeDriver(CorridorEnv(length=2), max_turns=5)
>>> print(driver.reset(EpisodeSpec("corridor", seed=0)))
You are at cell 0 of a corridor; the exit is at cell 2, to the east.
Valid actions: east, west
>>> episode = driver.run(EpisodeSpec("corridor", seed=0), lambda messages: "<action>east</action>")
>>> [t.action for t in episode.turns], episode.success, episode.request is None
(['east', 'east'], True, True)
>>> [condition_of(c, 4) for c in range(6)], condition_of(0, 4, guided=False)
(['guided', 'guided', 'free', 'free', 'guided', 'guided'], 'free')
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import gymnasium as gym

from crl_gym.episode.answer import Answer, read_answer
from crl_gym.episode.prompt import (
    MAX_OBS_CHARS,
    ChatMessage,
    first_messages,
    system_text,
    user_text,
)
from crl_gym.protocol import (
    FREE_CONDITION,
    GROUP_COPY,
    GROUP_SIZE,
    GUIDED_CONDITION,
    Condition,
    DistillationRequest,
    ExperienceRef,
    TurnGuidance,
)
from crl_gym.wrappers.experience import ExperienceWrapper
from crl_gym.wrappers.success import ended_success

if TYPE_CHECKING:
    from crl_gym.clients import ExperienceClient

log = logging.getLogger(__name__)

CUT_REASONS: tuple[str, ...] = ("turn_cap", "context_truncated")
"""Why a loop ends an episode its env did not: the turn cap, or a next turn that would not fit."""

StepKind = Literal["env", "search_and_ask"]


def condition_of(copy: int, group_size: int, *, guided: bool = True) -> Condition:
    """The condition of copy ``copy`` (counted from 0; ``copy mod group_size`` is its place in its
    group): guided for the first ``group_size // 2`` copies of each group when ``guided``, else
    free."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return GUIDED_CONDITION if guided and copy % group_size < group_size // 2 else FREE_CONDITION


class Model(Protocol):
    """A ``generate``-like callable: the chat so far (system, user, assistant, ...) → the answer."""

    def __call__(self, messages: Sequence[ChatMessage], /) -> str: ...


@dataclass(frozen=True)
class EpisodeSpec:
    """Which episode to play.

    ``copy`` / ``group_size``: the episode's place in its rollout group, when the loop knows it
    (its request's ``meta`` then carries them: per-group distillation). ``meta``: more for the
    request's ``meta`` (the gate's verdict). ``searched``: the loop retrieved the episode's entry
    itself (``prefetched``, None when the bank had none), so the wrapper does not search.
    """

    env_id: str
    seed: int | None
    condition: Condition = FREE_CONDITION
    rollout_step: int | None = None
    copy: int | None = None
    group_size: int | None = None
    meta: Mapping[str, object] = field(default_factory=dict)
    prefetched: ExperienceRef | None = None
    searched: bool = False

    def request_meta(self) -> dict[str, object]:
        """What the episode's request carries in ``meta`` besides the env's own."""
        place: dict[str, object] = {}
        if self.copy is not None and self.group_size is not None:
            place = {GROUP_COPY: self.copy, GROUP_SIZE: self.group_size}
        return {**place, **self.meta}

    def reset_options(self) -> dict[str, object]:
        """The reset options of an ``ExperienceWrapper`` for this episode."""
        options: dict[str, object] = {
            "experience": self.condition,
            "rollout_step": self.rollout_step,
            "meta": self.request_meta(),
        }
        if self.searched:
            options["prefetched"] = self.prefetched
        return options


@dataclass
class Turn:
    """One answer of the model and what the env made of it."""

    index: int
    """The turn's number, from 1."""
    answer: str
    action: str
    kind: StepKind
    reward: float
    readable: bool


@dataclass
class Episode:
    """An episode as the driver played it."""

    spec: EpisodeSpec
    system: str
    first: str = ""
    """The first user turn (the observation, the entry of a guided episode, the actions)."""
    task: str = ""
    admissible: list[str] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    success: bool = False
    done: bool = False
    cut: str | None = None
    """``"turn_cap"`` / ``"context_truncated"`` when the episode was cut, else None."""
    error: str | None = None
    """``"reset: ..."`` / ``"step: ..."`` when the env raised (the episode is never trained on)."""
    experience: ExperienceRef | None = None
    turn_experience: list[TurnGuidance] = field(default_factory=list)
    request: DistillationRequest | None = None
    unreadable: int = 0
    """Answers without an action tag (passed on whole: :mod:`crl_gym.episode.answer`)."""
    last_info: Mapping[str, object] = field(default_factory=dict)

    @property
    def ret(self) -> float:
        """The sum of the env's rewards."""
        return float(sum(self.rewards))

    @property
    def condition(self) -> Condition:
        """The condition the episode ran: its request's (a guided episode whose search failed ran
        free), else the spec's."""
        return self.request.condition if self.request is not None else self.spec.condition

    @property
    def search_calls(self) -> int:
        return sum(t.kind == "search_and_ask" for t in self.turns)

    @property
    def num_actions(self) -> int:
        return sum(t.kind == "env" for t in self.turns)

    def messages(self) -> list[ChatMessage]:
        """The episode's first prompt."""
        return first_messages(self.system, self.first)


def _experience_wrapper(env: gym.Env) -> ExperienceWrapper | None:
    """The ``ExperienceWrapper`` in ``env``'s wrapper chain, if any."""
    while True:
        if isinstance(env, ExperienceWrapper):
            return env
        inner = getattr(env, "env", None)
        if not isinstance(inner, gym.Env):
            return None
        env = inner


class EpisodeDriver:
    """Plays episodes of one (wrapped) text env (module docstring).

    Args:
        env: a Gymnasium text env; under ``ExperienceWrapper`` when the run uses experience.
        constrained: the model's decoding is constrained to the admissible actions (the actions
            line is left out, the answer is the action).
        tools: the model answers by calling tools (TRL): the system text says so.
        max_turns: turns before the episode is cut (``turn_cap``); None: the env decides.
        max_obs_chars: the truncation of each observation.
    """

    def __init__(
        self,
        env: gym.Env,
        *,
        constrained: bool = False,
        tools: bool = False,
        max_turns: int | None = None,
        max_obs_chars: int = MAX_OBS_CHARS,
    ) -> None:
        if max_turns is not None and max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.env = env
        self.wrapper = _experience_wrapper(env)
        self.constrained = constrained
        self.system = system_text(constrained=constrained, tools=tools)
        self.max_turns = max_turns
        self.max_obs_chars = max_obs_chars
        self.episode: Episode | None = None
        self.turn_query: str | None = None
        """The query of a turn whose search the wrapper left to the loop (``defer_turn_search``)."""
        self._obs: object = ""
        self._info: dict[str, object] = {}

    # ------------------------------------------------------------------ start
    def reset(self, spec: EpisodeSpec) -> str:
        """Start ``spec``'s episode; returns the first user turn. An env that raises ends the
        episode (:meth:`fail`) and the exception propagates (the loop decides what it costs)."""
        episode = self.episode = Episode(spec, self.system)
        self.turn_query = None
        options = spec.reset_options() if self.wrapper is not None else None
        try:
            obs, info = self.env.reset(seed=spec.seed, options=options)
        except Exception as exc:
            self.fail("reset", exc)
            raise
        episode.task = str(info.get("task") or obs)
        episode.admissible = [str(a) for a in info.get("admissible_actions") or ()]
        shown = info.get("experience")
        episode.experience = ExperienceRef.from_dict(shown) if isinstance(shown, dict) else None
        for more in info.get("experience_more") or ():  # entries_per_episode > 1
            entry = ExperienceRef.from_dict(more)
            if entry is not None:
                episode.turn_experience.append(TurnGuidance(0, entry))
        self._note_turn_entry(info, 0)
        self._obs, self._info = obs, info
        episode.first = self._user_text(obs)
        return episode.first

    def messages(self) -> list[ChatMessage]:
        """The open episode's first prompt (system text and first user turn)."""
        return self._open().messages()

    @property
    def observation(self) -> str:
        """The latest observation, shortened as a user turn shows it, without the actions line
        (what a loop shows after the episode ended)."""
        return user_text(self._obs, (), max_obs_chars=self.max_obs_chars)

    # ------------------------------------------------------------------ turns
    def act(self, answer: str | Answer) -> Turn:
        """Step the env with the action ``answer`` asks for (an :class:`Answer` is taken as it is:
        a loop whose library parsed the answer, TRL's tool call). The episode ends when the env
        ends it or the turn cap is reached; an env that raises ends it (:meth:`fail`) and the
        exception propagates."""
        episode = self._open()
        if episode.done:
            raise RuntimeError("act: the episode is over")
        read = (
            answer
            if isinstance(answer, Answer)
            else read_answer(answer, constrained=self.constrained)
        )
        episode.unreadable += not read.readable
        try:
            obs, reward, terminated, truncated, info = self.env.step(read.action)
        except Exception as exc:
            self.fail("step", exc)
            raise
        kind: StepKind = "search_and_ask" if info.get("search_and_ask") is not None else "env"
        text = answer.action if isinstance(answer, Answer) else answer
        turn = Turn(len(episode.turns) + 1, text, read.action, kind, float(reward), read.readable)
        episode.turns.append(turn)
        episode.rewards.append(float(reward))
        episode.admissible = [str(a) for a in info.get("admissible_actions") or episode.admissible]
        episode.last_info = info
        self._obs, self._info = obs, info
        if terminated or truncated:
            episode.done = True
            request = info.get("distillation_request")
            episode.request = request if isinstance(request, DistillationRequest) else None
            episode.success = ended_success(info, episode.rewards, episode.spec.env_id)
            self._note_turn_entry(info, turn.index)
            return turn
        if self.max_turns is not None and turn.index >= self.max_turns:
            self._note_turn_entry(info, turn.index)
            self.cut("turn_cap")
            return turn
        query = info.get("turn_query")
        self.turn_query = query if isinstance(query, str) else None
        if self.turn_query is None:
            self._note_turn_entry(info, turn.index)
        return turn

    def show_turn_entry(self, entry: ExperienceRef | None) -> None:
        """The loop's search result for :attr:`turn_query` (None: nothing found or the search
        failed): the wrapper puts it in front of the observation."""
        if self.turn_query is None:
            raise RuntimeError("show_turn_entry: no turn waits for its search")
        show = self.env.get_wrapper_attr("show_turn_entry")
        self._obs = show(entry, self._info)
        self.turn_query = None
        self._note_turn_entry(self._info, len(self._open().turns))

    def observe(self) -> str | None:
        """The next user turn, or None when the episode is over."""
        episode = self._open()
        if episode.done:
            return None
        if self.turn_query is not None:
            raise RuntimeError("observe: the turn's search is still open (show_turn_entry)")
        return self._user_text(self._obs)

    def step(self, answer: str | Answer) -> str | None:
        """:meth:`act` then :meth:`observe` (a deferred turn search is done here, alone)."""
        self.act(answer)
        if self.turn_query is not None:
            self.show_turn_entry(_search_one(self.wrapper, self.turn_query))
        return self.observe()

    # ------------------------------------------------------------------ ends
    def cut(self, reason: str) -> DistillationRequest | None:
        """End the open episode here as a failure (``reason``: one of :data:`CUT_REASONS`): the
        wrapper submits its request with ``meta[reason] = True``. No-op on an ended episode."""
        if reason not in CUT_REASONS:
            raise ValueError(f"a cut's reason is one of {CUT_REASONS}, got {reason!r}")
        episode = self._open()
        if episode.done:
            return episode.request
        episode.done, episode.success, episode.cut = True, False, reason
        self.turn_query = None
        if self.wrapper is not None:
            episode.request = self.wrapper.end_episode(meta={reason: True}, success=False)
        return episode.request

    def fail(self, where: str, exc: BaseException) -> None:
        """End the open episode because the env raised in ``where``: a failure, no request (the
        loop logs it, with what it costs there)."""
        episode = self._open()
        episode.error = f"{where}: {type(exc).__name__}: {exc}"
        episode.done, episode.success = True, False
        self.turn_query = None
        log.debug(
            "episode env=%s seed=%s %s: %s failed and ends as a failure: %s",
            episode.spec.env_id,
            episode.spec.seed,
            episode.spec.condition,
            where,
            exc,
        )

    def end(self) -> DistillationRequest | None:
        """End an episode the loop stopped without a reason of :data:`CUT_REASONS` (TRL: the model
        stopped calling the action tool): the wrapper submits its request as at a truncation."""
        episode = self._open()
        if not episode.done:
            episode.done = True
            if self.wrapper is not None:
                episode.request = self.wrapper.end_episode()
        return episode.request

    # ------------------------------------------------------------------ whole episodes
    def run(self, spec: EpisodeSpec, model: Model) -> Episode:
        """Play ``spec``'s episode with ``model``; an env error ends it as a failure (not
        raised)."""
        try:
            messages = list(first_messages(self.system, self.reset(spec)))
        except Exception:  # noqa: BLE001 - recorded in episode.error
            return self._open()
        while True:
            answer = model(list(messages))
            try:
                shown = self.step(answer)
            except Exception:  # noqa: BLE001 - recorded in episode.error
                break
            if shown is None:
                break
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": shown},
            ]
        return self._open()

    # ------------------------------------------------------------------ internals
    def _open(self) -> Episode:
        if self.episode is None:
            raise RuntimeError("no episode: call reset first")
        return self.episode

    def _user_text(self, obs: object) -> str:
        return user_text(
            obs,
            self._open().admissible,
            constrained=self.constrained,
            max_obs_chars=self.max_obs_chars,
        )

    def _note_turn_entry(self, info: Mapping[str, object], turn: int) -> None:
        """Keep the entry per-turn retrieval showed with this turn's observation."""
        shown = info.get("turn_experience")
        entry = ExperienceRef.from_dict(shown) if isinstance(shown, dict) else None
        if entry is not None:
            self._open().turn_experience.append(TurnGuidance(turn, entry))


def _search_one(wrapper: ExperienceWrapper | None, query: str) -> ExperienceRef | None:
    if wrapper is None:
        return None
    try:
        return wrapper.client.search(query)
    except Exception as exc:  # noqa: BLE001 - a down service costs the turn its entry
        log.warning("per-turn search failed (%s); the turn runs unguided", exc)
        return None


def search_entries(
    client: ExperienceClient, queries: Sequence[str]
) -> tuple[list[ExperienceRef | None], bool]:
    """Retrieval at reset for many episodes at once (a loop that runs groups: the runner): one
    ``client.search_many``; the entries (None: nothing found) go into each guided episode's
    :class:`EpisodeSpec` (``prefetched``, ``searched=True``). A failed search is ``(all None,
    True)``: the episodes run unguided, never fail."""
    try:
        return list(client.search_many(list(queries))), False
    except Exception as exc:  # noqa: BLE001 - a down service costs guidance, not the step
        log.warning("search_many failed (%s); guided copies run without experience", exc)
        return [None] * len(queries), True


def search_turns(drivers: Sequence[EpisodeDriver], client: ExperienceClient) -> int:
    """Per-turn retrieval of every driver whose turn waits for its search, in one
    ``client.search_many``; returns 1 when that search failed (the turns run unguided), else 0."""
    asked = [d for d in drivers if d.turn_query is not None]
    if not asked:
        return 0
    failed = 0
    try:
        refs = list(client.search_many([d.turn_query or "" for d in asked]))
    except Exception as exc:  # noqa: BLE001 - a down service costs the turns their entries
        log.warning("per-turn search_many failed (%s); these turns run unguided", exc)
        refs, failed = [None] * len(asked), 1
    for driver, ref in zip(asked, refs, strict=True):
        driver.show_turn_entry(ref)
    return failed


__all__ = [
    "CUT_REASONS",
    "Episode",
    "EpisodeDriver",
    "EpisodeSpec",
    "Model",
    "Turn",
    "condition_of",
    "search_entries",
    "search_turns",
]
