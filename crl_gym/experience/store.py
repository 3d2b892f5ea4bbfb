"""SQLite (WAL) persistence of bank entries: the durable source of truth of the bank.

The vector index is derived data; it can always be rebuilt from the ``embedding`` column here.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from crl_gym.experience.entry import ExperienceEntry
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
    history TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
_COLUMNS = (
    "id, text, embedding, version, created_step, retrieval_count, last_retrieved, "
    "train_count, last_trained_step, utility, tags, provenance, history"
)


class BankCorruptError(RuntimeError):
    """A bank file cannot be read; the message names the file."""


def _row(e: ExperienceEntry) -> tuple[Any, ...]:
    if e.embedding is None:  # the index is rebuilt from this column: it must be there
        raise ValueError(f"entry {e.id}: cannot store an entry without an embedding")
    return (
        e.id, e.text, np.ascontiguousarray(e.embedding, dtype=np.float32).tobytes(), e.version,
        e.created_step, e.retrieval_count, e.last_retrieved, e.train_count, e.last_trained_step,
        e.utility, json.dumps(list(e.tags)),
        json.dumps(e.provenance.to_dict()) if e.provenance else None, json.dumps(e.history),
    )


def _entry(row: Sequence[Any], dim: int, file: Path | str) -> ExperienceEntry:
    emb = np.frombuffer(row[2], dtype=np.float32)
    if emb.shape != (dim,):
        raise BankCorruptError(
            f"{file}: entry {row[0]} has an embedding of {emb.size} floats, expected dim {dim}"
        )
    emb.flags.writeable = False
    return ExperienceEntry(
        id=int(row[0]), text=row[1], embedding=emb, version=int(row[3]),
        created_step=int(row[4]), retrieval_count=int(row[5]), last_retrieved=float(row[6]),
        train_count=int(row[7]), last_trained_step=int(row[8]), utility=float(row[9]),
        tags=tuple(json.loads(row[10])),
        provenance=ExtractorSample.from_dict(json.loads(row[11])) if row[11] else None,
        history=list(json.loads(row[12])),
    )


class SQLiteStore:
    """Thin wrapper over one SQLite connection; callers serialise access (the bank's locks)."""

    def __init__(self, path: Path | None) -> None:
        self.file: Path | str = path if path is not None else ":memory:"
        try:
            self.conn = sqlite3.connect(
                str(self.file), check_same_thread=False, isolation_level=None
            )
            if path is not None:
                self.conn.execute("PRAGMA journal_mode=WAL")
                # NORMAL in WAL mode: a committed transaction survives a process kill.
                self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.executescript(_SCHEMA)
            check = self.conn.execute("PRAGMA quick_check").fetchone()
        except sqlite3.DatabaseError as exc:
            raise BankCorruptError(f"{self.file}: not a readable bank database ({exc})") from exc
        if check is None or check[0] != "ok":
            raise BankCorruptError(f"{self.file}: database failed its integrity check ({check})")

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
            rows = self.conn.execute(f"SELECT {_COLUMNS} FROM entries ORDER BY id").fetchall()
            return [_entry(r, dim, self.file) for r in rows]
        except (sqlite3.DatabaseError, ValueError, TypeError) as exc:
            raise BankCorruptError(f"{self.file}: cannot read entries ({exc})") from exc

    def commit(
        self,
        upserts: Iterable[ExperienceEntry],
        deletes: Iterable[int],
        meta: dict[str, object],
    ) -> None:
        """Write everything in one transaction: all of it lands, or none of it."""
        with self._transaction() as c:
            c.executemany(
                f"INSERT OR REPLACE INTO entries({_COLUMNS}) VALUES ({','.join('?' * 13)})",
                [_row(e) for e in upserts],
            )
            c.executemany("DELETE FROM entries WHERE id=?", [(i,) for i in deletes])
            for k, v in meta.items():
                self.set_meta(k, v)

    def update_stats(self, sql: str, params: list[tuple[Any, ...]]) -> None:
        """Run one counter update statement for many rows, in one transaction."""
        with self._transaction() as c:
            c.executemany(sql, params)

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` … ``COMMIT``; any exception (even KeyboardInterrupt) rolls back."""
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        try:
            yield c
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self.conn.close()
