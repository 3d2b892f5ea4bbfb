"""The runner's episode: the driver's episode (:class:`crl_gym.episode.Episode`) with the tokens
the actor trains on. Its own module, so that :mod:`crl_train.rollout.contract` (which reads it)
and :mod:`crl_train.rollout.runner` (which builds it) do not import each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from crl_gym.json_types import EnvInfo
from crl_gym.protocol import Condition, DistillationRequest, ExperienceRef, Step, TurnGuidance
from crl_train.policy.base import Generation, TokenSequence

if TYPE_CHECKING:
    from crl_gym.episode import EpisodeDriver


@dataclass
class Turn:
    """One generation and the context tokens that followed it (for rebuilding a sequence)."""

    generation: Generation
    context_ids: list[int]
    kind: str = "env"


@dataclass
class Episode:
    """One rollout of the batch."""

    group: int
    condition: Condition
    env_id: str
    seed: int
    sequence: TokenSequence = field(default_factory=TokenSequence)
    task: str = ""
    reward: float = 0.0
    success: bool = False
    turns: int = 0
    num_actions: int = 0
    experience: ExperienceRef | None = None
    request: DistillationRequest | None = None
    info: EnvInfo = field(default_factory=dict)
    done: bool = False
    prompt_ids: list[int] = field(default_factory=list)
    history: list[Turn] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    admissible: list[str] = field(default_factory=list)
    search_calls: int = 0
    request_meta: dict[str, object] = field(default_factory=dict)
    """What the episode's request carries in ``meta`` besides the env's own: its place in its group
    (``GROUP_COPY``, ``GROUP_SIZE``: per-group distillation) and the gate's verdict."""
    turn_experience: list[TurnGuidance] = field(default_factory=list)
    """Entries per-turn retrieval showed (``info["turn_experience"]``)."""
    unreadable: int = 0
    """Answers the driver could not read (no action tag; passed on whole)."""
    driver: EpisodeDriver | None = field(default=None, repr=False, compare=False)
    """The driver that plays the episode (None for an episode built by hand)."""

    @property
    def failed_by_error(self) -> bool:
        return "error" in self.info


__all__ = ["Episode", "Turn"]
