"""What the explorer reads: a bank's SQLite rows, its retrieval and, beside it, the run that
wrote it.

:class:`BankSource` has two ways in. :meth:`BankSource.live` wraps the bank a running service owns:
queries go to a read-only connection of their own (SQLite's WAL lets a reader run beside the
writer), or, for an in-memory bank, to the bank's own connection in query-only mode.
:meth:`BankSource.open` opens a bank or run directory that no service holds, read-only: nothing is
locked, written or rebuilt on disk; the vector index for the search page is built in memory from the
stored embeddings. Either way the search page ranks exactly as the service does
(:mod:`crl_gym.explorer.search`).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from crl_gym.experience.bank import DB_FILE
from crl_gym.experience.config import ManagerConfig
from crl_gym.experience.embedders import Embedder, load_embedder
from crl_gym.experience.store import BankCorruptError, open_readonly
from crl_gym.experience.vector_index import VectorIndex

if TYPE_CHECKING:
    from crl_gym.experience.service import RetrievalService

RUN_FILES = ("trajectories.jsonl", "metrics.jsonl")


def find_bank(directory: str | Path) -> Path:
    """The bank directory in ``directory``: itself when it holds ``bank.sqlite``, else its ``bank/``
    (a run directory, as ``crl-train --out DIR`` writes it). ``FileNotFoundError`` names both."""
    d = Path(directory)
    for candidate in (d, d / "bank"):
        if (candidate / DB_FILE).is_file():
            return candidate
    raise FileNotFoundError(
        f"{d}: neither {d / DB_FILE} nor {d / 'bank' / DB_FILE} exists: "
        f"point --bank at a bank directory or at a run directory that has one"
    )


def find_run_dir(bank_dir: Path | None) -> Path | None:
    """The run directory a bank belongs to (its parent, when that holds a run's outputs)."""
    if bank_dir is None:
        return None
    parent = bank_dir.resolve().parent
    return parent if any((parent / f).is_file() for f in RUN_FILES) else None


class _Snapshot:
    """Search side of a bank opened read-only: its vectors in an in-memory usearch index, and the
    retrieval counters as stored (the bank-like part
    :func:`crl_gym.explorer.search.preview` uses)."""

    def __init__(self, index: VectorIndex, stats: dict[int, tuple[int, float]]) -> None:
        self.dim = index.dim
        self._index = index
        self._stats = stats

    def search(self, vectors: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
        return self._index.search(np.asarray(vectors, dtype=np.float32), k)

    def retrieval_stats(self, ids: Iterable[int]) -> dict[int, tuple[int, float]]:
        return {i: self._stats[i] for i in ids if i in self._stats}

    def __len__(self) -> int:
        return len(self._stats)


@dataclass
class Searcher:
    """What a search needs: the bank's index and counters, the embedder, the retrieval settings,
    a clock."""

    bank: Any
    embedder: Embedder
    config: ManagerConfig
    clock: Callable[[], float] = time.time


class BankSource:
    """One bank as the explorer sees it (see the module docstring)."""

    def __init__(
        self,
        query: Callable[[str, Sequence[Any]], list[tuple[Any, ...]]],
        searcher: Searcher | None,
        *,
        bank_dir: Path | None,
        read_only: bool,
        embedder_name: str | None,
        dim: int,
        closer: Callable[[], None] | None = None,
    ) -> None:
        self._query = query
        self.searcher = searcher
        self.bank_dir = bank_dir
        self.run_dir = find_run_dir(bank_dir)
        self.read_only = read_only
        self.embedder_name = embedder_name
        self.dim = dim
        self._closer = closer
        self._tables: set[str] | None = None

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Rows of one read-only query."""
        return self._query(sql, params)

    def has_table(self, name: str) -> bool:
        """Whether the bank has table ``name`` (a bank written before the event log has not)."""
        if self._tables is None or name not in self._tables:
            self._tables = {
                r[0] for r in self.query("SELECT name FROM sqlite_master WHERE type='table'")
            }
        return name in self._tables

    def close(self) -> None:
        if self._closer is not None:
            self._closer()
            self._closer = None

    @classmethod
    def live(cls, service: RetrievalService) -> BankSource:
        """The bank of a running service (a ``RetrievalService`` or subclass)."""
        manager = service.manager
        bank = manager.bank
        searcher = Searcher(bank, manager.embedder, manager.config, manager.clock)
        if bank.path is None:
            return cls(
                bank.read_sql,
                searcher,
                bank_dir=None,
                read_only=False,
                embedder_name=bank.embedder_name,
                dim=bank.dim,
            )
        conn = open_readonly(bank.path / DB_FILE)
        return cls(
            _locked(conn),
            searcher,
            bank_dir=bank.path,
            read_only=False,
            embedder_name=bank.embedder_name,
            dim=bank.dim,
            closer=conn.close,
        )

    @classmethod
    def open(
        cls, directory: str | Path, embedder: Embedder | None = None, *, search: bool = True
    ) -> BankSource:
        """A bank or run directory, read-only. ``embedder`` defaults to the one the bank records;
        ``search=False`` loads no vectors (the search page then answers 503)."""
        bank_dir = find_bank(directory)
        conn = open_readonly(bank_dir / DB_FILE)
        try:
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
            if "dim" not in meta:
                raise BankCorruptError(f"{bank_dir / DB_FILE}: meta.dim is missing")
            dim = int(meta["dim"])
            name = meta.get("embedder")
            if not search:
                return cls(
                    _locked(conn),
                    None,
                    bank_dir=bank_dir,
                    read_only=True,
                    embedder_name=name,
                    dim=dim,
                    closer=conn.close,
                )
            emb = embedder if embedder is not None else load_embedder(name)
            if int(emb.dim) != dim:
                raise ValueError(
                    f"{bank_dir}: the bank's vectors have dim {dim}, the embedder {name!r} "
                    f"gives {emb.dim}"
                )
            snapshot = _snapshot(conn, dim, bank_dir, int(meta.get("generation", 0)))
        except BaseException:
            conn.close()
            raise
        return cls(
            _locked(conn),
            Searcher(snapshot, emb, ManagerConfig()),
            bank_dir=bank_dir,
            read_only=True,
            embedder_name=name,
            dim=dim,
            closer=conn.close,
        )


def _snapshot(conn: sqlite3.Connection, dim: int, bank_dir: Path, generation: int) -> _Snapshot:
    """The search side of a read-only bank: vectors and retrieval counters only (the texts and
    provenance stay in SQLite until a page asks), and the bank's saved index when it is the one
    for these rows (checked as the bank itself checks it; else one built in memory, never saved)."""
    file = bank_dir / DB_FILE
    vectors: dict[int, np.ndarray] = {}
    stats: dict[int, tuple[int, float]] = {}
    for i, blob, count, last in conn.execute(
        "SELECT id, embedding, retrieval_count, last_retrieved FROM entries"
    ):
        v = np.frombuffer(blob, dtype=np.float32)
        if v.shape != (dim,):
            raise BankCorruptError(
                f"{file}: entry {i} has an embedding of {v.size} floats, expected dim {dim}"
            )
        vectors[int(i)] = v
        stats[int(i)] = (int(count), float(last))
    index, _ = VectorIndex.open(bank_dir, dim, vectors, generation)
    return _Snapshot(index, stats)


def _locked(conn: sqlite3.Connection) -> Callable[[str, Sequence[Any]], list[tuple[Any, ...]]]:
    """Queries on one read-only connection, one at a time (routes run on FastAPI's thread pool)."""
    lock = threading.Lock()

    def query(sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with lock:
            return [tuple(r) for r in conn.execute(sql, tuple(params)).fetchall()]

    return query
