"""SQLite (WAL) persistence of bank entries: the durable source of truth of the bank.

The vector index is derived data; it can always be rebuilt from the ``embedding`` column here.

A database file is a bank only if it says so: it is created whole (schema and a ``format`` mark,
built beside it and renamed in), so a zero-length file, an SQLite file of something else, or a
``-wal`` left without its database is refused with :class:`BankCorruptError`, never opened as a
new, empty bank over the entries it should hold.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from crl_gym.experience.entry import ExperienceEntry
from crl_gym.experience.origin import Origin, OriginRecord
from crl_gym.protocol import ExtractorSample

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY,
    text TEXT NOT NULL,
    embedding BLOB NOT NULL,
    version INTEGER NOT NULL,
    created_step INTEGER NOT NULL,
    retrieval_count INTEGER NOT NULL,
    last_retrieved REAL NOT NULL,
    train_count INTEGER NOT NULL,
    last_trained_step INTEGER NOT NULL,
    utility REAL NOT NULL,
    tags TEXT NOT NULL,
    provenance TEXT,
    history TEXT NOT NULL,
    source TEXT NOT NULL DEFAULT '',
    key TEXT
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
# What an entry went through, for the explorer (crl_gym/explorer). Added beside the entries with
# IF NOT EXISTS, so a bank written before them opens as it was and gains them on its next write
# open. ``entry_credit`` folds the ``credit`` events per entry in the bank: r̄(m) over every credited
# episode (its sum and count), kept as a row so the bank view can sort by it at 100k entries; a
# deleted entry's row goes with it (its events keep its credits). ``entries_id`` is a narrow copy of
# the id order: a page deep in id order walks it instead of the wide rows.
_EVENTS_SCHEMA = """
CREATE TABLE IF NOT EXISTS entry_events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    entry_id INTEGER NOT NULL,
    step INTEGER NOT NULL,
    kind TEXT NOT NULL,
    version INTEGER,
    value REAL,
    n INTEGER,
    detail TEXT
);
CREATE INDEX IF NOT EXISTS entry_events_entry ON entry_events(entry_id, seq);
CREATE INDEX IF NOT EXISTS entry_events_step ON entry_events(step, kind);
CREATE TABLE IF NOT EXISTS entry_credit (
    entry_id INTEGER PRIMARY KEY,
    reward_sum REAL NOT NULL,
    episodes INTEGER NOT NULL,
    steps INTEGER NOT NULL,
    last_step INTEGER NOT NULL,
    rbar REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS entry_credit_rbar ON entry_credit(rbar);
CREATE INDEX IF NOT EXISTS entry_credit_episodes ON entry_credit(episodes);
CREATE INDEX IF NOT EXISTS entries_id ON entries(id);
CREATE INDEX IF NOT EXISTS entries_created_step ON entries(created_step);
CREATE INDEX IF NOT EXISTS entries_retrieval_count ON entries(retrieval_count);
CREATE INDEX IF NOT EXISTS entries_train_count ON entries(train_count);
CREATE INDEX IF NOT EXISTS entries_last_trained_step ON entries(last_trained_step);
CREATE INDEX IF NOT EXISTS entries_version ON entries(version);
CREATE INDEX IF NOT EXISTS entries_utility ON entries(utility);
"""
# Who wrote each entry's current text (crl_gym.experience.origin), and the ids of the writes
# already applied (crl_gym.experience.write_ids). Tables of their own, added with IF NOT EXISTS
# like the event log: a bank written before them opens as it was.
_WRITES_SCHEMA = """
CREATE TABLE IF NOT EXISTS entry_origin (
    entry_id INTEGER PRIMARY KEY,
    written_by TEXT NOT NULL,
    model_step INTEGER,
    step INTEGER NOT NULL,
    written_at REAL NOT NULL,
    quarantined INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS entry_origin_writer ON entry_origin(written_by, quarantined);
CREATE TABLE IF NOT EXISTS write_ids (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    at REAL NOT NULL,
    result TEXT
);
CREATE INDEX IF NOT EXISTS write_ids_at ON write_ids(at);
"""
_VISIBLE = "id NOT IN (SELECT entry_id FROM entry_origin WHERE quarantined = 1)"
"""The entries not quarantined (``WHERE`` clause on ``entries``)."""
WRITE_ID_KEEP_S = 7 * 24 * 3600.0
"""How long the id of an applied write is remembered (a retry later than this applies again)."""
WRITE_ID_KEEP = 1_000_000
"""The most write ids remembered (the oldest go first, a little beyond this number)."""
EVENT_KINDS = ("add", "update", "merge", "merged_away", "discard", "delete", "evict", "credit")
"""``entry_events.kind``: an Add, an Update, a Merge that produced the entry (``detail.sources``),
a Merge that folded it into another (``detail.into``) or discarded it, a Delete (an EDGE prune, an
op), an eviction by the bank's capacity (``detail.rule``), and a step's credit (``value`` = r̄(m)
of the step, ``n`` = its episodes)."""
_COLUMNS = (
    "id, text, embedding, version, created_step, retrieval_count, last_retrieved, "
    "train_count, last_trained_step, utility, tags, provenance, history, source, key"
)
_ADDED_COLUMNS = {"source": "TEXT NOT NULL DEFAULT ''", "key": "TEXT"}
"""Columns added to ``entries`` after banks were first written, in order: a bank without them
gains them (as empty) when it is opened for writing, and is read as if it had them."""
FORMAT = "crl-experience-bank"
"""``meta.format`` of every bank database (banks written before the mark existed get it on open)."""
WAL_SUFFIXES = ("-wal", "-shm")


class BankCorruptError(RuntimeError):
    """A bank file cannot be read, or is not a bank; the message names the file."""


def _sidecar(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _check_file(path: Path, create: bool) -> None:
    """Refuse what SQLite would silently open as a new, empty database."""
    wal = _sidecar(path, "-wal")
    if path.exists():
        if path.stat().st_size == 0:
            raise BankCorruptError(
                f"{path} is empty (0 bytes): it is not a bank, and opening it would start a new, "
                "empty one. Restore bank.sqlite (with its -wal, if the backup has one) from a "
                "backup; to start an empty bank on purpose, delete "
                f"{path.name}{' and ' + wal.name if wal.exists() else ''}"
            )
        return
    if wal.exists() and wal.stat().st_size > 0:
        raise BankCorruptError(
            f"{path} is missing but {wal.name} is there: the database was removed without its "
            f"write-ahead log. Restore {path.name} from a backup, or delete {wal.name} and "
            f"{_sidecar(path, '-shm').name} to start an empty bank"
        )
    if not create:
        raise FileNotFoundError(f"{path} does not exist: there is no bank here to open")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create(path: Path) -> None:
    """A new, empty bank database at ``path``, atomically: built as ``NAME.new``, then renamed."""
    tmp = _sidecar(path, ".new")
    for leftover in (tmp, *(_sidecar(tmp, s) for s in WAL_SUFFIXES)):
        leftover.unlink(missing_ok=True)  # from a crash during an earlier creation
    conn = sqlite3.connect(str(tmp), isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")  # persistent: stored in the file's header
        conn.executescript(
            f"BEGIN; {_SCHEMA} {_EVENTS_SCHEMA} {_WRITES_SCHEMA} INSERT INTO meta(key, value) "
            f"VALUES ('format', '{FORMAT}'); COMMIT;"
        )
    finally:
        conn.close()  # the last connection checkpoints the WAL into the file and removes it
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _check_schema(conn: sqlite3.Connection, file: Path | str) -> None:
    """Refuse an SQLite database that is not a bank; mark a bank written before ``meta.format``."""
    tables = sorted(r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'"))
    if not {"entries", "meta"} <= set(tables):
        raise BankCorruptError(
            f"{file}: an SQLite database, but not an experience bank (its tables: "
            f"{', '.join(tables) or 'none'}); point the bank at its own directory"
        )
    have = [r[1] for r in conn.execute("PRAGMA table_info(entries)")]
    base = [c.strip() for c in _COLUMNS.split(",")]
    missing = base[len(have) :]
    if have != base[: len(have)] or not set(missing) <= set(_ADDED_COLUMNS):
        raise BankCorruptError(
            f"{file}: table 'entries' has the columns ({', '.join(have)}), not a bank's "
            f"({_COLUMNS})"
        )
    for name in missing:  # a bank written before these columns existed
        conn.execute(f"ALTER TABLE entries ADD COLUMN {name} {_ADDED_COLUMNS[name]}")
    row = conn.execute("SELECT value FROM meta WHERE key='format'").fetchone()
    if row is None:
        conn.execute("INSERT INTO meta(key, value) VALUES ('format', ?)", (FORMAT,))
    elif row[0] != FORMAT:
        raise BankCorruptError(f"{file}: meta.format is {row[0]!r}, not {FORMAT!r}")


def _row(e: ExperienceEntry) -> tuple[Any, ...]:
    if e.embedding is None:  # the index is rebuilt from this column: it must be there
        raise ValueError(f"entry {e.id}: cannot store an entry without an embedding")
    return (
        e.id,
        e.text,
        np.ascontiguousarray(e.embedding, dtype=np.float32).tobytes(),
        e.version,
        e.created_step,
        e.retrieval_count,
        e.last_retrieved,
        e.train_count,
        e.last_trained_step,
        e.utility,
        json.dumps(list(e.tags)),
        json.dumps(e.provenance.to_dict()) if e.provenance else None,
        json.dumps(e.history),
        e.source,
        e.key,
    )


def _entry(row: Sequence[Any], dim: int, file: Path | str) -> ExperienceEntry:
    emb = np.frombuffer(row[2], dtype=np.float32)
    if emb.shape != (dim,):
        raise BankCorruptError(
            f"{file}: entry {row[0]} has an embedding of {emb.size} floats, expected dim {dim}"
        )
    emb.flags.writeable = False
    return ExperienceEntry(
        id=int(row[0]),
        text=row[1],
        embedding=emb,
        version=int(row[3]),
        created_step=int(row[4]),
        retrieval_count=int(row[5]),
        last_retrieved=float(row[6]),
        train_count=int(row[7]),
        last_trained_step=int(row[8]),
        utility=float(row[9]),
        tags=tuple(json.loads(row[10])),
        provenance=ExtractorSample.from_dict(json.loads(row[11])) if row[11] else None,
        history=list(json.loads(row[12])),
        source=row[13] or "",
        key=row[14],
    )


@dataclass(frozen=True)
class WriteRecord:
    """The id of one client write (a submit's request, an ``apply_ops`` call), stored with its
    answer so that a retry of the same id gets the same answer without applying it again."""

    id: str
    kind: str
    result: dict[str, Any] | None = None


@dataclass(frozen=True)
class EntryEvent:
    """One row of ``entry_events`` (see :data:`EVENT_KINDS`)."""

    entry_id: int
    step: int
    kind: str
    version: int | None = None
    value: float | None = None
    n: int | None = None
    detail: dict[str, Any] | None = None


def _insert_events(c: sqlite3.Connection, events: Iterable[EntryEvent]) -> None:
    c.executemany(
        "INSERT INTO entry_events(entry_id, step, kind, version, value, n, detail) VALUES (?, ?, "
        "?, ?, ?, ?, ?)",
        [
            (
                e.entry_id,
                int(e.step),
                e.kind,
                e.version,
                e.value,
                e.n,
                None if e.detail is None else json.dumps(e.detail, ensure_ascii=False),
            )
            for e in events
        ],
    )


def open_readonly(path: Path, *, immutable: bool = False) -> sqlite3.Connection:
    """A read-only connection to the bank database at ``path`` (a reader beside the bank's writer:
    WAL lets both run; nothing it does can change the file). ``immutable``: a copy no writer has
    open (a checkpoint's), read without creating the ``-shm`` / ``-wal`` files beside it.
    :class:`BankCorruptError` if it is not a bank."""
    if not path.is_file() or path.stat().st_size == 0:
        raise BankCorruptError(f"{path}: no bank database here")
    try:
        mode = "mode=ro&immutable=1" if immutable else "mode=ro"
        conn = sqlite3.connect(
            f"{path.resolve().as_uri()}?{mode}", uri=True, check_same_thread=False
        )
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as exc:
        raise BankCorruptError(f"{path}: not a readable bank database ({exc})") from exc
    if not {"entries", "meta"} <= tables:
        conn.close()
        raise BankCorruptError(f"{path}: an SQLite database, but not an experience bank")
    return conn


def verify_bank_copy(directory: Path) -> None:
    """Check the bank copy in ``directory`` (a checkpoint's ``bank/``) before it replaces a bank:
    :class:`BankCorruptError` naming the file when it is missing, not a bank, or fails SQLite's
    ``quick_check``."""
    path = Path(directory) / "bank.sqlite"
    conn = open_readonly(path, immutable=True)
    try:
        result = conn.execute("PRAGMA quick_check").fetchone()
    except sqlite3.DatabaseError as exc:
        raise BankCorruptError(f"{path}: not a readable bank database ({exc})") from exc
    finally:
        conn.close()
    if not result or result[0] != "ok":
        raise BankCorruptError(
            f"{path}: damaged ({result[0] if result else 'no answer'} from quick_check)"
        )


def _selected(conn: sqlite3.Connection) -> str:
    """The SELECT list of every entry column, with the default of a column an older bank lacks
    (a read-only reader cannot add it)."""
    have = {r[1] for r in conn.execute("PRAGMA table_info(entries)")}
    defaults = {"source": "''", "key": "NULL"}
    return ", ".join(
        c if c in have else defaults[c] for c in (c.strip() for c in _COLUMNS.split(","))
    )


def has_table(conn: sqlite3.Connection, name: str) -> bool:
    return (
        conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (name,)
        ).fetchone()
        is not None
    )


def read_entries(conn: sqlite3.Connection, dim: int, file: Path | str) -> list[ExperienceEntry]:
    """Every entry of the bank behind ``conn`` (e.g. :func:`open_readonly`) that is not
    quarantined, in id order."""
    where = f"WHERE {_VISIBLE}" if has_table(conn, "entry_origin") else ""
    try:
        return [
            _entry(r, dim, file)
            for r in conn.execute(f"SELECT {_selected(conn)} FROM entries {where} ORDER BY id")
        ]
    except (sqlite3.DatabaseError, ValueError, TypeError) as exc:
        raise BankCorruptError(f"{file}: cannot read entries ({exc})") from exc


class SQLiteStore:
    """Thin wrapper over one SQLite connection; callers serialise access (the bank's locks)."""

    def __init__(self, path: Path | None, *, create: bool = True) -> None:
        """Open the bank database at ``path`` (``None``: in memory), creating it when absent unless
        ``create`` is False (then ``FileNotFoundError``). A file that is not a bank raises
        :class:`BankCorruptError` naming it."""
        self.file: Path | str = path if path is not None else ":memory:"
        self._writes_since_trim = 0
        if path is not None:
            _check_file(path, create)
            if not path.exists():
                _create(path)
        try:
            self.conn = sqlite3.connect(
                str(self.file), check_same_thread=False, isolation_level=None
            )
        except sqlite3.Error as exc:
            raise BankCorruptError(f"{self.file}: cannot open the bank database ({exc})") from exc
        try:
            if path is None:
                self.conn.executescript(_SCHEMA)
            _check_schema(
                self.conn, self.file
            )  # before any write: a foreign file is left as it was
            self.conn.executescript(_EVENTS_SCHEMA)  # a bank written before the event log gains it
            self.conn.executescript(_WRITES_SCHEMA)  # and the writers' tables
            if path is not None:
                self.conn.execute("PRAGMA journal_mode=WAL")
                # NORMAL in WAL mode: a committed transaction survives a process kill.
                self.conn.execute("PRAGMA synchronous=NORMAL")
            check = self.conn.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise BankCorruptError(
                    f"{self.file}: database failed its integrity check ({check})"
                )
        except BaseException as exc:
            self.conn.close()
            if isinstance(exc, sqlite3.DatabaseError):
                raise BankCorruptError(
                    f"{self.file}: not a readable bank database ({exc})"
                ) from exc
            raise

    # -- meta --------------------------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        row = self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: object) -> None:
        self.conn.execute(
            "INSERT INTO meta(key, value) VALUES(?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            (key, str(value)),
        )

    # -- entries -----------------------------------------------------------------------------
    def load_all(self, dim: int) -> list[ExperienceEntry]:
        try:
            rows = self.conn.execute(
                f"SELECT {_COLUMNS} FROM entries WHERE {_VISIBLE} ORDER BY id"
            ).fetchall()
            return [_entry(r, dim, self.file) for r in rows]
        except (sqlite3.DatabaseError, ValueError, TypeError) as exc:
            raise BankCorruptError(f"{self.file}: cannot read entries ({exc})") from exc

    def commit(
        self,
        upserts: Iterable[ExperienceEntry],
        deletes: Iterable[int],
        meta: dict[str, object],
        events: Iterable[EntryEvent] = (),
        *,
        origins: Mapping[int, tuple[Origin, int]] | None = None,
        write: WriteRecord | None = None,
    ) -> None:
        """Write everything in one transaction (the entries' events, the writer of each entry in
        ``origins`` as ``{id: (origin, step)}``, and the id of the client's ``write``): all of it
        lands, or none of it."""
        with self._transaction() as c:
            c.executemany(
                f"INSERT OR REPLACE INTO entries({_COLUMNS}) VALUES ({','.join('?' * 15)})",
                [_row(e) for e in upserts],
            )
            dels = [(i,) for i in deletes]
            c.executemany("DELETE FROM entries WHERE id=?", dels)
            c.executemany("DELETE FROM entry_credit WHERE entry_id=?", dels)
            c.executemany("DELETE FROM entry_origin WHERE entry_id=?", dels)
            c.executemany(
                "INSERT OR REPLACE INTO entry_origin(entry_id, written_by, model_step, step, "
                "written_at) VALUES (?, ?, ?, ?, ?)",
                [
                    (i, o.written_by, o.model_step, int(step), o.written_at)
                    for i, (o, step) in (origins or {}).items()
                ],
            )
            for k, v in meta.items():
                self.set_meta(k, v)
            _insert_events(c, events)
            if write is not None:
                self._insert_writes([write])

    # -- client write ids --------------------------------------------------------------------
    def _insert_writes(self, writes: Iterable[WriteRecord]) -> None:
        now = time.time()
        n = self.conn.executemany(
            "INSERT OR REPLACE INTO write_ids(id, kind, at, result) VALUES (?, ?, ?, ?)",
            [
                (w.id, w.kind, now, None if w.result is None else json.dumps(w.result))
                for w in writes
            ],
        ).rowcount
        self.conn.execute("DELETE FROM write_ids WHERE at < ?", (now - WRITE_ID_KEEP_S,))
        self._writes_since_trim += max(0, n)
        if self._writes_since_trim >= WRITE_ID_KEEP // 100:  # now and then: a count costs a scan
            self._writes_since_trim = 0
            self.conn.execute(
                "DELETE FROM write_ids WHERE at <= (SELECT at FROM write_ids ORDER BY at DESC "
                "LIMIT 1 OFFSET ?)",
                (WRITE_ID_KEEP,),
            )

    def record_writes(self, writes: Iterable[WriteRecord]) -> None:
        """Remember ``writes`` as applied (one transaction); ids older than :data:`WRITE_ID_KEEP_S`,
        and all but about the latest :data:`WRITE_ID_KEEP`, go."""
        with self._transaction():
            self._insert_writes(writes)

    def find_writes(self, ids: Sequence[str]) -> dict[str, WriteRecord]:
        """The remembered writes among ``ids``."""
        out: dict[str, WriteRecord] = {}
        for i in range(0, len(ids), 500):  # SQLite's bound on parameters per statement
            chunk = list(ids[i : i + 500])
            rows = self.conn.execute(
                "SELECT id, kind, result FROM write_ids WHERE id IN "
                f"({','.join('?' * len(chunk))})",
                chunk,
            ).fetchall()
            for wid, kind, result in rows:
                out[wid] = WriteRecord(wid, kind, None if result is None else json.loads(result))
        return out

    # -- writers and quarantine --------------------------------------------------------------
    def origins(self, ids: Iterable[int]) -> dict[int, OriginRecord]:
        """``{id: {written_by, model_step, step, written_at, quarantined}}`` of the ids that
        have one."""
        out: dict[int, OriginRecord] = {}
        wanted = [int(i) for i in ids]
        for k in range(0, len(wanted), 500):
            chunk = wanted[k : k + 500]
            for row in self.conn.execute(
                "SELECT entry_id, written_by, model_step, step, written_at, quarantined FROM "
                f"entry_origin WHERE entry_id IN ({','.join('?' * len(chunk))})",
                chunk,
            ):
                out[int(row[0])] = {
                    "written_by": row[1],
                    "model_step": row[2],
                    "step": row[3],
                    "written_at": row[4],
                    "quarantined": bool(row[5]),
                }
        return out

    def set_quarantined(
        self,
        written_by: str,
        steps: tuple[int | None, int | None],
        flag: bool,
        meta: dict[str, object],
    ) -> list[int]:
        """Mark (``flag``) or unmark the entries whose current text ``written_by`` wrote at a step
        in ``steps`` (both ends included; the extractor's model step for ``extractor``, else the
        rollout step of the write), with ``meta`` in the same transaction; returns their ids."""
        lo, hi = steps
        at = "coalesce(model_step, step)"
        where = ["written_by = ?", "quarantined = ?"]
        params: list[Any] = [written_by, int(not flag)]
        if lo is not None:
            where.append(f"{at} >= ?")
            params.append(int(lo))
        if hi is not None:
            where.append(f"{at} <= ?")
            params.append(int(hi))
        cond = " AND ".join(where)
        with self._transaction() as c:
            ids = [
                int(r[0])
                for r in c.execute(
                    f"SELECT entry_id FROM entry_origin WHERE {cond} ORDER BY entry_id", params
                )
            ]
            c.execute(f"UPDATE entry_origin SET quarantined = ? WHERE {cond}", [int(flag), *params])
            for k, v in meta.items():
                self.set_meta(k, v)
        return ids

    def quarantined_count(self) -> int:
        row = self.conn.execute(
            "SELECT count(*) FROM entry_origin WHERE quarantined = 1"
        ).fetchone()
        return int(row[0]) if row else 0

    def load_credit(self) -> dict[int, tuple[float, int]]:
        """``{entry id: (reward sum, credited episodes)}`` of every entry with a credit row."""
        rows = self.conn.execute(
            "SELECT entry_id, reward_sum, episodes FROM entry_credit"
        ).fetchall()
        return {int(i): (float(s), int(n)) for i, s, n in rows}

    def last_event_step(self) -> int:
        """The latest step in the event log (0 when empty): the step of a change logged
        without one."""
        row = self.conn.execute("SELECT max(step) FROM entry_events").fetchone()
        return 0 if row is None or row[0] is None else int(row[0])

    def record_credits(self, step: int, credits: Iterable[tuple[int, float, int]]) -> int:
        """One ``credit`` event per ``(entry id, r̄(m) of the step, episodes)`` and, for an entry
        still in the bank, its running r̄(m) over all its credited episodes, in one transaction;
        returns how many."""
        rows = [(int(i), float(v), int(n)) for i, v, n in credits]
        with self._transaction() as c:
            _insert_events(c, [EntryEvent(i, step, "credit", value=v, n=n) for i, v, n in rows])
            c.executemany(
                "INSERT INTO entry_credit(entry_id, reward_sum, episodes, steps, last_step, rbar) "
                "SELECT ?1, ?2 * ?3, ?3, 1, ?4, ?2 WHERE EXISTS (SELECT 1 FROM entries WHERE id = "
                "?1) ON CONFLICT(entry_id) DO UPDATE SET reward_sum = reward_sum + "
                "excluded.reward_sum, episodes = episodes + excluded.episodes, steps = steps + 1, "
                "last_step = max(last_step, excluded.last_step), rbar = (reward_sum + "
                "excluded.reward_sum) / max(1, episodes + excluded.episodes)",
                [(i, v, n, int(step)) for i, v, n in rows],
            )
        return len(rows)

    def update_stats(self, sql: str, params: list[tuple[Any, ...]]) -> None:
        """Run one counter update statement for many rows, in one transaction."""
        with self._transaction() as c:
            c.executemany(sql, params)

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` … ``COMMIT``; any exception (even KeyboardInterrupt) rolls back.

        The error that stopped the transaction is the one raised: SQLite has already rolled back
        after some (a full disk, an I/O error), and a failed ``ROLLBACK`` must not replace
        the cause.
        """
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        try:
            yield c
            c.execute("COMMIT")
        except BaseException as exc:
            if c.in_transaction:
                try:
                    c.execute("ROLLBACK")
                except sqlite3.Error as rollback_exc:
                    exc.add_note(f"the rollback failed too: {rollback_exc}")
            raise

    def backup(self, target: Path) -> None:
        """A consistent copy of the database in ``target`` (one file, the WAL folded in), taken
        with SQLite's online backup while the bank stays open; callers hold the bank's locks."""
        tmp = _sidecar(target, ".new")
        tmp.unlink(missing_ok=True)
        dest = sqlite3.connect(str(tmp))
        try:
            self.conn.backup(dest)
            dest.execute("PRAGMA journal_mode=WAL")
        finally:
            dest.close()
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync_dir(target.parent)

    def close(self) -> None:
        self.conn.close()
