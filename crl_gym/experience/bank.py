"""The experience bank M: a usearch vector index (cosine, f32) plus SQLite (WAL) for the rest.

SQLite is the source of truth; the index is rebuilt from it whenever the index file is missing,
unreadable or out of date (e.g. after a crash). Readers take ``bank.lock.read()``, writers take
``bank.lock.write()`` (writer-preferring), so a search never sees half of an ``apply_batch``.

Files of a persistent bank directory: ``bank.sqlite`` with its ``bank.sqlite-wal`` (the entries;
a consistent backup is both files copied while no bank has the directory open, or
:meth:`ExperienceBank.backup` while one does), ``index.usearch`` + ``index.json`` (a cache,
verified on open and rebuilt from SQLite on any mismatch) and ``bank.lock``. The database
records the embedder the bank was built with (``embedder_name`` and ``dim``); opening it with
another one raises :class:`BankEmbedderError` naming both, since their vectors are not comparable.

One writer per directory: a persistent bank holds an exclusive OS lock (``flock``) on
``DIR/bank.lock`` (which names its PID) from open to :meth:`ExperienceBank.close` or process
exit. Two banks over one directory would each keep their own copy of the entries and their own
vector index, and the second to save would silently undo the first; so a second open, from
this process or another, raises :class:`BankLockedError` and changes nothing.

>>> import numpy as np
>>> bank = ExperienceBank(None, dim=2)
>>> a = bank.add("go north", np.array([1.0, 0.0], np.float32))
>>> b = bank.add("go east", np.array([0.0, 1.0], np.float32))
>>> [[i for i, _ in hits] for hits in bank.search(np.array([[0.9, 0.1]], np.float32), k=2)]
[[1, 2]]
>>> bank.update(a, "go north twice", np.array([1.0, 0.0], np.float32)).history
['go north']
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from crl_gym.experience.bank_counters import BankCounters
from crl_gym.experience.bank_files import (
    DB_FILE,
    LOCK_FILE,
    BankEmbedderError,
    BankLockedError,
    check_embedder,
    lock_directory,
    same_embedder,
    unlock_directory,
)
from crl_gym.experience.entry import ExperienceEntry
from crl_gym.experience.eviction import EVICTIONS, victims
from crl_gym.experience.origin import Origin, OriginRecord
from crl_gym.experience.rwlock import RWLock
from crl_gym.experience.shared_embeddings import SharedEmbeddings
from crl_gym.experience.store import BankCorruptError, EntryEvent, SQLiteStore, WriteRecord
from crl_gym.experience.vector_index import INDEX_FILE, INDEX_META_FILE, VectorIndex
from crl_gym.protocol import ExtractorSample, check_int

log = logging.getLogger(__name__)
MAX_ID = 2**63 - 1  # ids are uint64 restricted to SQLite's native INTEGER range


@dataclass
class PendingAdd:
    """An entry to add in :meth:`ExperienceBank.apply_batch`."""

    text: str
    embedding: np.ndarray
    created_step: int = 0
    tags: tuple[str, ...] = ()
    provenance: ExtractorSample | None = None
    source: str = ""
    """The task the entry was distilled from ("" for none)."""
    key: str | None = None
    """The text ``embedding`` was computed from, when not ``text``
    (:mod:`crl_gym.experience.keys`)."""


@dataclass
class PendingUpdate:
    """A new text (and its embedding) for an existing entry in
    :meth:`ExperienceBank.apply_batch`."""

    id: int
    text: str
    embedding: np.ndarray
    provenance: ExtractorSample | None = None
    key: str | None = None
    """The text ``embedding`` was computed from, when not ``text``; the entry keeps
    its ``source``."""


def _entry_text(text: object, what: str) -> str:
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{what}: text must be a non-empty string, got {text!r:.80}")
    return text


def _source(source: object, what: str) -> str:
    if not isinstance(source, str):
        raise ValueError(f"{what}: source must be a string, got {source!r:.80}")
    return source


def _key(key: object, what: str) -> str | None:
    if key is not None and (not isinstance(key, str) or not key.strip()):
        raise ValueError(f"{what}: key must be a non-empty string or None, got {key!r:.80}")
    return key


def _check_capacity(capacity: int | None, eviction: str) -> tuple[int | None, str]:
    if capacity is not None and (
        isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1
    ):
        raise ValueError(f"capacity must be an integer >= 1 or None, got {capacity!r}")
    if eviction not in EVICTIONS:
        raise ValueError(f"eviction must be one of {EVICTIONS}, got {eviction!r}")
    return capacity, eviction


def _copy(e: ExperienceEntry) -> ExperienceEntry:
    # Embeddings are stored read-only, so copies can share them safely.
    return dataclasses.replace(e, history=list(e.history))


class ExperienceBank(BankCounters):
    """Persistent (``path`` = directory) or in-memory (``path=None``) experience bank."""

    def __init__(
        self,
        path: str | Path | None,
        dim: int,
        *,
        embedder_name: str | None = None,
        create: bool = True,
        capacity: int | None = None,
        eviction: str = "fifo",
    ) -> None:
        """Open (or create) the bank in directory ``path`` (``None``: in memory).

        ``embedder_name`` (e.g. :func:`~crl_gym.experience.embedders.embedder_name` of the embedder
        used with the bank) is recorded in a new bank and checked against an existing one's;
        ``None`` skips the check. ``create=False`` refuses a directory without a bank database
        (``FileNotFoundError``), e.g. on a resume, where an empty bank would silently lose it.
        ``capacity`` / ``eviction``: see :meth:`set_capacity` (None: unbounded).
        """
        if int(dim) <= 0:
            raise ValueError(f"dim must be a positive integer, got {dim!r}")
        self.capacity, self.eviction = _check_capacity(capacity, eviction)
        self.evicted_count = 0
        """Entries this bank object evicted for its capacity (the event log keeps
        every eviction)."""
        self.dim = int(dim)
        self.embedder_name = embedder_name
        self._create = create
        self.path = None if path is None else Path(path)
        self.lock = RWLock()
        self._db_lock = threading.Lock()  # serialises use of the single SQLite connection
        self.index_recoveries: list[str] = []  # why the index had to be rebuilt (logged)
        self._dir_lock: IO[str] | None = None
        if self.path is not None:
            self.path.mkdir(parents=True, exist_ok=True)
            self._dir_lock = lock_directory(self.path)  # before anything in the directory is read
        try:
            self._open_store()
        except BaseException:
            if self._dir_lock is not None:
                unlock_directory(self._dir_lock)
                self._dir_lock = None
            raise

    def _open_store(self, *, rebuild_index: bool = False) -> None:
        self._store = SQLiteStore(
            None if self.path is None else self.path / DB_FILE, create=self._create
        )
        try:
            self.embedder_name = check_embedder(self._store, self.dim, self.embedder_name)
            self._next_id = int(self._store.get_meta("next_id") or 1)
            self._generation = int(self._store.get_meta("generation") or 0)
            self._entries = {e.id: e for e in self._store.load_all(self.dim)}
            self._texts = SharedEmbeddings()  # copies of one text share its vector: see that module
            shared = self._texts.load(self._entries)
            if shared:
                log.info(
                    "%s: %d entries repeat the text of another; they share its vector",
                    self._store.file,
                    len(shared),
                )
                self._entries.update(shared)
        except BaseException:
            self._store.close()
            raise
        self._dirty_stats: set[int] = set()
        self._last_step = self._store.last_event_step()
        # r̄(m) bookkeeping in memory (reward sum, episodes), for ranking and eviction on the
        # hot path
        self._credit = {i: v for i, v in self._store.load_credit().items() if i in self._entries}
        # a reload after a quarantine changed which entries are visible: build, no recovery
        # to report
        self._index = (
            VectorIndex.build(self.dim, self._vectors()) if rebuild_index else self._open_index()
        )
        if self.capacity is not None and len(self._entries) > self.capacity:
            self._evict_now()

    # -- index maintenance (the index is a cache of SQLite: rebuilt, never trusted blindly) ---
    def _vectors(self) -> dict[int, np.ndarray]:
        return {i: e.embedding for i, e in self._entries.items()}  # type: ignore[misc]

    def _open_index(self) -> VectorIndex:
        if self.path is None:
            return VectorIndex.build(self.dim, self._vectors())
        index, reason = VectorIndex.open(self.path, self.dim, self._vectors(), self._generation)
        if reason:
            self._note_recovery(reason)
        return index

    def _rebuild_index(self, reason: str) -> VectorIndex:
        self._note_recovery(reason)
        return VectorIndex.build(self.dim, self._vectors())

    def _note_recovery(self, reason: str) -> None:
        log.warning("rebuilding the vector index from SQLite: %s", reason)
        self.index_recoveries.append(reason)

    def flush(self) -> None:
        """Save the vector index next to the database (atomic replace), so reopening is fast."""
        if self.path is None:
            return
        with self.lock.read():
            self._index.save(self.path, self._generation, self._vectors())

    def backup(self, target: str | Path) -> Path:
        """A consistent copy of this bank in directory ``target`` (created; must not hold a bank),
        taken while the bank stays open: ``bank.sqlite`` with the WAL folded in (the entries and
        their counters), then the index saved for it. Returns ``target``.

        Copying the files of an open bank instead can pair a database with a WAL of another
        moment; see docs/experience.md, "Bank files and backups".
        """
        if self.path is None:
            raise ValueError("backup: an in-memory bank has no files; use export_jsonl")
        target = Path(target)
        if (target / DB_FILE).exists():
            raise FileExistsError(
                f"backup: {target / DB_FILE} exists; back up into a new directory"
            )
        target.mkdir(parents=True, exist_ok=True)
        self.flush_stats()
        with self.lock.read(), self._db_lock:
            self._store.backup(target / DB_FILE)
            self._index.save(target, self._generation, self._vectors())
        return target

    def restore(self, source: str | Path) -> None:
        """Make this open bank the copy :meth:`backup` wrote into ``source``: its entries, counters
        and event log replace the current ones (a training run's rollback to its checkpoint).

        The database is copied with SQLite's online backup into this bank's own connection: one
        transaction, so a kill midway leaves the bank as it was or as restored, never mixed. The
        copy's index files come with it (they match it), then everything in memory is reloaded.
        """
        if self.path is None:
            raise ValueError("restore: an in-memory bank has no files to restore into")
        from crl_gym.experience.store import open_readonly

        source = Path(source)
        src = open_readonly(
            source / DB_FILE, immutable=True
        )  # BankCorruptError naming the file if not a bank
        try:
            with self.lock.write(), self._db_lock:
                src.backup(self._store.conn)
                for name in (INDEX_FILE, INDEX_META_FILE):
                    if (source / name).is_file():  # the copy's index: reopening it needs no rebuild
                        tmp = self.path / (name + ".restore")
                        shutil.copyfile(source / name, tmp)
                        os.replace(tmp, self.path / name)
                self._store.close()
                self._open_store()
        finally:
            src.close()

    # -- provenance and quarantine ------------------------------------------------------------
    def origins(self, ids: Iterable[int]) -> dict[int, OriginRecord]:
        """Who wrote each of ``ids`` and when (:mod:`~crl_gym.experience.origin`): ``{id:
        {written_by, model_step, step, written_at, quarantined}}``; an entry written before the
        bank kept writers is absent."""
        with self._db_lock:
            return self._store.origins(ids)

    def quarantine(
        self,
        written_by: str,
        steps: tuple[int | None, int | None] = (None, None),
        *,
        undo: bool = False,
    ) -> list[int]:
        """Hide (``undo``: bring back) every entry whose current text ``written_by`` wrote at a step
        in ``steps`` (both ends included, ``None`` open; the model step for ``extractor``). Hidden
        entries stay in the database, out of retrieval, listings and writes. Returns their ids.

        >>> import numpy as np
        >>> from crl_gym.experience.origin import Origin
        >>> bank = ExperienceBank(None, dim=2)
        >>> a = bank.add("go north", np.array([1.0, 0.0], np.float32))
        >>> b = bank.apply_batch([PendingAdd("jump", np.array([0.0, 1.0], np.float32))],
        ...                      origin=Origin("extractor", model_step=7))[0]
        >>> bank.quarantine("extractor", (5, 9)), bank.ids()
        ([2], [1])
        >>> bank.quarantine("extractor", (5, 9), undo=True), bank.ids()
        ([2], [1, 2])
        """
        Origin.parse_writer(written_by)
        self.flush_stats()
        with self.lock.write(), self._db_lock:
            gen = self._generation + 1
            with self._storage(f"{'un' if undo else ''}quarantining what {written_by} wrote"):
                ids = self._store.set_quarantined(written_by, steps, not undo, {"generation": gen})
            self._generation = (
                gen  # stored even when nothing matched: memory must agree with the file
            )
            if ids:
                if self.path is None:  # nothing to reopen: the memory is the bank
                    self._reload_in_memory()
                else:
                    self._store.close()
                    self._open_store(rebuild_index=True)
        log.info(
            "bank %s: %s %d entries written by %s (steps %s)",
            self.path,
            "restored" if undo else "quarantined",
            len(ids),
            written_by,
            steps,
        )
        return ids

    def find_writes(self, ids: Sequence[str]) -> dict[str, WriteRecord]:
        """The client writes among ``ids`` this bank remembers as applied
        (:mod:`~crl_gym.experience.write_ids`)."""
        with self._db_lock:
            return self._store.find_writes(ids)

    def record_writes(self, writes: Iterable[WriteRecord]) -> None:
        """Remember ``writes`` as applied (:class:`~crl_gym.errors.StorageFault` when it cannot)."""
        with self._db_lock, self._storage("remembering write ids"):
            self._store.record_writes(writes)

    def quarantined_count(self) -> int:
        with self._db_lock:
            return self._store.quarantined_count()

    def _reload_in_memory(self) -> None:
        """An in-memory bank's entries and index, reloaded from its own database."""
        self._entries = {e.id: e for e in self._store.load_all(self.dim)}
        self._texts = SharedEmbeddings()
        self._entries.update(self._texts.load(self._entries))
        self._credit = {i: v for i, v in self._store.load_credit().items() if i in self._entries}
        self._index = VectorIndex.build(self.dim, self._vectors())

    # -- validation --------------------------------------------------------------------------
    def _vector(self, emb: Any, what: str) -> np.ndarray:
        v = np.asarray(emb, dtype=np.float32).reshape(-1)
        if v.shape != (self.dim,):
            raise ValueError(f"{what}: embedding has dim {v.size}, the bank's dim is {self.dim}")
        if not np.all(np.isfinite(v)) or not np.any(v):
            raise ValueError(f"{what}: embedding must be finite and non-zero")
        v = v.copy()
        v.flags.writeable = False
        return v

    # -- writes ------------------------------------------------------------------------------
    def _commit(
        self,
        upserts: list[ExperienceEntry],
        deletes: list[int],
        next_id: int,
        events: Sequence[EntryEvent] = (),
        *,
        origins: Mapping[int, tuple[Origin, int]] | None = None,
        write: WriteRecord | None = None,
    ) -> None:
        """Durably write, then swap into memory and the index, all under the writer lock. A write
        that cannot be made durable raises :class:`~crl_gym.errors.StorageFault` and
        changes nothing."""
        with self.lock.write():
            gen = self._generation + 1
            with (
                self._db_lock,
                self._storage(f"writing {len(upserts)} entries and {len(deletes)} deletions"),
            ):
                self._store.commit(
                    upserts,
                    deletes,
                    {"next_id": next_id, "generation": gen},
                    events,
                    origins=origins,
                    write=write,
                )
            self._generation, self._next_id = gen, next_id
            try:
                stale = [e.id for e in upserts if e.id in self._entries] + deletes
                self._index.replace(stale, {e.id: e.embedding for e in upserts})  # type: ignore[misc]
            except Exception as exc:  # SQLite holds the truth: rebuild rather than diverge
                for i in deletes:
                    self._entries.pop(i, None)
                self._entries.update({e.id: e for e in upserts})
                self._index = self._rebuild_index(f"index update failed ({exc})")
                return
            for i in deletes:
                self._entries.pop(i, None)
            self._entries.update({e.id: e for e in upserts})

    def apply_batch(
        self,
        adds: Sequence[PendingAdd | Mapping[str, Any]] = (),
        updates: Sequence[PendingUpdate | Mapping[str, Any]] = (),
        deletes: Iterable[int] = (),
        *,
        step: int | None = None,
        merged: Mapping[int, Sequence[int]] | None = None,
        origin: Origin | None = None,
        write: WriteRecord | None = None,
    ) -> list[int]:
        """Apply adds, updates and deletes atomically; returns the new ids of ``adds`` in order.

        ``origin``: who writes the added and updated entries (:mod:`~crl_gym.experience.origin`;
        default ``user``, or ``merge`` for a Merge), recorded per entry. ``write``: the id of the
        client's call, remembered in the same transaction (its ``result`` gains ``added_ids``), so a
        retry of it is known to be applied (:mod:`~crl_gym.experience.write_ids`).

        Everything is validated first (unknown ids, dims), so a bad item changes nothing. Each
        change is logged in the entry-event table in the same transaction, at ``step`` (an Add
        without one: its ``created_step``; otherwise the latest step logged). ``merged`` (a Merge's
        anchor id → its source ids) marks the batch as a Merge: its updates are ``merge`` events,
        its deletes ``merged_away`` (a source) or ``discard``.
        """
        with self.lock.write():
            adds_ = [a if isinstance(a, PendingAdd) else PendingAdd(**a) for a in adds]
            upds = [u if isinstance(u, PendingUpdate) else PendingUpdate(**u) for u in updates]
            dels = [int(i) for i in deletes]
            for i in dels:
                if i not in self._entries:
                    raise KeyError(f"delete: no entry with id {i}")
            upserts: list[ExperienceEntry] = []
            touched: dict[int, ExperienceEntry] = {}
            for n, u in enumerate(upds):
                if u.id in dels or (u.id not in self._entries and u.id not in touched):
                    raise KeyError(f"updates[{n}]: no entry with id {u.id}")
                old = touched.get(u.id) or self._entries[u.id]
                new = dataclasses.replace(
                    old,
                    text=_entry_text(u.text, f"updates[{n}]"),
                    embedding=self._vector(u.embedding, f"updates[{n}]"),
                    version=old.version + 1,
                    history=[*old.history, old.text],
                    provenance=u.provenance if u.provenance is not None else old.provenance,
                    key=_key(u.key, f"updates[{n}]"),
                )
                touched[u.id] = new
            upserts.extend(touched.values())
            next_id, new_ids = self._next_id, []
            for n, a in enumerate(adds_):
                tags = (a.tags,) if isinstance(a.tags, str) else tuple(a.tags)
                if not all(isinstance(t, str) for t in tags):
                    raise ValueError(f"adds[{n}]: tags must be strings, got {a.tags!r}")
                upserts.append(
                    ExperienceEntry(
                        id=next_id,
                        text=_entry_text(a.text, f"adds[{n}]"),
                        embedding=self._vector(a.embedding, f"adds[{n}]"),
                        created_step=check_int(a.created_step, f"adds[{n}].created_step"),
                        tags=tags,
                        provenance=a.provenance,
                        source=_source(a.source, f"adds[{n}]"),
                        key=_key(a.key, f"adds[{n}]"),
                    )
                )
                new_ids.append(next_id)
                next_id += 1
            if next_id > MAX_ID:
                raise OverflowError("the bank ran out of ids")
            evicted = self._victims(len(new_ids) - len(dels), exclude={*dels, *touched})
            dels += evicted
            # a batch that alone adds more than the bank holds: its own first adds go too,
            # never stored
            surplus = (
                set(new_ids[: len(self._entries) + len(new_ids) - len(dels) - self.capacity])
                if self.capacity is not None
                else set()
            )
            stillborn = [e for e in upserts if e.id in surplus]
            upserts = [e for e in upserts if e.id not in surplus]
            upserts = self._texts.share(upserts, self._entries, gone={*dels, *touched})
            replaced = [self._entries[i] for i in (*touched, *dels)]
            events = self._events(upserts, touched, dels, step, merged, evicted=set(evicted))
            for (
                e
            ) in stillborn:  # added and evicted in one batch: both logged, so the history adds up
                at = e.created_step if step is None else int(step)
                events += [
                    EntryEvent(e.id, at, "add", e.version),
                    EntryEvent(
                        e.id,
                        at,
                        "evict",
                        e.version,
                        detail={"text": e.text, "rule": self.eviction, "never_stored": True},
                    ),
                ]
            if origin is None:
                origin = Origin("merge" if merged is not None else "user")
            if write is not None:
                write = WriteRecord(
                    write.id, write.kind, {**(write.result or {}), "added_ids": new_ids}
                )
            at = self._last_step if step is None else int(step)
            # the step of the write: an Add without one is written at its created_step, as its event
            origins = {
                e.id: (origin, e.created_step if step is None and e.id not in touched else at)
                for e in upserts
            }
            self._commit(upserts, dels, next_id, events, origins=origins, write=write)
            evicted += [e.id for e in stillborn]
            self._texts.removed(replaced)
            self._texts.added(upserts)
            for i in dels:
                self._credit.pop(i, None)
            self.evicted_count += len(evicted)
            self._last_step = max([self._last_step, *(e.step for e in events)])
            return new_ids

    # -- capacity ----------------------------------------------------------------------------
    def set_capacity(self, capacity: int | None, eviction: str = "fifo") -> list[int]:
        """Bound the bank to ``capacity`` entries (None: unbounded): an ``apply_batch`` that would
        hold more evicts, in the same transaction, the entries ``eviction`` picks
        (:mod:`crl_gym.experience.eviction`: ``fifo`` or ``least_useful``) among those the batch
        does not touch, each logged as an ``evict`` event (a batch that alone adds more than
        ``capacity`` gives up its own first adds too: ``detail.never_stored``). A bank already
        over the new capacity evicts now. Returns the ids evicted now.

        The bound is not stored in the bank: whoever opens it sets it (the manager, from
        ``ManagerConfig.bank_capacity``), so a restart with the same config keeps the same bound.
        """
        with self.lock.write():
            self.capacity, self.eviction = _check_capacity(capacity, eviction)
            return self._evict_now()

    def _evict_now(self) -> list[int]:
        """Evict down to capacity in one batch (no adds); returns the ids evicted."""
        if self.capacity is None or len(self._entries) <= self.capacity:
            return []
        before = set(self._entries)
        self.apply_batch()
        return sorted(before - set(self._entries))

    def _victims(self, growth: int, exclude: set[int]) -> list[int]:
        """Entries to evict so that the bank, grown by ``growth`` entries, holds at
        most ``capacity``."""
        if self.capacity is None:
            return []
        over = len(self._entries) + growth - self.capacity
        if over <= 0:
            return []
        candidates = [i for i in self._entries if i not in exclude]
        if over > len(candidates):
            log.warning(
                "bank capacity %d: one batch adds %d entries more than the bank can hold; its "
                "first adds are evicted",
                self.capacity,
                over - len(candidates),
            )
        return victims(
            self.eviction, candidates, min(over, len(candidates)), self.credit_stats(candidates)
        )

    def _events(
        self,
        upserts: list[ExperienceEntry],
        touched: Mapping[int, ExperienceEntry],
        dels: list[int],
        step: int | None,
        merged: Mapping[int, Sequence[int]] | None,
        evicted: AbstractSet[int] = frozenset(),
    ) -> list[EntryEvent]:
        """The entry-event rows of one ``apply_batch`` (see
        :data:`~crl_gym.experience.store.EVENT_KINDS`)."""
        at = self._last_step if step is None else int(step)
        into = {
            int(s): int(a) for a, srcs in (merged or {}).items() for s in srcs if int(s) != int(a)
        }
        out: list[EntryEvent] = []
        for e in upserts:
            if e.id not in touched:
                out.append(
                    EntryEvent(e.id, e.created_step if step is None else at, "add", e.version)
                )
            elif merged is not None and e.id in merged:
                out.append(
                    EntryEvent(
                        e.id,
                        at,
                        "merge",
                        e.version,
                        detail={"sources": sorted(int(x) for x in merged[e.id])},
                    )
                )
            else:
                out.append(EntryEvent(e.id, at, "update", e.version))
        for i in dels:
            old = self._entries[i]
            kind = (
                "evict"
                if i in evicted
                else "merged_away"
                if i in into
                else "discard"
                if merged is not None
                else "delete"
            )
            detail: dict[str, Any] = {"text": old.text}
            if i in evicted:
                detail["rule"] = self.eviction
            if i in into:
                detail["into"] = into[i]
            out.append(EntryEvent(i, at, kind, old.version, detail=detail))
        return out

    def read_sql(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Rows of one read-only query on the bank's own connection (an in-memory bank has no file
        for a reader of its own to open); a statement that would write is refused by SQLite."""
        with self._db_lock:
            conn = self._store.conn
            conn.execute("PRAGMA query_only=ON")
            try:
                return [tuple(r) for r in conn.execute(sql, tuple(params)).fetchall()]
            finally:
                conn.execute("PRAGMA query_only=OFF")

    def add(
        self,
        text: str,
        embedding: np.ndarray,
        *,
        created_step: int = 0,
        tags: Iterable[str] = (),
        provenance: ExtractorSample | None = None,
        source: str = "",
        key: str | None = None,
    ) -> int:
        """Add one entry; returns its id. ``embedding`` is of ``key`` when given, else
        of ``text``."""
        return self.apply_batch(
            [PendingAdd(text, embedding, created_step, tuple(tags), provenance, source, key)]
        )[0]

    def update(
        self,
        id: int,
        text: str,
        embedding: np.ndarray,
        *,
        provenance: ExtractorSample | None = None,
    ) -> ExperienceEntry:
        """New text for ``id``: version + 1, the old text appended to ``history``."""
        with self.lock.write():
            self.apply_batch(updates=[PendingUpdate(int(id), text, embedding, provenance)])
            return _copy(self._entries[int(id)])

    def delete(self, id: int) -> None:
        """Remove ``id`` (``KeyError`` if absent). Ids are never reused."""
        self.apply_batch(deletes=[int(id)])

    # -- reads -------------------------------------------------------------------------------
    def get(self, id: int) -> ExperienceEntry | None:
        """A copy of entry ``id`` or None."""
        with self.lock.read():
            e = self._entries.get(int(id))
            return None if e is None else _copy(e)

    def get_many(self, ids: Iterable[int]) -> list[ExperienceEntry | None]:
        """Copies of several entries taken under one read lock (a consistent snapshot)."""
        with self.lock.read():
            return [None if (e := self._entries.get(int(i))) is None else _copy(e) for i in ids]

    def was_issued(self, id: int) -> bool:
        """Whether ``id`` was ever given to an entry of this bank (ids grow and are
        never reused)."""
        return 0 < int(id) < self._next_id

    def search(self, vectors: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
        """Top-``k`` (id, cosine similarity) per query row, best first; ``[]`` rows on an
        empty bank."""
        q = np.asarray(vectors, dtype=np.float32)
        if q.ndim == 1:
            q = q[None, :]
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise ValueError(f"search: queries have shape {q.shape}, expected (n, {self.dim})")
        if k < 1:
            raise ValueError(f"search: k must be >= 1, got {k}")
        with self.lock.read():
            return self._index.search(q, k)

    def ids(self) -> list[int]:
        with self.lock.read():
            return sorted(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, id: object) -> bool:
        return id in self._entries

    def __iter__(self) -> Iterator[ExperienceEntry]:
        """Copies of all entries in id order, from one consistent snapshot."""
        with self.lock.read():
            snapshot = [_copy(self._entries[i]) for i in sorted(self._entries)]
        return iter(snapshot)

    @property
    def generation(self) -> int:
        """Write counter: changes whenever entries or vectors change (not on counters)."""
        return self._generation

    # -- JSONL ---------------------------------------------------------------------------------
    def export_jsonl(self, path: str | Path) -> int:
        """Write every entry (with embedding) as one JSON object per line; returns the count."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        entries = list(self)
        with open(tmp, "w", encoding="utf-8") as f:
            for e in entries:
                f.write(json.dumps(e.to_dict(), ensure_ascii=False) + "\n")
        os.replace(tmp, path)
        return len(entries)

    def import_jsonl(self, path: str | Path) -> int:
        """Insert or replace the entries of a JSONL export, all in one transaction.

        Errors name the file and line; a bad line imports nothing.
        """
        path = Path(path)
        entries: list[ExperienceEntry] = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    e = ExperienceEntry.from_dict(json.loads(line))
                    if e.id > MAX_ID:
                        raise ValueError(f"id {e.id} exceeds {MAX_ID}")
                    e.embedding = self._vector(e.embedding, "embedding")
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{lineno}: {exc}") from exc
                entries.append(e)
        with self.lock.write():
            next_id = max([self._next_id] + [e.id + 1 for e in entries])
            replaced = [self._entries[e.id] for e in entries if e.id in self._entries]
            entries = self._texts.share(entries, self._entries, gone={e.id for e in entries})
            imported = Origin("import")
            self._commit(
                entries, [], next_id, origins={e.id: (imported, self._last_step) for e in entries}
            )
            self._texts.removed(replaced)
            self._texts.added(entries)
        return len(entries)

    def close(self) -> None:
        """Save the index, close the database and release the directory's lock. Idempotent."""
        if getattr(self, "_closed", False):
            return
        try:
            # Counters and the index are statistics and a cache: failing to save them (a full
            # disk) must not keep the database, which holds every acknowledged write, from closing.
            for save in (self.flush_stats, self.flush):
                try:
                    save()
                except Exception:  # noqa: BLE001 - logged; the close goes on
                    log.exception("bank %s: close: %s failed", self.path, save.__name__)
            with self.lock.write(), self._db_lock:
                self._store.close()
                self._closed = True
        finally:
            if (
                self._dir_lock is not None
            ):  # released even when saving failed: the process may go on
                unlock_directory(self._dir_lock)
                self._dir_lock = None

    def __enter__(self) -> ExperienceBank:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ExperienceBank(path={str(self.path)!r}, dim={self.dim}, entries={len(self)})"


__all__ = [
    "DB_FILE",
    "INDEX_FILE",
    "INDEX_META_FILE",
    "LOCK_FILE",
    "BankCorruptError",
    "BankEmbedderError",
    "BankLockedError",
    "ExperienceBank",
    "PendingAdd",
    "PendingUpdate",
    "same_embedder",
]
