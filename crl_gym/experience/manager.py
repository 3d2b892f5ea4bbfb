"""ExperienceManager H: batched, cached, diversified retrieval plus the distillation queue.

Search path (paper §3.2.2, plus what 1,024 concurrent searchers on 2 cores need):
callers enqueue (query, k) and block on a private lock; one batching thread takes a batch as
soon as B queries wait or the first has waited t_max (adaptive: everything already waiting),
looks each *distinct* text up in an LRU embedding cache, embeds the misses in one call and
hands the batch round-robin to one of W search workers. The worker searches each distinct
query once (or reuses its candidate pool while the bank is unchanged), then re-ranks the shared
pool per requester with s(m) = s_rank − λ·log(1+c(m)) − 1[recent]
(:func:`crl_gym.experience.diversify.rerank`, the one implementation of the formula), updating
counts as it goes, so the K members of a group get different entries. ``search_many`` runs the
same pipeline in the caller's thread for callers that hold many envs.

>>> from crl_gym.experience.bank import ExperienceBank
>>> from crl_gym.experience.embedders import HashingEmbedder
>>> emb = HashingEmbedder(64); bank = ExperienceBank(None, emb.dim)
>>> mgr = ExperienceManager(bank, emb)
>>> r = mgr.apply_ops([AddOp("open the door with the key"), AddOp("avoid the lava")])
>>> [e.text for e in mgr.search("how do I open a door", k=1)]
['open the door with the key']
>>> mgr.close()
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from queue import SimpleQueue
from typing import Any

import numpy as np

from crl_gym.errors import ExperienceUnavailable, StorageFault
from crl_gym.experience.bank import ExperienceBank, PendingAdd, PendingUpdate
from crl_gym.experience.batching import BatchLine, answer
from crl_gym.experience.config import ManagerConfig
from crl_gym.experience.distill_queue import DistillQueue
from crl_gym.experience.diversify import RankOptions, rerank
from crl_gym.experience.embedders import Embedder
from crl_gym.experience.entry import ExperienceEntry
from crl_gym.experience.keys import retrieval_key, stored_key
from crl_gym.experience.origin import Origin
from crl_gym.experience.pinning import is_pinned
from crl_gym.experience.storage_faults import as_fault
from crl_gym.experience.store import WriteRecord
from crl_gym.json_types import JSONDict
from crl_gym.protocol import (
    AddOp,
    DeleteOp,
    DistillationRequest,
    ExperienceOp,
    ExperienceRef,
    ExtractorSample,
    ReturnOp,
    UpdateOp,
)

log = logging.getLogger(__name__)
SPILL_FILE = "pending_requests.jsonl"
Refiner = Callable[[str, ExperienceRef, str], tuple[str, ExtractorSample | None]]


@dataclass
class ApplyResult:
    """What :meth:`ExperienceManager.apply_ops` did."""

    added: list[int] = field(default_factory=list)
    updated: list[int] = field(default_factory=list)
    deleted: list[int] = field(default_factory=list)
    returned: int = 0
    """Return ops (no action), including malformed ones and ops on unknown ids."""
    malformed: int = 0
    """Malformed outputs: parser fallbacks plus Update/Delete of ids not in the bank."""
    refused: int = 0
    """Add ops refused as near-duplicates (``dedup_similarity``)."""
    stale: int = 0
    """Update/Delete ops on entries that changed since the episode saw them: an Update of an entry
    merged away goes to the entry it was merged into, one of an entry gone since becomes an Add, a
    Delete of an entry gone since does nothing. Not malformed: the answer was right when asked."""
    pinned: int = 0
    """Extractor Update/Delete ops on a pinned (user's) entry: the Update's text is added as a new
    entry, the Delete does nothing (:mod:`crl_gym.experience.pinning`)."""

    def summary(self) -> JSONDict:
        """What the call did, as remembered with its write id
        (:mod:`~crl_gym.experience.write_ids`)."""
        return {
            "added_ids": list(self.added),
            "updated": list(self.updated),
            "deleted": list(self.deleted),
            "returned": self.returned,
            "malformed": self.malformed,
            "stale": self.stale,
            "refused": self.refused,
        }


class _Request:
    __slots__ = ("query", "k", "done", "result", "error")

    def __init__(self, query: str, k: int) -> None:
        self.query, self.k = query, k
        self.done = threading.Lock()
        self.done.acquire()  # released by the worker: the cheapest one-shot wake-up in CPython
        self.result: list[ExperienceEntry] = []
        self.error: BaseException | None = None


class ExperienceManager:
    """Retrieval front, distillation queue and op application over one bank."""

    def __init__(
        self,
        bank: ExperienceBank,
        embedder: Embedder,
        config: ManagerConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        if int(embedder.dim) != bank.dim:
            raise ValueError(
                f"embedder dim {embedder.dim} does not match the bank's dim {bank.dim}"
            )
        self.bank, self.embedder = bank, embedder
        self.config = config or ManagerConfig()
        self.clock = clock
        self.rng = rng or random.Random()
        """Draws of the top-1 dropout (``ManagerConfig.top1_dropout``)."""
        self.rank_options = RankOptions(
            self.config.top1_dropout, self.config.utility_weight, self.config.utility_exploration
        )
        if self.config.bank_capacity is not None:
            bank.set_capacity(self.config.bank_capacity, self.config.bank_eviction)
        self.refiner: Refiner | None = None
        self.dedup_similarity = self.config.dedup_similarity
        self.merged_into: dict[int, int] = {}
        """Entry id → the entry a Merge folded it into (``note_merge``), to redirect
        late Updates."""

        """Add ops this close (cosine) to an entry are refused; None = off. See
        ``ManagerConfig``."""
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._pools: dict[tuple[str, int], tuple[int, list[tuple[int, float]]]] = {}
        self._div_lock = threading.Lock()  # counts seen by diversification stay consistent
        self._counters: dict[str, int] = dict.fromkeys(
            (
                "requests",
                "batches",
                "cache_hits",
                "cache_misses",
                "embedded",
                "searched",
                "pool_hits",
                "errors",
            ),
            0,
        )
        self._last_flush = time.monotonic()
        spill = None if bank.path is None else bank.path / SPILL_FILE
        self.queue = DistillQueue(self.config.queue_size, spill)
        cfg = self.config
        self._line: BatchLine[_Request] = BatchLine(
            cfg.max_batch_size,
            batch_size=cfg.batch_size,
            max_wait_s=cfg.max_wait_ms / 1000.0,
            adaptive=cfg.adaptive_batching,
        )
        self._work: list[SimpleQueue[list[_Request] | None]] = [
            SimpleQueue() for _ in range(self.config.num_workers)
        ]
        self._threads = [threading.Thread(target=self._batch_loop, name="crl-batcher", daemon=True)]
        self._threads += [
            threading.Thread(
                target=self._worker_loop, args=(q,), name=f"crl-search-{i}", daemon=True
            )
            for i, q in enumerate(self._work)
        ]
        self._stop_persist = threading.Event()
        if self.config.persist_interval_s > 0 and bank.path is not None:
            self._threads.append(
                threading.Thread(target=self._persist_loop, name="crl-persist", daemon=True)
            )
        for t in self._threads:
            t.start()

    # -- retrieval ---------------------------------------------------------------------------
    def search(self, query: str, k: int = 1, timeout: float = 120.0) -> list[ExperienceEntry]:
        """Best ``k`` diversified entries for ``query`` (``[]`` on an empty bank)."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        req = _Request(self._cap(query), int(k))
        if not self._line.put(req):
            raise RuntimeError("ExperienceManager is closed")
        if not req.done.acquire(timeout=timeout):
            raise TimeoutError(f"search for {query[:60]!r} got no answer within {timeout} s")
        if req.error is not None:
            raise RuntimeError(f"search failed: {req.error}") from req.error
        return req.result

    def search_many(self, queries: Sequence[str], k: int = 1) -> list[list[ExperienceEntry]]:
        """Batch API: the whole pipeline in the calling thread, no hand-offs."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        reqs = [_Request(self._cap(q), int(k)) for q in queries]
        if reqs:
            self._retrieve(reqs)
        return [r.result for r in reqs]

    def _cap(self, query: str) -> str:
        """``query`` cut to ``max_query_chars``: a huge query would cost every caller in its batch
        a long embedding pass (and the cache a huge key) for no retrieval gain."""
        query = str(query)
        return query[: self.config.max_query_chars]

    def _batch_loop(self) -> None:
        rr = 0
        while (batch := self._line.next_batch()) is not None:  # None: closed and drained
            self._work[rr].put(batch)
            rr = (rr + 1) % len(self._work)
        for q in self._work:
            q.put(None)

    def _worker_loop(self, q: SimpleQueue[list[_Request] | None]) -> None:
        while (batch := q.get()) is not None:
            try:
                self._retrieve_isolated(batch)
            finally:
                for r in batch:
                    r.done.release()
            if time.monotonic() - self._last_flush > self.config.stats_flush_interval_s:
                self._last_flush = time.monotonic()
                self.bank.flush_stats()

    def _retrieve_isolated(self, batch: list[_Request]) -> None:
        """``_retrieve`` the batch, each request alone if it fails (:func:`answer`, isolated), so
        one bad query (one the embedder chokes on, say) fails only its own caller."""

        def run(reqs: list[_Request]) -> list[list[ExperienceEntry]]:
            self._retrieve(reqs)
            return [r.result for r in reqs]

        # BaseException: whatever happens, every caller gets an answer or an error, never a hang
        for r, out in zip(
            batch, answer(run, batch, isolate=True, catch=BaseException), strict=True
        ):
            if isinstance(out, BaseException):
                log.error("search of %.60r failed", r.query, exc_info=out)
                self._counters["errors"] += 1
                r.error = out

    def _embed(self, texts: Sequence[str]) -> tuple[dict[str, np.ndarray], int]:
        """Vectors of the distinct ``texts`` via the LRU cache; returns (vectors, cache hits)."""
        vecs: dict[str, np.ndarray] = {}
        with self._cache_lock:
            for t in texts:
                v = self._cache.get(t)
                if v is not None:
                    self._cache.move_to_end(t)
                    vecs[t] = v
        hits = len(vecs)
        missing = [t for t in texts if t not in vecs]
        if missing:
            out = np.asarray(self.embedder.encode(missing), dtype=np.float32)
            with self._cache_lock:
                for t, v in zip(missing, out, strict=True):
                    vecs[t] = self._cache[t] = v
                while len(self._cache) > self.config.cache_size:
                    self._cache.popitem(last=False)
            self._counters["embedded"] += len(missing)
        return vecs, hits

    def _pool(self, texts: list[str], sizes: dict[str, int]) -> dict[str, list[tuple[int, float]]]:
        """Over-fetched candidates per distinct text: one search per text, cached per generation."""
        gen, pools = self.bank.generation, {}
        todo = []
        for t in texts:
            hit = self._pools.get((t, sizes[t])) if self.config.pool_cache else None
            if hit is not None and hit[0] == gen:
                pools[t] = hit[1]
            else:
                todo.append(t)
        self._counters["pool_hits"] += len(texts) - len(todo)
        if todo:
            vecs, hits = self._embed(todo)
            self._counters["cache_hits"] += hits
            self._counters["cache_misses"] += len(todo) - hits
            found = self.bank.search(np.stack([vecs[t] for t in todo]), max(sizes[t] for t in todo))
            self._counters["searched"] += len(todo)
            if len(self._pools) > 4 * self.config.cache_size:
                self._pools.clear()
            for t, hits_ in zip(todo, found, strict=True):
                pools[t] = hits_[: sizes[t]]
                self._pools[(t, sizes[t])] = (gen, pools[t])
        return pools

    def _retrieve(self, reqs: list[_Request]) -> None:
        """Fill ``r.result`` for every request: shared pools, per-requester re-ranking."""
        sizes: dict[str, int] = {}
        for r in reqs:
            sizes[r.query] = max(sizes.get(r.query, 0), self.config.overfetch * r.k)
        texts = list(sizes)
        pools = self._pool(texts, sizes)
        self._counters["requests"] += len(reqs)
        self._counters["batches"] += 1
        lam, window = self.config.diversity_lambda, self.config.recency_window_s
        picks: list[list[int]] = []
        with self._div_lock:
            now = self.clock()
            cand = {i for t in texts for i, _ in pools[t]}
            stats = self.bank.retrieval_stats(cand)
            opts = self.rank_options
            credit = self.bank.credit_stats(cand) if opts.utility_weight else None
            for r in reqs:
                chosen = rerank(
                    pools[r.query],
                    stats,
                    k=r.k,
                    now=now,
                    lam=lam,
                    window=window,
                    options=opts,
                    credit=credit,
                    rng=self.rng,
                )
                # counted at once: the next member of the group sees this pick as used and recent
                for i in chosen:
                    stats[i] = (stats[i][0] + 1, now)
                picks.append(chosen)
            self.bank.record_retrieval([i for p in picks for i in p], now, persist=False)
        found = self.bank.get_many({i for p in picks for i in p})
        by_id = {e.id: e for e in found if e is not None}
        for r, chosen in zip(reqs, picks, strict=True):
            r.result = [by_id[i] for i in chosen if i in by_id]

    # -- distillation queue --------------------------------------------------------------------
    def submit(self, request: DistillationRequest) -> None:
        """Enqueue a finished episode for distillation; never blocks, never drops.

        A request the queue cannot take now (the manager is closed, the spill file cannot be
        written: a full disk) raises :class:`~crl_gym.errors.ExperienceUnavailable`, an outage:
        the caller keeps the request and retries, as it would for a server that is down."""
        if not isinstance(request, DistillationRequest):
            raise TypeError(f"submit expects a DistillationRequest, got {type(request).__name__}")
        if self._line.closed:
            raise ExperienceUnavailable(
                "ExperienceManager is closed: the request was not queued (keep it and submit "
                "it again)"
            )
        try:
            self.queue.put(request)
        except ValueError as exc:  # closed by another thread between the check and the put
            if not self._line.closed:
                raise
            raise ExperienceUnavailable(
                "ExperienceManager is closed: the request was not queued (keep it and submit "
                "it again)"
            ) from exc
        except OSError as exc:
            raise _queue_fault(exc, 1) from exc

    def submit_many(
        self, requests: Sequence[DistillationRequest], *, durable: bool = False
    ) -> None:
        """Enqueue ``requests`` as one write. ``durable`` (a bank on disk): they are on disk,
        fsynced, before this returns, so a kill right after loses none; when that write fails (a
        full disk) none is queued and :class:`~crl_gym.errors.StorageFault` names the cause."""
        requests = list(requests)
        for r in requests:
            if not isinstance(r, DistillationRequest):
                raise TypeError(f"submit expects a DistillationRequest, got {type(r).__name__}")
        if self._line.closed:
            raise ExperienceUnavailable(
                "ExperienceManager is closed: the requests were not queued (keep them and submit "
                "them again)"
            )
        try:
            self.queue.put_many(requests, durable=durable and self.bank.path is not None)
        except ValueError as exc:
            if not self._line.closed:
                raise
            raise ExperienceUnavailable(
                "ExperienceManager is closed: the requests were not queued (keep them and submit "
                "them again)"
            ) from exc
        except OSError as exc:
            raise _queue_fault(exc, len(requests)) from exc

    def get_requests(self, max_n: int, timeout: float = 0.0) -> list[DistillationRequest]:
        """Up to ``max_n`` oldest requests (FIFO), waiting up to ``timeout`` s for the first."""
        return self.queue.get(max_n, timeout)

    def persist_pending(self) -> int:
        """Write the queued requests still in memory to the bank dir's spill file (called at each
        trainer checkpoint, so a hard kill loses none); returns how many are on disk."""
        return self.queue.persist()

    def snapshot(self, target: Path) -> Path:
        """The bank (:meth:`ExperienceBank.backup`) and the queued requests
        (:meth:`DistillQueue.snapshot`, as ``target/pending_requests.jsonl``) copied into the new
        directory ``target``: a checkpoint's bank. Callers keep writers out meanwhile."""
        self.bank.backup(target)
        self.queue.snapshot(Path(target) / SPILL_FILE)
        return Path(target)

    def restore(self, source: Path) -> None:
        """Inverse of :meth:`snapshot`: the bank and the queue become the copies in ``source``
        (what was written or queued since is dropped); cached candidate pools go with them.
        ``merged_into`` is the caller's to restore (a checkpoint's state holds it)."""
        self.bank.restore(source)
        pending = Path(source) / SPILL_FILE
        if pending.is_file():
            self.queue.restore(pending)
        with self._div_lock:
            self._pools.clear()

    def _persist_loop(self) -> None:
        """Checkpoint the queue every ``persist_interval_s`` when it changed: a SIGKILL of the
        process then loses at most that window of submits (SIGTERM loses none: ``close``)."""
        seen = self.queue.changes
        while not self._stop_persist.wait(self.config.persist_interval_s):
            if self.queue.changes != seen:
                seen = self.queue.changes
                try:
                    self.queue.persist()
                except Exception:  # noqa: BLE001 - a full disk must not stop the service
                    log.exception(
                        "persisting the distillation queue failed (retried next interval)"
                    )
                    seen = -1

    def pending(self) -> int:
        """Requests waiting (in memory and spilled)."""
        return len(self.queue)

    # -- ops -------------------------------------------------------------------------------------
    def apply_ops(
        self,
        ops: Iterable[ExperienceOp],
        *,
        sample: ExtractorSample | None = None,
        step: int = 0,
        request: DistillationRequest | None = None,
        origin: Origin | None = None,
        write: WriteRecord | None = None,
    ) -> ApplyResult:
        """Apply Add/Update/Delete/Return ops in one writer-locked, atomic batch.

        New texts are embedded before the lock is taken; Update/Delete of an id that is not in
        the bank is either *stale* (the entry existed and went since: see ``ApplyResult.stale``) or,
        for an id this bank never had, a counted, logged malformed Return.
        """
        ops = list(ops)
        if self.config.name_task and request is not None:
            ops = [_naming_task(op, request.task) for op in ops]
        res = ApplyResult()
        task = request.task if request is not None else ""
        if self.dedup_similarity is not None:
            ops = self._refuse_near_duplicates(ops, self.dedup_similarity, res, task)
        text_ops = [op for op in ops if isinstance(op, (AddOp, UpdateOp))]
        # An Update keeps the source of the entry it rewrites; an Add (or an Update that
        # becomes one) is distilled from this request's task.
        sources = [self._source_of(op, task) for op in text_ops]
        keys = [
            stored_key(op.text, src, self.config.retrieve_by)
            for op, src in zip(text_ops, sources, strict=True)
        ]
        embedded = [op.text if k is None else k for op, k in zip(text_ops, keys, strict=True)]
        vecs = (
            self.embedder.encode(embedded) if embedded else np.zeros((0, self.bank.dim), np.float32)
        )
        tag = (request.env_id,) if request is not None and request.env_id else ()
        # the extractor's ops (with a sample), not a user's, stay off pinned entries
        pin = sample is not None and self.config.pin_user_entries
        with self.bank.lock.write():
            adds, updates, deletes, vi = [], [], [], 0
            for op in ops:
                if isinstance(op, AddOp):
                    tags = tuple(dict.fromkeys(op.tags + tag))
                    adds.append(
                        PendingAdd(op.text, vecs[vi], step, tags, sample, sources[vi], keys[vi])
                    )
                    vi += 1
                elif isinstance(op, UpdateOp):
                    i, vi = vi, vi + 1
                    # what the advice becomes when it cannot rewrite its entry
                    as_add = PendingAdd(op.text, vecs[i], step, tag, sample, sources[i], keys[i])
                    target = self._current_id(op.id)
                    if pin and self._pinned(target):  # the user's entry stays; advice goes beside
                        res.pinned += 1
                        adds.append(as_add)
                    elif target in self.bank and target not in deletes:
                        updates.append(PendingUpdate(target, op.text, vecs[i], sample, keys[i]))
                        res.updated.append(target)
                        res.stale += target != op.id
                    elif op.id in self.merged_into or self._gone(op.id):
                        # the entry went (merged into one that went too, discarded, pruned)
                        # after the episode saw it: its advice is kept as a new entry
                        res.stale += 1
                        adds.append(as_add)
                    else:
                        self._unknown(res, "update", op.id)
                elif isinstance(op, DeleteOp):
                    if pin and self._pinned(op.id):
                        res.pinned += 1
                    elif op.id in self.bank and op.id not in deletes:
                        deletes.append(op.id)
                    elif self._gone(op.id):
                        res.stale += 1  # already gone: nothing to do
                    else:
                        self._unknown(res, "delete", op.id)
                elif isinstance(op, ReturnOp):
                    res.returned += 1
                    res.malformed += int(op.malformed)
                else:
                    raise TypeError(f"unknown op {op!r}")
            deletes_set = set(deletes)
            updates = [u for u in updates if u.id not in deletes_set]
            res.updated = [u.id for u in updates]
            if origin is None:
                origin = (
                    Origin("user")
                    if sample is None
                    else Origin("extractor", model_step=sample.extractor_version)
                )
            res.deleted = deletes
            if write is not None:  # the bank adds the new entries' ids to it
                write = WriteRecord(write.id, write.kind, {**(write.result or {}), **res.summary()})
            res.added = self.bank.apply_batch(
                adds, updates, deletes, step=step, origin=origin, write=write
            )
        return res

    def _pinned(self, entry_id: int) -> bool:
        entry = self.bank.get(entry_id)
        return entry is not None and is_pinned(entry)

    def _source_of(self, op: AddOp | UpdateOp, task: str) -> str:
        """The task an op's entry is distilled from: an Update's target keeps its own, an Add (or an
        Update of an entry gone since, which becomes an Add) takes the request's."""
        if isinstance(op, UpdateOp):
            target = self.bank.get(self._current_id(op.id))
            if target is not None:
                return target.source
        return task

    def _refuse_near_duplicates(
        self, ops: list[ExperienceOp], threshold: float, res: ApplyResult, task: str
    ) -> list[ExperienceOp]:
        """Drop each Add whose text is within ``threshold`` cosine of a bank entry's text or of an
        Add kept before it in this batch (embeddings are L2-normalised: cosine = dot product).

        The bank's vectors are of the retrieval keys; under the paper's rule a key is the text and
        the bank is searched directly. Under another rule (keyed by task, say) every entry of a task
        shares a key, so the texts of the entries nearest to the new entry's key are embedded and
        compared instead.
        """
        adds = [op for op in ops if isinstance(op, AddOp)]
        if not adds:
            return ops
        vecs = np.asarray(self.embedder.encode([op.text for op in adds]), dtype=np.float32)
        near = self._nearest_texts(adds, vecs, task) if len(self.bank) else [-1.0] * len(adds)
        refused: set[int] = set()
        kept: list[int] = []
        for row, op in enumerate(adds):
            near_batch = any(float(vecs[row] @ vecs[k]) >= threshold for k in kept)
            if near[row] >= threshold or near_batch:
                refused.add(id(op))
                log.info("near-duplicate entry refused (cosine >= %.3f): %.80r", threshold, op.text)
            else:
                kept.append(row)
        res.refused = len(refused)
        return [op for op in ops if id(op) not in refused]

    def _nearest_texts(self, adds: list[AddOp], vecs: np.ndarray, task: str) -> list[float]:
        """Per Add, the highest cosine between its text (row of ``vecs``) and the text of a
        bank entry."""
        by = self.config.retrieve_by
        if by == "text" or not task:
            return [found[0][1] if found else -1.0 for found in self.bank.search(vecs, k=1)]
        keys = self.embedder.encode([retrieval_key(op.text, task, by) for op in adds])
        pools = self.bank.search(np.asarray(keys, np.float32), k=self.config.overfetch)
        out: list[float] = []
        for row, found in enumerate(pools):
            entries = [e for e in self.bank.get_many([i for i, _ in found]) if e is not None]
            texts = (
                np.asarray(self.embedder.encode([e.text for e in entries]), np.float32)
                if entries
                else None
            )
            out.append(float((texts @ vecs[row]).max()) if texts is not None else -1.0)
        return out

    def note_merge(self, merged: dict[int, list[int]]) -> None:
        """Record a Merge's groups (anchor id → its source ids) so Updates of a source reach
        the anchor."""
        for anchor, sources in merged.items():
            for src in sources:
                if src != anchor:
                    self.merged_into[int(src)] = int(anchor)

    def _current_id(self, id_: int) -> int:
        """``id_``, or the entry it was merged into, following merges of merges."""
        seen = {id_}
        while id_ in self.merged_into and id_ not in self.bank:
            id_ = self.merged_into[id_]
            if id_ in seen:  # defensive: a cycle cannot come from merge_bank
                break
            seen.add(id_)
        return id_

    def _gone(self, id_: int) -> bool:
        """Whether ``id_`` was an entry of this bank that has since been deleted (ids only grow)."""
        return self.bank.was_issued(id_) and id_ not in self.bank

    @staticmethod
    def _unknown(res: ApplyResult, what: str, id_: int) -> None:
        log.warning("%s of unknown entry id %s ignored (counted as malformed)", what, id_)
        res.returned += 1
        res.malformed += 1

    # -- housekeeping ----------------------------------------------------------------------------
    def stats(self) -> JSONDict:
        """Counters: requests, batches, cache hits/misses and hit rate, pool hits, queue."""
        c: dict[str, Any] = dict(self._counters)
        looked = c["cache_hits"] + c["cache_misses"]
        c["cache_hit_rate"] = c["cache_hits"] / looked if looked else 0.0
        c["mean_batch"] = c["requests"] / c["batches"] if c["batches"] else 0.0
        c["pending"] = self.pending()
        c["spilled_total"] = self.queue.spilled_total
        c["bank_size"] = len(self.bank)
        return c

    def close(self) -> None:
        """Answer waiting searches, stop the threads, persist counters and the queue."""
        if not self._line.close():
            return
        self._stop_persist.set()
        for t in self._threads:
            t.join()
        try:
            self.bank.flush_stats()
        except (
            StorageFault
        ):  # retrieval counters are statistics: a full disk must not keep the queue from closing
            log.exception("closing the manager: saving retrieval counters failed")
        self.queue.close()

    def __enter__(self) -> ExperienceManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _naming_task(op: ExperienceOp, task: str) -> ExperienceOp:
    """``op`` with its text prefixed by ``task`` (``ManagerConfig.name_task``); other ops unchanged.

    >>> _naming_task(AddOp("Play east."), "Task amber badger.")
    AddOp(text='Task amber badger.\\nPlay east.', tags=(), kind='add')
    """
    if not isinstance(op, (AddOp, UpdateOp)) or not task or op.text.startswith(task):
        return op
    return replace(op, text=f"{task}\n{op.text}")


def _queue_fault(exc: OSError, n: int) -> StorageFault:
    fault = as_fault(exc, f"queueing {n} request{'s' * (n != 1)} for distillation")
    assert fault is not None  # every OSError is a storage error
    return StorageFault(
        f"{fault}; keep {'them' if n != 1 else 'it'} and submit again",
        cause=fault.cause,
        status=fault.status,
    )
