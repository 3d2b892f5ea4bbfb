"""The experience service as a Ray actor, and a client with the same interface as the other faces.

On a cluster the service is one **detached, named** actor **pinned to the head node**
(``NodeAffinitySchedulingStrategy``): its bank is a directory on the head node's disk, so losing
a worker node (an actor GPU, a vLLM engine) loses no entry, no queued request and no B_φ, and a
rerun of the launcher finds the same actor by name. It is a *threaded* actor with
``max_concurrency > 1``: searches from many episodes run in as many threads and meet in the
manager's batcher (B = ``manager.batch_size``, t_max = ``manager.max_wait_ms``), which embeds
them in one pass. π_φ runs in the service's :class:`~crl_train.extractor.ExtractorWorker`
process on the actor's GPUs (``extractor.device`` for the HF training, ``extractor.generator:
vllm`` for generation, weights pushed into the engine after every CISPO update).

:class:`ServiceActor` is a plain class (``ray.remote`` is applied by :func:`deploy_service`), so
this module imports without Ray. Everything crosses the actor boundary as plain dicts (requests,
entries, ops: their ``to_dict`` forms), as over HTTP.

:class:`RayServiceClient` implements :class:`~crl_gym.clients.ExperienceClient` (``ray.get``
under the hood) and adds awaitable twins (``asearch``, ``aask``, ``asubmit``, ``aend_step``, …)
for async code such as OpenRLHF's agent executor, which must never block vLLM's event loop. A dead
or unreachable actor raises :class:`~crl_gym.clients.ExperienceUnavailable` (the wrappers run the
episode free and keep its request); errors of the service itself (``StepOrderError``, a malformed
request's ``ValueError``) are raised as themselves, as on the other faces.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypedDict, TypeVar

import numpy as np

from crl_gym.clients import ExperienceUnavailable, check_step
from crl_gym.experience.embedders import Embedder
from crl_gym.experience.results import Health, JSONValue, OpsApplied, ServiceStats, StepEnded
from crl_gym.json_types import ExperienceRefDict, JSONDict, JSONInput, RequestDict
from crl_gym.protocol import (
    DistillationRequest,
    ExperienceOp,
    ExperienceRef,
    op_from_dict,
    op_to_dict,
)
from crl_train.service.checkpoint import CKPT, OLD, STATE, TMP
from crl_train.service.service import ServiceOptions

log = logging.getLogger(__name__)

HEAD_NODE_RESOURCE = "node:__internal_head__"
"""Ray's resource that only the head node has."""

P = ParamSpec("P")
R = TypeVar("R")


class EmbedderPool:
    """Several copies of one embedder behind the :class:`~crl_gym.experience.embedders.Embedder`
    interface: each ``encode`` takes a free copy, so the manager's W search workers embed on
    ``len(copies)`` models at once instead of queueing on one (the authors run 2 embedding workers).

    >>> from crl_gym.experience.embedders import HashingEmbedder
    >>> pool = EmbedderPool([HashingEmbedder(16), HashingEmbedder(16)])
    >>> pool.encode(["walk east"]).shape, pool.calls
    ((1, 16), [1, 0])
    """

    def __init__(self, copies: Sequence[Embedder]) -> None:
        if not copies:
            raise ValueError("EmbedderPool needs at least one embedder")
        dims = {int(e.dim) for e in copies}
        if len(dims) != 1:
            raise ValueError(f"EmbedderPool: the copies disagree on the dimension ({sorted(dims)})")
        self.dim = dims.pop()
        self.copies = list(copies)
        self.calls = [0] * len(self.copies)
        """Encode calls served by each copy."""
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(len(self.copies)):
            self._free.put(i)

    def encode(self, texts: list[str]) -> np.ndarray:
        i = self._free.get()
        try:
            self.calls[i] += 1
            return self.copies[i].encode(texts)
        finally:
            self._free.put(i)


class ServiceActor:
    """The body of the Ray actor: one :class:`~crl_train.service.ExperienceService`, started.

    Args:
        config: the crl-train config (``config_to_dict``): its extractor, manager, experience and
            algo sections are used.
        options: the method's extractor side (``Method.service_options()``), run asynchronously.
        service_dir: the service's directory on this node: ``bank/`` and ``checkpoint/``. A
            directory with a checkpoint is resumed (B_φ, π_φ, counters, the last ended step).
        embedding_workers: copies of the embedder (:class:`EmbedderPool`).
        embedder_device: where they run.
    """

    def __init__(
        self,
        config: dict[str, Any],
        service_dir: str,
        *,
        options: ServiceOptions,
        embedding_workers: int = 1,
        embedder_device: str = "cpu",
    ) -> None:
        from crl_train.config import config_from_dict
        from crl_train.service.build import embedder_of, start_service

        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        cfg = config_from_dict(dict(config))
        self.cfg = cfg
        options = dataclasses.replace(options, asynchronous=True)
        self.dir = Path(service_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        found = newest_checkpoint(self.dir)
        state = found[1]["service"] if found is not None else None
        ext_ckpt = (
            found[0] / "extractor"
            if found is not None and (found[0] / "extractor").is_dir()
            else None
        )
        self._ckpt_lock = threading.Lock()
        embedder = EmbedderPool(
            [embedder_of(cfg.experience, embedder_device) for _ in range(max(1, embedding_workers))]
        )
        self.service = start_service(
            cfg,
            options,
            self.dir / "bank",
            extractor_checkpoint=ext_ckpt,
            state=state,
            embedder=embedder,
        )
        self.service.checkpoint_dir = (
            self.dir
        )  # closing checkpoints B_φ and π_φ, as the HTTP server does
        log.info(
            "experience service ready in %s (bank %d entries, last ended step %d)",
            self.dir,
            len(self.service.manager.bank),
            self.service.ledger.last_ended,
        )

    # ------------------------------------------------------------------ the client interface
    def search(self, query: str) -> ExperienceRefDict | None:
        ref = self.service.search(query)
        return ref.to_dict() if ref is not None else None

    def search_many(self, queries: list[str]) -> list[ExperienceRefDict | None]:
        return [
            r.to_dict() if r is not None else None for r in self.service.search_many(list(queries))
        ]

    def ask(self, query: str, entry: JSONInput, context: str) -> tuple[str, JSONInput | None]:
        ref = ExperienceRef.from_dict(entry, "entry")
        if ref is None:
            raise ValueError("ask: entry must be an experience object, got null")
        return self.service.ask(query, ref, context)

    def submit(self, request: JSONInput) -> None:
        self.service.submit(DistillationRequest.from_dict(request))

    def get_requests(self, max_n: int, timeout: float = 0.0) -> list[RequestDict]:
        return [r.to_dict() for r in self.service.get_requests(max_n, timeout)]

    def end_step(self, step: int, bonus: dict[str, float] | None = None) -> dict[str, JSONValue]:
        return self.service.end_step(check_step(step), bonus).to_dict()

    def apply_ops(self, ops: list[JSONInput], step: int | None = None) -> dict[str, JSONValue]:
        return self.service.apply_ops([op_from_dict(d) for d in ops], step=step).to_dict()

    def stats(self) -> dict[str, JSONValue]:
        return _plain(self.service.stats().to_dict())

    def health(self) -> dict[str, JSONValue]:
        return self.service.health().to_dict()

    # ------------------------------------------------------------------ the actor's own
    def node_id(self) -> str:
        """The Ray node this actor runs on (the head node when deployed by
        :func:`deploy_service`)."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def checkpoint(self) -> JSONDict:
        """Counters, B_φ and π_φ into ``service_dir/checkpoint``, taken between two passes of the
        extractor's loop (:meth:`ExperienceService.save`), by the run's checkpoint writer
        (``crl_train.service.checkpoint``): written whole beside the current one, ``state.json``
        last and fsync'd, the previous one kept as ``checkpoint.old``. A new actor on this directory
        resumes from the newest complete one. The bank is not copied and never rolled back: it is
        SQLite on this disk (flushed first), and what its clients were acknowledged stays."""
        with self._ckpt_lock:
            return self.service.checkpoint(self.dir)

    def close(self) -> None:
        """Stop the extractor's loop, checkpoint (:meth:`checkpoint`), stop its process, persist the
        queue, close the bank: a new actor on this directory goes on from here."""
        self.service.close()


def newest_checkpoint(service_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The complete service checkpoint with the latest ended step among ``checkpoint/``,
    ``checkpoint.tmp/`` and ``checkpoint.old/`` (a kill between the writer's renames leaves no
    ``checkpoint/``), with its state; None when there is none. An unreadable one is logged
    and skipped."""
    found: list[tuple[int, int, Path, dict[str, Any]]] = []
    for rank, name in enumerate((CKPT, TMP, OLD)):
        path = service_dir / name / STATE
        if not path.is_file():
            continue
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
            last = int(state["service"].get("last_ended", -1))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("%s is unreadable (%s): not resumed from", path, exc)
            continue
        found.append((last, -rank, path.parent, state))
    if not found:
        return None
    _, _, best, state = max(found, key=lambda x: (x[0], x[1]))
    return best, state


def _plain(d: dict[str, JSONValue]) -> dict[str, JSONValue]:
    """``stats()`` with every value JSON-ready (what every face returns)."""
    return dict(
        json.loads(json.dumps(d, default=lambda o: o.item() if hasattr(o, "item") else str(o)))
    )


# ---------------------------------------------------------------------------------------- deploy


def head_node_id() -> str:
    """The id of the cluster's head node (the driver's node when the head cannot be told apart)."""
    import ray

    for node in ray.nodes():
        if node.get("Alive") and HEAD_NODE_RESOURCE in node.get("Resources", {}):
            return str(node["NodeID"])
    return str(ray.get_runtime_context().get_node_id())


def deploy_service(
    config: dict[str, Any],
    service_dir: str | Path,
    *,
    options: ServiceOptions,
    name: str,
    namespace: str = "crl",
    num_gpus: float = 0,
    num_cpus: float = 1,
    max_concurrency: int = 64,
    embedding_workers: int = 1,
    embedder_device: str = "cpu",
    node_id: str | None = None,
    reuse: bool = True,
    max_restarts: int = 3,
    ready_timeout_s: float = 1800.0,
    timeout: float = 120.0,
) -> RayServiceClient:
    """Start (or, with ``reuse``, find) the named service actor and wait until it answers.

    ``options`` is the extractor side of the config's method
    (``make_method(cfg).service_options()``).

    The actor is detached (it outlives the driver that made it), pinned to ``node_id`` (default:
    the head node, where ``service_dir`` is), and restarted up to ``max_restarts`` times by Ray
    after a crash: a restarted actor reopens the same bank and resumes from its last checkpoint.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if max_concurrency < 2:
        raise ValueError(
            f"max_concurrency must be >= 2 so that concurrent searches batch, got {max_concurrency}"
        )
    node = node_id or head_node_id()
    actor_cls = ray.remote(ServiceActor)
    try:
        handle = actor_cls.options(
            name=name,
            namespace=namespace,
            lifetime="detached",
            get_if_exists=reuse,
            max_concurrency=max_concurrency,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            max_restarts=max_restarts,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        ).remote(
            dict(config),
            str(service_dir),
            options=options,
            embedding_workers=embedding_workers,
            embedder_device=embedder_device,
        )
    except ValueError as exc:  # the name is taken and reuse is off
        raise RuntimeError(
            f"an experience service named {name!r} already exists in namespace {namespace!r}: "
            f"reuse it (reuse=True) or remove it with ray.kill(ray.get_actor({name!r}, "
            f"namespace={namespace!r}))"
        ) from exc
    client = RayServiceClient(name, namespace, timeout=timeout, handle=handle)
    try:
        client.health(timeout=ready_timeout_s)
    except ExperienceUnavailable as exc:
        raise RuntimeError(f"the experience service {name!r} did not start: {exc}") from exc
    return client


# ---------------------------------------------------------------------------------------- client


class RayClientState(TypedDict):
    """What a pickled :class:`RayServiceClient` keeps (the actor handle is looked up again)."""

    name: str
    namespace: str
    timeout: float


class RayServiceClient:
    """An :class:`~crl_gym.clients.ExperienceClient` over the named service actor (see the
    module docstring).

    Args:
        name / namespace: the actor's Ray name.
        timeout: seconds per call (``get_requests`` adds its own wait).
        handle: an actor handle already at hand (else looked up by name, once per process).

    Picklable (name, namespace and timeout only): an env factory that captures it can travel to
    another Ray process, which looks the actor up by name itself.
    """

    def __init__(
        self, name: str, namespace: str = "crl", *, timeout: float = 120.0, handle: Any = None
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.name, self.namespace, self.timeout = name, namespace, float(timeout)
        self._handle = handle
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def __getstate__(self) -> RayClientState:
        return {"name": self.name, "namespace": self.namespace, "timeout": self.timeout}

    def __setstate__(self, d: RayClientState) -> None:
        self.__init__(d["name"], d["namespace"], timeout=d["timeout"])  # type: ignore[misc]

    # ------------------------------------------------------------------ plumbing
    def _actor(self) -> Any:
        if self._handle is not None and self._pid == os.getpid():
            return self._handle
        import ray

        with self._lock:
            try:
                self._handle = ray.get_actor(self.name, namespace=self.namespace)
            except ValueError as exc:
                raise ExperienceUnavailable(
                    f"no experience service {self.name!r} in Ray namespace "
                    f"{self.namespace!r}: {exc}"
                ) from exc
            self._pid = os.getpid()
            return self._handle

    def _ref(self, method: Callable[..., object], /, *args: object, **kwargs: object) -> Any:
        # the name comes from ServiceActor's own method, so mypy checks the call against
        # its signature
        return getattr(self._actor(), method.__name__).remote(*args, **kwargs)

    def _failed(self, exc: BaseException) -> BaseException:
        """What the caller sees for ``exc`` raised by ``ray.get`` (see the module docstring)."""
        from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

        if isinstance(exc, RayTaskError):
            cause = getattr(exc, "cause", None)
            return (
                cause if isinstance(cause, Exception) and not isinstance(cause, RayError) else exc
            )
        if isinstance(exc, RayActorError):
            self._handle = None  # a restarted actor is looked up again
        if isinstance(exc, (GetTimeoutError, RayError)):
            return ExperienceUnavailable(
                f"experience service {self.name!r}: {type(exc).__name__}: {exc}"
            )
        return exc

    def _call(
        self,
        method: Callable[Concatenate[ServiceActor, P], R],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        """``method`` of the actor with these arguments, waited for :attr:`timeout` s."""
        return self._call_within(self.timeout, method, *args, **kwargs)

    def _call_within(
        self,
        timeout: float,
        method: Callable[Concatenate[ServiceActor, P], R],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        import ray

        try:
            result: R = ray.get(self._ref(method, *args, **kwargs), timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - translated, see _failed
            raise self._failed(exc) from exc
        return result

    async def _acall(
        self,
        method: Callable[Concatenate[ServiceActor, P], R],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        ref = self._ref(method, *args, **kwargs)
        try:
            result: R = await asyncio.wait_for(ref, self.timeout)
        except TimeoutError as exc:
            raise ExperienceUnavailable(
                f"experience service {self.name!r}: {method.__name__} got no answer within "
                f"{self.timeout} s"
            ) from exc
        except Exception as exc:  # noqa: BLE001 - translated, see _failed
            raise self._failed(exc) from exc
        return result

    # ------------------------------------------------------------------ ExperienceClient
    def search(self, query: str) -> ExperienceRef | None:
        return _ref_of(self._call(ServiceActor.search, str(query)))

    def search_many(self, queries: list[str]) -> list[ExperienceRef | None]:
        if not queries:
            return []
        return [_ref_of(d) for d in self._call(ServiceActor.search_many, [str(q) for q in queries])]

    def ask(self, query: str, entry: ExperienceRef, context: str) -> tuple[str, JSONInput | None]:
        answer, provenance = self._call(ServiceActor.ask, query, entry.to_dict(), context)
        return str(answer), provenance

    def submit(self, request: DistillationRequest) -> None:
        self._call(ServiceActor.submit, _request_dict(request))

    def flush(self, timeout: float | None = None) -> None:
        """Nothing to wait for: :meth:`submit` returns once the actor has the request."""

    def get_requests(self, max_n: int, timeout: float = 0.0) -> list[DistillationRequest]:
        out = self._call_within(self.timeout + timeout, ServiceActor.get_requests, max_n, timeout)
        return [DistillationRequest.from_dict(d) for d in out]

    def end_step(self, step: int, bonus: dict[str, float] | None = None) -> StepEnded:
        return StepEnded.from_dict(
            self._call(ServiceActor.end_step, check_step(step), _bonus(bonus))
        )

    def apply_ops(self, ops: Sequence[ExperienceOp], *, step: int | None = None) -> OpsApplied:
        return OpsApplied.from_dict(
            self._call(ServiceActor.apply_ops, [op_to_dict(op) for op in ops], step)
        )

    def stats(self) -> ServiceStats:
        return ServiceStats.from_dict(self._call(ServiceActor.stats))

    def health(self, timeout: float | None = None) -> Health:
        return Health.from_dict(self._call_within(timeout or self.timeout, ServiceActor.health))

    def close(self) -> None:
        """Nothing to release: the actor belongs to whoever deployed it (see :meth:`shutdown`)."""

    # ------------------------------------------------------------------ awaitable twins
    async def asearch(self, query: str) -> ExperienceRef | None:
        return _ref_of(await self._acall(ServiceActor.search, str(query)))

    async def asearch_many(self, queries: list[str]) -> list[ExperienceRef | None]:
        if not queries:
            return []
        return [
            _ref_of(d)
            for d in await self._acall(ServiceActor.search_many, [str(q) for q in queries])
        ]

    async def aask(
        self, query: str, entry: ExperienceRef, context: str
    ) -> tuple[str, JSONInput | None]:
        answer, provenance = await self._acall(ServiceActor.ask, query, entry.to_dict(), context)
        return str(answer), provenance

    async def asubmit(self, request: DistillationRequest) -> None:
        await self._acall(ServiceActor.submit, _request_dict(request))

    async def aend_step(self, step: int, bonus: dict[str, float] | None = None) -> StepEnded:
        return StepEnded.from_dict(
            await self._acall(ServiceActor.end_step, check_step(step), _bonus(bonus))
        )

    async def aapply_ops(
        self, ops: Sequence[ExperienceOp], *, step: int | None = None
    ) -> OpsApplied:
        return OpsApplied.from_dict(
            await self._acall(ServiceActor.apply_ops, [op_to_dict(op) for op in ops], step)
        )

    async def astats(self) -> ServiceStats:
        return ServiceStats.from_dict(await self._acall(ServiceActor.stats))

    async def ahealth(self) -> Health:
        return Health.from_dict(await self._acall(ServiceActor.health))

    # ------------------------------------------------------------------ the actor's own
    def checkpoint(self, timeout: float = 3600.0) -> JSONDict:
        """The service's checkpoint (``ServiceActor.checkpoint``): may take minutes with a
        real π_φ."""
        return dict(self._call_within(timeout, ServiceActor.checkpoint))

    def node_id(self) -> str:
        return str(self._call(ServiceActor.node_id))

    def shutdown(self, timeout: float = 600.0) -> None:
        """Close the service (queue persisted, bank closed) and end the actor; returns once it is
        gone (its name is free again: a new service of that name is a new actor)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            self._call_within(timeout, ServiceActor.close)
        finally:
            try:
                handle = self._actor()
            except ExperienceUnavailable:
                return
            ray.kill(handle, no_restart=True)
            self._handle = None
            deadline = time.monotonic() + 60.0
            while time.monotonic() < deadline:  # ray.kill returns before the actor is dead
                try:
                    ray.get(handle.__ray_ready__.remote(), timeout=5.0)
                except (RayActorError, GetTimeoutError):
                    break
                time.sleep(0.1)


def _ref_of(d: JSONInput | None) -> ExperienceRef | None:
    return ExperienceRef.from_dict(d) if d is not None else None


def _bonus(bonus: dict[str, float] | None) -> dict[str, float] | None:
    return None if bonus is None else {str(k): float(v) for k, v in bonus.items()}


def _request_dict(request: DistillationRequest) -> RequestDict:
    if not isinstance(request, DistillationRequest):
        raise TypeError(f"submit expects a DistillationRequest, got {type(request).__name__}")
    return request.to_dict()


__all__ = [
    "HEAD_NODE_RESOURCE",
    "EmbedderPool",
    "RayServiceClient",
    "ServiceActor",
    "deploy_service",
    "head_node_id",
    "newest_checkpoint",
]
