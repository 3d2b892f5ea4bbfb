"""manager.retrieve_by: an entry is found by its text, its task or both; the key is stored with the
entry, survives a reopen, Updates and Merges, is shown by the explorer; an older bank gains it; the
near-duplicate check still compares texts."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.config import ManagerConfig
from crl_gym.experience.embedders import HashingEmbedder, embedder_name
from crl_gym.experience.entry import ExperienceEntry
from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.merge import merge_bank
from crl_gym.explorer import BankSource, explorer_app
from crl_gym.protocol import AddOp, DistillationRequest, Trajectory, UpdateOp

EMB = HashingEmbedder(128)
TASKS = [f"Task {a} {b}: repeat the 1 secret actions of {a} {b}." for a, b in
         (("amber", "badger"), ("bold", "falcon"), ("coral", "heron"), ("dusty", "lynx"))]
# texts that share nothing with their task and much with each other: found by text, any task wins
TEXTS = ["Play east. Walk on, the road is long and quiet today.", "Play north. Walk on, the road is long and quiet.",
         "Play east. The road is long; walk on and stay quiet.", "Play north. Quiet today: walk on, the road is long."]


def _request(task: str) -> DistillationRequest:
    return DistillationRequest(task=task, trajectory=Trajectory(), outcome=1.0, success=True, experience=None)


def _manager(bank: ExperienceBank, retrieve_by: str, **kw: object) -> ExperienceManager:
    return ExperienceManager(bank, EMB, ManagerConfig(retrieve_by=retrieve_by, diversity_lambda=0.0,  # type: ignore[arg-type]
                                                      recency_window_s=0.0, **kw))  # type: ignore[arg-type]


def _own_task_top1(retrieve_by: str) -> float:
    bank = ExperienceBank(None, dim=EMB.dim)
    with _manager(bank, retrieve_by) as mgr:
        for task, text in zip(TASKS, TEXTS, strict=True):
            mgr.apply_ops([AddOp(text)], request=_request(task))
        found = mgr.search_many(TASKS, k=1)
    return sum(f[0].source == t for f, t in zip(found, TASKS, strict=True)) / len(TASKS)


def test_a_task_key_finds_the_tasks_own_entry_where_the_text_does_not() -> None:
    assert _own_task_top1("task") == 1.0
    assert _own_task_top1("task_text") == 1.0
    assert _own_task_top1("text") < 1.0  # the texts name no task: the query cannot tell them apart


def test_the_key_is_stored_with_the_entry_and_survives_a_reopen(tmp_path: Path) -> None:
    bank = ExperienceBank(tmp_path / "bank", dim=EMB.dim)
    with _manager(bank, "task_text") as mgr:
        (i,) = mgr.apply_ops([AddOp("Play east.")], request=_request(TASKS[0])).added
        (j,) = mgr.apply_ops([AddOp("Written by a user.")]).added  # no request: keyed by its text
    bank.close()
    with ExperienceBank(tmp_path / "bank", dim=EMB.dim) as bank:
        e, u = bank.get(i), bank.get(j)
        assert e is not None and u is not None
        assert (e.source, e.key) == (TASKS[0], f"{TASKS[0]}\nPlay east.")
        assert np.allclose(e.embedding, EMB.encode([e.key])[0])  # the vector is the key's
        assert (u.source, u.key, u.retrieval_text) == ("", None, "Written by a user.")
    assert ExperienceEntry.from_dict(e.to_dict()) == e


def test_an_update_keeps_the_source_and_rekeys_the_new_text() -> None:
    bank = ExperienceBank(None, dim=EMB.dim)
    with _manager(bank, "task_text") as mgr:
        (i,) = mgr.apply_ops([AddOp("Play east.")], request=_request(TASKS[0])).added
        mgr.apply_ops([UpdateOp(i, "Play north.")], request=_request(TASKS[1]))  # another task's episode saw it
        e = bank.get(i)
    assert e is not None and e.source == TASKS[0] and e.key == f"{TASKS[0]}\nPlay north."


def test_a_merge_keys_by_the_shared_task_or_else_by_the_text() -> None:
    bank = ExperienceBank(None, dim=EMB.dim)
    with _manager(bank, "task") as mgr:
        a, b = (mgr.apply_ops([AddOp(t)], request=_request(TASKS[0])).added[0] for t in ("Play east.", "Go east."))
        c = mgr.apply_ops([AddOp("Play north.")], request=_request(TASKS[1])).added[0]
    same = json.dumps({"E1": "merge", "E2": "merge", "merged": "East wins."})
    report = merge_bank(bank, EMB, lambda ps: [same for _ in ps], order="id", retrieve_by="task")
    assert report.ok, report.error
    (anchor,) = report.updated
    merged = bank.get(anchor)
    assert merged is not None and merged.text == "East wins." and merged.key == TASKS[0]
    assert {a, b} >= {anchor}
    mixed = json.dumps({"E1": "merge", "E2": "merge", "merged": "Try both."})  # the anchor and c: two tasks
    assert merge_bank(bank, EMB, lambda ps: [mixed for _ in ps], order="id", retrieve_by="task").ok
    survivor = next(e for e in bank if e.text == "Try both.")
    assert survivor.key is None and np.allclose(survivor.embedding, EMB.encode(["Try both."])[0])
    assert c not in bank or bank.get(c).text == "Try both."  # type: ignore[union-attr]


def test_near_duplicates_are_judged_by_text_under_a_task_key() -> None:
    bank = ExperienceBank(None, dim=EMB.dim)
    with _manager(bank, "task", dedup_similarity=0.999) as mgr:
        first = mgr.apply_ops([AddOp("Play east.")], request=_request(TASKS[0]))
        again = mgr.apply_ops([AddOp("Play east.")], request=_request(TASKS[0]))  # same text: refused
        other = mgr.apply_ops([AddOp("Play north, then rest.")], request=_request(TASKS[0]))  # same key, new text
    assert len(first.added) == 1 and again.refused == 1 and len(other.added) == 1


def test_an_older_bank_gains_the_columns_and_a_reader_sees_them_empty(tmp_path: Path) -> None:
    bank = ExperienceBank(tmp_path / "bank", dim=EMB.dim, embedder_name=embedder_name(EMB))
    i = bank.add("go east", EMB.encode(["go east"])[0])
    bank.close()
    with sqlite3.connect(tmp_path / "bank" / "bank.sqlite") as db:  # as a bank written before keys existed
        db.execute("ALTER TABLE entries DROP COLUMN key")
        db.execute("ALTER TABLE entries DROP COLUMN source")
    source = BankSource.open(tmp_path)  # a read-only reader of the older file
    with TestClient(explorer_app(source)) as client:
        d = client.get(f"/ui/api/entries/{i}").json()
        assert (d["entry"]["source"], d["entry"]["retrieved_by"]) == ("", "go east")
    source.close()
    with ExperienceBank(tmp_path / "bank", dim=EMB.dim) as bank:  # opened for writing: gains them
        assert bank.get(i).source == ""  # type: ignore[union-attr]
    with sqlite3.connect(tmp_path / "bank" / "bank.sqlite") as db:
        assert [r[1] for r in db.execute("PRAGMA table_info(entries)")][-2:] == ["source", "key"]


def test_the_explorer_shows_what_an_entry_is_retrieved_by(tmp_path: Path) -> None:
    bank = ExperienceBank(tmp_path / "bank", dim=EMB.dim, embedder_name=embedder_name(EMB))
    with _manager(bank, "task") as mgr:
        (i,) = mgr.apply_ops([AddOp("Play east.")], request=_request(TASKS[0])).added
    bank.close()
    source = BankSource.open(tmp_path)
    with TestClient(explorer_app(source)) as client:
        d = client.get(f"/ui/api/entries/{i}").json()["entry"]
    source.close()
    assert (d["source"], d["retrieved_by"]) == (TASKS[0], TASKS[0])


def test_an_unknown_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="retrieve_by"):
        ManagerConfig(retrieve_by="title")  # type: ignore[arg-type]
