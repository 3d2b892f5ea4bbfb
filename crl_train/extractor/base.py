"""The extractor contract: what the experience service's background track calls on π_φ.

:class:`~crl_train.extractor.model.Extractor` (in process),
:class:`~crl_train.extractor.worker.ExtractorWorker` (the same in a child process) and
:class:`~crl_train.extractor.oracle.OracleExtractor` (no weights) implement it; mypy checks each of
them wherever the service hands one to the track.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from crl_gym.json_types import JSONDict
from crl_gym.protocol import DistillationRequest, ExperienceOp, ExperienceRef, ExtractorSample

if TYPE_CHECKING:
    from crl_gym.experience.bank import ExperienceBank
    from crl_train.extractor.model import BufferItem


class ExtractorBackend(Protocol):
    """π_φ as the service drives it: distil, refine, reflect, merge, update, checkpoint."""

    @property
    def alive(self) -> bool:
        """False once the model can no longer run (a dead worker process): the track counts what
        it skips."""
        ...

    @property
    def trainable(self) -> bool:
        """Whether there are weights to train (the service runs CISPO only then)."""
        ...

    def distill(
        self, requests: Sequence[DistillationRequest]
    ) -> list[tuple[ExtractorSample, list[ExperienceOp]]]:
        """One sample and its parsed ops per request (never raises on a malformed answer)."""
        ...

    def refine(
        self, query: str, entry: ExperienceRef, context: str
    ) -> tuple[str, ExtractorSample | None]:
        """The manager's ``refiner``: ``entry`` rewritten for the actor's query."""
        ...

    def reflect(
        self,
        category: str,
        failures: Sequence[DistillationRequest],
        successes: Sequence[DistillationRequest],
        max_entries: int = 3,
    ) -> tuple[ExtractorSample, list[ExperienceOp]]:
        """EDGE's reflection on a low-success category: Adds only, or a Return."""
        ...

    def merge_generate(self, prompts: list[str]) -> list[ExtractorSample]:
        """``merge_bank``'s ``generate`` callback."""
        ...

    def update(
        self, items: Sequence[BufferItem], bank: ExperienceBank, step: int
    ) -> dict[str, float]:
        """A CISPO step over ``items``; the entries' training counts are recorded in ``bank``."""
        ...

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` (a Merge window's budget is counted in them)."""
        ...

    def save(self, directory: str | Path) -> None: ...

    def load(self, directory: str | Path) -> None: ...

    def get_state(self) -> JSONDict:
        """Version and per-sample constraints (JSON-ready) for a checkpoint."""
        ...

    def set_state(self, d: dict[str, Any]) -> None: ...

    def close(self) -> None: ...
