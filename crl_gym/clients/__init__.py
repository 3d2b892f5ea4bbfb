"""Clients of the experience service: in-process (:class:`LocalClient`) or over HTTP
(:class:`RemoteClient`).

Both implement :class:`ExperienceClient`, the whole interface of
:class:`~crl_gym.experience.service.RetrievalService`, and behave identically (the same tests run
against both): ``search`` / ``search_many`` return :class:`~crl_gym.protocol.ExperienceRef` (or
``None`` when the bank has nothing), ``ask`` has the extractor refine an entry for the agent's own
query (the raw entry when no extractor is attached), ``submit`` hands a finished episode's
:class:`~crl_gym.protocol.DistillationRequest` to the service without waiting for the extractor
(:class:`RemoteClient` not even for the HTTP round trip: it buffers, and a sender thread
delivers), ``flush`` waits until every request submitted before it reached the service,
``end_step`` flushes, then closes a rollout step
(:class:`~crl_gym.experience.service.StepOrderError` for a step ended twice or out of order, on both
faces), ``apply_ops`` writes Add / Update / Delete ops, ``stats`` / ``health`` report.

One module per concept, every name re-exported here (import them from ``crl_gym.clients``):
:mod:`~crl_gym.clients.interface` (:class:`ExperienceClient`, :data:`TOKEN_ENV`,
:func:`check_step`), :mod:`~crl_gym.clients.local`, :mod:`~crl_gym.clients.remote`,
:mod:`~crl_gym.clients.combiner` (the flat combining of ``RemoteClient.search``) and
:mod:`~crl_gym.clients.keeping` (:class:`KeepingClient`: the outbox of a client whose ``submit``
can fail).

>>> from crl_gym.experience.bank import ExperienceBank
>>> from crl_gym.experience.embedders import HashingEmbedder
>>> from crl_gym.experience.manager import ExperienceManager
>>> from crl_gym.protocol import AddOp
>>> client = LocalClient(ExperienceManager(ExperienceBank(None, dim=64), HashingEmbedder(64)))
>>> client.apply_ops([AddOp("Walk east until the stairs.")]).added
1
>>> client.search("reach the stairs").text
'Walk east until the stairs.'
>>> client.end_step(0).ended
[0]
>>> client.service.close()
"""

from __future__ import annotations

# One module per face; every name is re-exported here, where callers import it from.
from crl_gym.clients.combiner import Combiner as Combiner
from crl_gym.clients.interface import TOKEN_ENV as TOKEN_ENV
from crl_gym.clients.interface import ExperienceClient as ExperienceClient
from crl_gym.clients.interface import check_step as check_step
from crl_gym.clients.keeping import KeepingClient as KeepingClient
from crl_gym.clients.local import LocalClient as LocalClient
from crl_gym.clients.local import as_service as as_service
from crl_gym.clients.remote import RemoteClient as RemoteClient
from crl_gym.clients.run_steps import RunSteps as RunSteps

# the errors are re-exported: callers catch them from here
from crl_gym.errors import ExperienceAuthError as ExperienceAuthError
from crl_gym.errors import ExperienceUnavailable as ExperienceUnavailable
from crl_gym.errors import ProcessBoundaryError as ProcessBoundaryError
from crl_gym.errors import RequestTooLarge as RequestTooLarge
from crl_gym.errors import StorageFault as StorageFault
from crl_gym.errors import SubmitUndelivered as SubmitUndelivered
from crl_gym.experience.service import (
    ASK_FALLBACKS as ASK_FALLBACKS,  # re-exported: the wrappers' callers read it here
)
from crl_gym.experience.service import StepOrderError as StepOrderError
from crl_gym.experience.service import ask_manager as ask_manager
from crl_gym.outbox import SubmitCounts as SubmitCounts

__all__ = [
    "ASK_FALLBACKS",
    "TOKEN_ENV",
    "Combiner",
    "ExperienceAuthError",
    "ExperienceClient",
    "ExperienceUnavailable",
    "KeepingClient",
    "LocalClient",
    "ProcessBoundaryError",
    "RemoteClient",
    "RequestTooLarge",
    "RunSteps",
    "StepOrderError",
    "StorageFault",
    "SubmitCounts",
    "SubmitUndelivered",
    "as_service",
    "ask_manager",
    "check_step",
]
