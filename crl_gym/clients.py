"""Clients the wrappers use to reach the experience manager: in-process or over HTTP.

Both clients implement :class:`ExperienceClient` and behave identically (the same tests run
against both): ``search`` / ``search_many`` return :class:`~crl_gym.protocol.ExperienceRef`
(or ``None`` when the bank has nothing), ``ask`` has the extractor refine an entry for the
agent's own query (the raw entry when no extractor is attached), ``submit`` hands a finished
episode's :class:`~crl_gym.protocol.DistillationRequest` to the manager without blocking.

>>> from crl_gym.experience.bank import ExperienceBank
>>> from crl_gym.experience.embedders import HashingEmbedder
>>> from crl_gym.experience.manager import ExperienceManager
>>> emb = HashingEmbedder(64)
>>> bank = ExperienceBank(None, dim=64)
>>> _ = bank.add("Walk east until the stairs.", emb.encode(["Walk east until the stairs."])[0])
>>> client = LocalClient(ExperienceManager(bank, emb))
>>> client.search("reach the stairs").text
'Walk east until the stairs.'
>>> client.close()
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Protocol, runtime_checkable

from crl_gym.protocol import DistillationRequest, ExperienceRef

logger = logging.getLogger(__name__)


class ExperienceUnavailable(RuntimeError):
    """The experience service could not be reached or failed; callers run without it."""


@runtime_checkable
class ExperienceClient(Protocol):
    """What the wrappers need from the experience layer."""

    def search(self, query: str) -> ExperienceRef | None:
        """The best (diversified) entry for ``query``, or ``None`` when the bank is empty."""
        ...

    def search_many(self, queries: list[str]) -> list[ExperienceRef | None]:
        """One :meth:`search` per query, batched (one embedding pass)."""
        ...

    def ask(self, query: str, entry: ExperienceRef, context: str) -> tuple[str, dict[str, Any] | None]:
        """Refine ``entry`` for the agent's ``query`` in ``context``: ``(answer, provenance)``.

        ``provenance`` is the extractor sample (``ExtractorSample.to_dict()``) that produced the
        answer, or ``None`` when no extractor is attached (then ``answer`` is the entry's text).
        """
        ...

    def submit(self, request: DistillationRequest) -> None:
        """Queue a finished episode for distillation; never blocks on the extractor."""
        ...


def ask_manager(manager: Any, query: str, entry: ExperienceRef, context: str) -> tuple[str, dict[str, Any] | None]:
    """Shared ``ask`` logic of :class:`LocalClient` and the HTTP server.

    The manager's ``refiner(query, entry, context) -> (text, ExtractorSample | None)`` rewrites
    the entry; without one the raw entry text is the answer. A refiner that fails or returns an
    empty text also falls back to the raw entry (counted in ``manager``-independent
    :data:`ASK_FALLBACKS`), so a broken extractor never costs the agent its answer.
    """
    refiner = getattr(manager, "refiner", None)
    if refiner is None:
        return entry.text, None
    try:
        text, sample = refiner(query, entry, context)
    except Exception as exc:  # noqa: BLE001 - a broken extractor must not break the episode
        _count_fallback(f"refiner raised {type(exc).__name__}: {exc}")
        return entry.text, None
    if not isinstance(text, str) or not text.strip():
        _count_fallback(f"refiner returned an empty answer ({text!r})")
        return entry.text, None
    return text, (sample.to_dict() if sample is not None else None)


ASK_FALLBACKS: dict[str, Any] = {"count": 0, "last_reason": ""}
"""How many ``ask`` calls fell back to the raw entry because the refiner failed (per process)."""
_FALLBACK_LOCK = threading.Lock()


def _count_fallback(reason: str) -> None:
    with _FALLBACK_LOCK:
        ASK_FALLBACKS["count"] += 1
        ASK_FALLBACKS["last_reason"] = reason
    logger.warning("search_and_ask: returning the raw entry: %s", reason)


class LocalClient:
    """An :class:`ExperienceClient` over an in-process ``ExperienceManager``."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def search(self, query: str) -> ExperienceRef | None:
        hits = self.manager.search(query, k=1)
        return hits[0].ref() if hits else None

    def search_many(self, queries: list[str]) -> list[ExperienceRef | None]:
        if not queries:
            return []
        results = self.manager.search_many(list(queries), k=1)
        return [hits[0].ref() if hits else None for hits in results]

    def ask(self, query: str, entry: ExperienceRef, context: str) -> tuple[str, dict[str, Any] | None]:
        return ask_manager(self.manager, query, entry, context)

    def submit(self, request: DistillationRequest) -> None:
        self.manager.submit(request)

    def get_requests(self, max_n: int, timeout: float = 0.0) -> list[DistillationRequest]:
        """Dequeue up to ``max_n`` pending requests (trainer side)."""
        return list(self.manager.get_requests(max_n, timeout))

    def stats(self) -> dict[str, Any]:
        return dict(self.manager.stats())

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "pending": int(self.manager.pending())}

    def close(self) -> None:
        """Nothing to release: the manager belongs to the caller."""


class RemoteClient:
    """An :class:`ExperienceClient` over HTTP to ``crl-experience serve`` (see :mod:`crl_gym.server`).

    Picklable (the HTTP connection pool is opened lazily in each process), so an env factory
    that captures it can be sent to ``AsyncVectorEnv`` workers. Transport failures and server
    errors raise :class:`ExperienceUnavailable`; the wrappers catch it and run the episode free.
    """

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self._http: Any = None
        self._pid = -1

    # The httpx client holds sockets and locks: rebuild it after pickling or forking.
    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "timeout": self.timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["timeout"])  # type: ignore[misc]

    def _client(self) -> Any:
        if self._http is None or self._pid != os.getpid():
            import httpx

            self._http = httpx.Client(base_url=self.url, timeout=self.timeout)
            self._pid = os.getpid()
        return self._http

    def _call(self, method: str, path: str, payload: dict[str, Any] | None = None, extra_wait: float = 0.0) -> Any:
        import httpx

        try:
            resp = self._client().request(method, path, json=payload, timeout=self.timeout + extra_wait)
        except httpx.HTTPError as exc:
            raise ExperienceUnavailable(f"experience server {self.url}{path} unreachable: {type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 500:
            raise ExperienceUnavailable(f"experience server {self.url}{path} failed ({resp.status_code}): {resp.text[:500]}")
        if resp.status_code >= 400:
            # A 4xx is our bug or bad input, not an outage: say which field the server rejected.
            raise ValueError(f"experience server {self.url}{path} rejected the request ({resp.status_code}): {resp.text[:500]}")
        return resp.json()

    def search(self, query: str) -> ExperienceRef | None:
        return ExperienceRef.from_dict(self._call("POST", "/search", {"query": query})["entry"])

    def search_many(self, queries: list[str]) -> list[ExperienceRef | None]:
        if not queries:
            return []
        out = self._call("POST", "/search_many", {"queries": list(queries)})["entries"]
        return [ExperienceRef.from_dict(d) for d in out]

    def ask(self, query: str, entry: ExperienceRef, context: str) -> tuple[str, dict[str, Any] | None]:
        out = self._call("POST", "/ask", {"query": query, "entry": entry.to_dict(), "context": context})
        return str(out["answer"]), out.get("provenance")

    def submit(self, request: DistillationRequest) -> None:
        self._call("POST", "/submit", {"requests": [request.to_dict()]})

    def get_requests(self, max_n: int, timeout: float = 0.0) -> list[DistillationRequest]:
        out = self._call("POST", "/get_requests", {"max_n": max_n, "timeout": timeout}, extra_wait=timeout)
        return [DistillationRequest.from_dict(d) for d in out["requests"]]

    def stats(self) -> dict[str, Any]:
        return dict(self._call("GET", "/stats"))

    def health(self) -> dict[str, Any]:
        return dict(self._call("GET", "/health"))

    def close(self) -> None:
        if self._http is not None and self._pid == os.getpid():
            self._http.close()
        self._http = None
