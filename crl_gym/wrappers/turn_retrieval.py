"""Per-turn retrieval: before each step of a guided episode, an entry found for the current
observation is shown with it (the authors' ``turn_based`` / ``both`` integration; the paper
retrieves at episode start only, which stays the default).

:class:`TurnRetrieval` is the part of :class:`~crl_gym.wrappers.ExperienceWrapper` that does it:
one ``client.search`` per guided turn with the observation as query (through the client's
manager, whose batcher puts concurrent envs' searches into one embedding pass and one index
search), the entry placed in front of the observation by ``TURN_OBSERVATION_TEMPLATE`` (the user
message the actor reads for that turn; the system prompt is the trainer's and is not touched),
and a :class:`~crl_gym.protocol.TurnGuidance` per shown entry, which the episode's request
carries in ``turn_experience`` so that the service credits each entry once per episode it guided.

>>> from crl_gym.clients import LocalClient
>>> from crl_gym.experience.bank import ExperienceBank
>>> from crl_gym.experience.embedders import HashingEmbedder
>>> from crl_gym.experience.manager import ExperienceManager
>>> emb = HashingEmbedder(64); bank = ExperienceBank(None, dim=64)
>>> _ = bank.add("Walk east.", emb.encode(["Walk east."])[0])
>>> manager = ExperienceManager(bank, emb)
>>> turns = TurnRetrieval(LocalClient(manager))
>>> obs, error = turns.show("You are in a corridor.", turn=2)
>>> obs.splitlines()[1], [(g.turn, g.entry.text) for g in turns.guidance], error
('Walk east.', [(2, 'Walk east.')], None)
>>> manager.close()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from crl_gym.protocol import ExperienceRef, TurnGuidance
from crl_gym.templates import TURN_OBSERVATION_TEMPLATE
from crl_gym.wrappers.text_actions import NotTextError, check_template, to_text

if TYPE_CHECKING:
    from crl_gym.clients import ExperienceClient

Retrieve = Literal["episode", "turn", "both"]
RETRIEVE_MODES: tuple[str, ...] = ("episode", "turn", "both")
"""When a guided episode retrieves: at its start (the paper), before every turn, or both."""


def check_retrieve(mode: object) -> str:
    """``mode`` if it is one of :data:`RETRIEVE_MODES`, else a ``ValueError`` naming them."""
    if mode not in RETRIEVE_MODES:
        raise ValueError(f"retrieve must be one of {RETRIEVE_MODES}, got {mode!r}")
    return str(mode)


def searches_at_start(mode: str) -> bool:
    """Whether a guided episode searches for its task at reset (``episode`` and ``both``)."""
    return mode != "turn"


def searches_per_turn(mode: str) -> bool:
    """Whether a guided episode searches before every turn (``turn`` and ``both``)."""
    return mode != "episode"


def episode_entries(
    client: ExperienceClient, query: str, k: int
) -> tuple[ExperienceRef | None, list[ExperienceRef]]:
    """The ``k`` entries of a guided episode's start (the authors' ``memory_fetch_num``): one
    ``search_many`` of ``k`` copies of ``query``, which the manager re-ranks one after another (each
    sees the ones before as retrieved, so diversification spreads them), distinct by id. Returns the
    first and the others (fewer than ``k - 1`` when the bank has fewer distinct answers)."""
    if k == 1:
        return client.search(query), []
    found: dict[int, ExperienceRef] = {}
    for ref in client.search_many([query] * k):
        if ref is not None:
            found.setdefault(ref.id, ref)
    refs = list(found.values())
    return (refs[0] if refs else None), refs[1:]


class TurnRetrieval:
    """The per-turn searches of one env copy (one episode at a time: :meth:`start` clears it)."""

    def __init__(
        self,
        client: ExperienceClient,
        template: str = TURN_OBSERVATION_TEMPLATE,
        fit_entry: Callable[[str], str] | None = None,
    ) -> None:
        self.client = client
        self.fit_entry: Callable[[str], str] = fit_entry if fit_entry is not None else str
        """Fits an entry's text to the observation space (the observation itself is
        never fitted)."""
        self.template = check_template(
            template, "turn_template", ("experience", "observation"), ("experience", "observation")
        )
        self.guidance: list[TurnGuidance] = []
        """Entries shown in the open episode, one per guided turn that found one."""
        self.searches = 0
        """Per-turn searches made by this env copy (all episodes)."""
        self.pending: tuple[str, int] | None = None
        """A deferred turn's (query, turn), until :meth:`complete` (the caller searched)."""

    def start(self) -> None:
        """A new episode: forget the last one's entries."""
        if self.guidance:
            self.guidance = []
        self.pending = None

    def defer(self, observation: object, turn: int) -> str | None:
        """Keep ``observation`` as the turn's query for a caller that searches for many envs at once
        (one ``search_many``); returns the query, or None when it has no text form."""
        try:
            query = observation if type(observation) is str else to_text(observation)
        except NotTextError:
            return None
        self.pending = (query, turn)
        return query

    def complete(self, entry: ExperienceRef | None) -> tuple[str, bool]:
        """The deferred turn's observation with ``entry`` (the caller's search result) in front of
        it; ``(observation, whether an entry was placed)``."""
        if self.pending is None:
            raise RuntimeError(
                "no deferred turn: the last step did not ask for a turn search (info['turn_query'])"
            )
        (query, turn), self.pending = self.pending, None
        self.searches += 1
        if entry is None:
            return query, False
        self.guidance.append(TurnGuidance(turn, entry))
        return self.template.format(experience=self.fit_entry(entry.text), observation=query), True

    def show(
        self, observation: object, turn: int, display: str | None = None
    ) -> tuple[object, str | None]:
        """Search with ``observation`` and put the entry found in front of it (in front of
        ``display`` instead, when given: the first observation of ``both`` already carries the
        episode's entry).

        Returns ``(observation to show, error)``: the observation unchanged when the bank has
        nothing, or with the error (the client is down; the turn then runs unguided) when the
        search failed. An observation with no text form is shown as it is, unsearched.
        """
        try:
            query = observation if type(observation) is str else to_text(observation)
        except NotTextError:
            return observation if display is None else display, None
        self.searches += 1
        try:
            entry = self.client.search(query)
        except Exception as exc:  # noqa: BLE001 - a down client must not cost the turn
            return (
                observation if display is None else display,
                f"turn {turn} search failed: {type(exc).__name__}: {exc}",
            )
        if entry is None:
            return observation if display is None else display, None
        self.guidance.append(TurnGuidance(turn, entry))
        return self.template.format(
            experience=self.fit_entry(entry.text), observation=query if display is None else display
        ), None

    def taken(self) -> list[TurnGuidance]:
        """The open episode's entries, handed to its request (the list is the request's from
        now on)."""
        out, self.guidance = self.guidance, []
        return out
