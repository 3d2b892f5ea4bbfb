"""What every client of the experience service has: the :class:`ExperienceClient` protocol, the
token's environment variable and the check of a rollout step both faces make before ``end_step``."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from crl_gym.experience.results import Health, OpsApplied, ServiceStats, StepEnded
from crl_gym.experience.service import StepOrderError
from crl_gym.json_types import JSONInput
from crl_gym.protocol import DistillationRequest, ExperienceOp, ExperienceRef

TOKEN_ENV = "CRL_EXPERIENCE_TOKEN"
"""Environment variable holding the bearer token of ``crl-experience serve`` (both sides
read it)."""


@runtime_checkable
class ExperienceClient(Protocol):
    """What the wrappers and trainers need from the experience service (every face has all
    of it)."""

    def search(self, query: str) -> ExperienceRef | None:
        """The best (diversified) entry for ``query``, or ``None`` when the bank is empty."""
        ...

    def search_many(self, queries: list[str]) -> list[ExperienceRef | None]:
        """One :meth:`search` per query, batched (one embedding pass)."""
        ...

    def ask(self, query: str, entry: ExperienceRef, context: str) -> tuple[str, JSONInput | None]:
        """Refine ``entry`` for the agent's ``query`` in ``context``: ``(answer, provenance)``.

        ``provenance`` is the extractor sample (``ExtractorSample.to_dict()``) that produced the
        answer, or ``None`` when no extractor is attached (then ``answer`` is the entry's text).
        """
        ...

    def submit(self, request: DistillationRequest) -> None:
        """Queue a finished episode for distillation; never waits for the extractor."""
        ...

    def flush(self, timeout: float | None = None) -> None:
        """Return once every request submitted before the call has reached the service."""
        ...

    def get_requests(self, max_n: int, timeout: float = 0.0) -> list[DistillationRequest]:
        """Take up to ``max_n`` queued requests (a trainer that distils on its own)."""
        ...

    def end_step(self, step: int, bonus: dict[str, float] | None = None) -> StepEnded:
        """Flush, then close rollout ``step`` (and earlier open ones): the steps closed, their
        requests and credits.

        Raises :class:`~crl_gym.experience.service.StepOrderError` for a step already ended. It
        flushes this process's submits only: when envs submit from worker processes
        (``AsyncVectorEnv``), close the step with :func:`crl_gym.wrappers.vector.end_step`, which
        flushes every worker first.
        """
        ...

    def apply_ops(self, ops: list[ExperienceOp], *, step: int | None = None) -> OpsApplied:
        """Apply Add / Update / Delete / Return ops: how many were added (their ids), updated,
        deleted, returned, malformed."""
        ...

    def stats(self) -> ServiceStats:
        """``bank_size``, ``queue_depth``, the extractor's counters and the
        manager's (``manager``)."""
        ...

    def health(self) -> Health:
        """``status`` "ok", ``pending`` and ``extractor`` (cheap; no token needed over HTTP)."""
        ...

    def close(self) -> None:
        """Release what the client itself holds (never the service it was given)."""
        ...


def check_step(step: object) -> int:
    """``step`` as a rollout step (int >= 0), else the service's own :class:`StepOrderError`."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise StepOrderError(f"end_step: step must be an int >= 0, got {step!r}")
    return step


__all__ = ["TOKEN_ENV", "ExperienceClient", "check_step"]
