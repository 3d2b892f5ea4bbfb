"""The in-process client: :class:`LocalClient` over a service that lives in this process."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn, SupportsIndex

from crl_gym.clients.interface import check_step
from crl_gym.errors import ProcessBoundaryError
from crl_gym.experience.results import Health, OpsApplied, ServiceStats, StepEnded
from crl_gym.json_types import JSONInput
from crl_gym.limits import MAX_BODY_BYTES, MAX_TEXT, check_request_size
from crl_gym.protocol import DistillationRequest, ExperienceOp, ExperienceRef, _jsonable

if TYPE_CHECKING:
    from crl_gym.experience.manager import ExperienceManager
    from crl_gym.experience.service import RetrievalService


def as_service(target: RetrievalService | ExperienceManager) -> RetrievalService:
    """``target`` itself when it is a service; a bare ``ExperienceManager`` wrapped in a
    :class:`~crl_gym.experience.service.RetrievalService` (old callers pass a manager)."""
    from crl_gym.experience.manager import ExperienceManager
    from crl_gym.experience.service import RetrievalService

    if isinstance(target, RetrievalService):
        return target
    if isinstance(target, ExperienceManager):
        return RetrievalService(target)
    raise TypeError(
        f"expected a RetrievalService or an ExperienceManager, got {type(target).__name__}"
    )


class LocalClient:
    """An :class:`ExperienceClient` over an in-process service (everything delegates to it).

    Args:
        target: a :class:`~crl_gym.experience.service.RetrievalService` (or subclass, e.g.
            ``crl_train.service.ExperienceService``), or an ``ExperienceManager``, which is
            wrapped in a ``RetrievalService`` of its own. :meth:`close` closes neither: they
            belong to the caller.
        max_request_bytes: ``submit`` refuses a request whose text is larger
            (:class:`RequestTooLarge`), as a :class:`RemoteClient` to a server of this body
            limit does.

    **One process only.** The service and its bank live in the process that made the client.
    Used from another one (a worker forked or spawned by ``AsyncVectorEnv``), every call raises
    :class:`ProcessBoundaryError` naming :class:`RemoteClient`, and pickling it (what a spawned
    worker needs) raises the same: serve the bank (``crl-experience serve`` or
    :class:`~crl_gym.server.BackgroundServer`) and give the workers a ``RemoteClient``.
    """

    def __init__(
        self,
        target: RetrievalService | ExperienceManager,
        *,
        max_request_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self.service = as_service(target)
        self.max_request_bytes = int(max_request_bytes)
        self._pid = os.getpid()

    def _svc(self) -> RetrievalService:
        if os.getpid() != self._pid:
            raise ProcessBoundaryError(_process_boundary_message(self._pid))
        return self.service

    def check_process(self) -> None:
        """Raise :class:`ProcessBoundaryError` when called from another process than
        the client's."""
        self._svc()

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        raise ProcessBoundaryError(_process_boundary_message(self._pid, pickled=True))

    @property
    def manager(self) -> ExperienceManager:
        """The service's manager (older callers reach the bank through it)."""
        return self._svc().manager

    def search(self, query: str) -> ExperienceRef | None:
        return self._svc().search(query)

    def search_many(self, queries: list[str]) -> list[ExperienceRef | None]:
        return self._svc().search_many(list(queries))

    def ask(self, query: str, entry: ExperienceRef, context: str) -> tuple[str, JSONInput | None]:
        return self._svc().ask(str(query)[:MAX_TEXT], entry, str(context)[:MAX_TEXT])

    def submit(self, request: DistillationRequest) -> None:
        service = self._svc()
        if isinstance(request, DistillationRequest):
            check_request_size(request, self.max_request_bytes)
        service.submit(request)

    def flush(self, timeout: float | None = None) -> None:
        """Nothing to wait for: :meth:`submit` hands each request to the service before
        it returns."""
        self._svc()

    def get_requests(self, max_n: int, timeout: float = 0.0) -> list[DistillationRequest]:
        return self._svc().get_requests(max_n, timeout)

    def end_step(self, step: int, bonus: dict[str, float] | None = None) -> StepEnded:
        return self._svc().end_step(check_step(step), bonus)

    def apply_ops(self, ops: Sequence[ExperienceOp], *, step: int | None = None) -> OpsApplied:
        return self._svc().apply_ops(list(ops), step=step)

    def stats(self) -> ServiceStats:
        """The service's ``stats()`` as a ``RemoteClient`` reads it: through its JSON form, so both
        faces give the same fields (every counter a plain number or text)."""
        return ServiceStats.from_dict(_jsonable(self._svc().stats().to_dict()))

    def health(self) -> Health:
        return self._svc().health()

    def close(self) -> None:
        """Nothing to release: the service (and its manager) belong to the caller."""


def _process_boundary_message(pid: int, *, pickled: bool = False) -> str:
    where = (
        "cannot be pickled for another process"
        if pickled
        else f"was made in process {pid} and is used in process {os.getpid()}"
    )
    return (
        f"LocalClient {where} (a forked or spawned worker, e.g. of AsyncVectorEnv): its service "
        "and bank live in the process that made it, so nothing would reach them. Serve the bank "
        "(crl-experience serve, or crl_gym.server.BackgroundServer(service)) and give the workers "
        "crl_gym.clients.RemoteClient(url) instead"
    )


__all__ = ["LocalClient", "as_service"]
