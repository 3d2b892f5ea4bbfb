"""Tests of crl_gym.experience.store: SQLite persistence, all-or-nothing writes, corrupt files."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest

from crl_gym.experience.entry import ExperienceEntry
from crl_gym.experience.store import BankCorruptError, SQLiteStore
from crl_gym.protocol import ExtractorSample

DIM = 3


def entry(i: int, text: str = "tip") -> ExperienceEntry:
    return ExperienceEntry(id=i, text=text, embedding=np.full(DIM, float(i), np.float32), tags=("a",))


def test_round_trip_of_every_field(tmp_path: Path) -> None:
    sample = ExtractorSample(prompt="p", response="r", logprobs=[-0.5], token_ids=[7], prompt_token_ids=[1])
    e = ExperienceEntry(
        id=9, text="t", embedding=np.array([1, 2, 3], np.float32), version=2, created_step=4,
        retrieval_count=5, last_retrieved=6.5, train_count=7, last_trained_step=8, utility=0.25,
        tags=("x", "y"), provenance=sample, history=["old"],
    )
    store = SQLiteStore(tmp_path / "b.sqlite")
    store.commit([e], [], {"next_id": 10})
    store.close()
    store = SQLiteStore(tmp_path / "b.sqlite")
    [back] = store.load_all(DIM)
    assert back.to_dict() == e.to_dict() and store.get_meta("next_id") == "10"
    store.close()


def test_a_failing_commit_changes_nothing() -> None:
    store = SQLiteStore(None)
    store.commit([entry(1)], [], {"generation": 1})
    no_embedding = ExperienceEntry(id=3, text="x", embedding=None)
    with pytest.raises(ValueError, match="entry 3: cannot store an entry without an embedding"):
        store.commit([entry(2), no_embedding], [1], {"generation": 2})
    # the insert of 2, the delete of 1 and the meta update were all rolled back
    assert [e.id for e in store.load_all(DIM)] == [1] and store.get_meta("generation") == "1"
    store.commit([entry(2)], [1], {"generation": 2})  # the connection is usable again
    assert [e.id for e in store.load_all(DIM)] == [2] and store.get_meta("generation") == "2"


def test_update_stats_rolls_back_on_error() -> None:
    store = SQLiteStore(None)
    store.commit([entry(1), entry(2)], [], {})
    sql = "UPDATE entries SET retrieval_count=? WHERE id=?"
    store.update_stats(sql, [(3, 1), (4, 2)])
    assert [e.retrieval_count for e in store.load_all(DIM)] == [3, 4]
    with pytest.raises(sqlite3.ProgrammingError):  # the second row has too few bindings
        store.update_stats(sql, [(9, 1), (9,)])
    assert [e.retrieval_count for e in store.load_all(DIM)] == [3, 4]


def test_corrupt_files_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bank.sqlite"
    bad.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(BankCorruptError, match="bank.sqlite"):
        SQLiteStore(bad)
    store = SQLiteStore(tmp_path / "ok.sqlite")
    store.commit([entry(1)], [], {})
    with pytest.raises(BankCorruptError, match="entry 1 has an embedding of 3 floats, expected dim 4"):
        store.load_all(4)
    store.close()
