"""The entry-event log the explorer reads: Add / Update / Merge / Delete with steps, and r̄(m) credits."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.merge import merge_bank
from crl_gym.experience.store import open_readonly
from crl_gym.protocol import AddOp, DeleteOp, UpdateOp

EMB = HashingEmbedder(32)


def _events(bank: ExperienceBank) -> list[tuple]:
    return bank.read_sql("SELECT entry_id, step, kind, version, detail FROM entry_events ORDER BY seq")


def test_ops_and_merge_are_logged_with_their_steps(tmp_path: Path) -> None:
    bank = ExperienceBank(tmp_path / "bank", dim=EMB.dim)
    mgr = ExperienceManager(bank, EMB)
    a, b, c = mgr.apply_ops([AddOp("go east"), AddOp("walk east"), AddOp("eat the apple")], step=2).added
    mgr.apply_ops([UpdateOp(a, "go east twice")], step=4)
    gen = lambda ps: ['{"E1": "merge", "E2": "merge", "E3": "keep", "merged": "Head east."}' for _ in ps]  # noqa: E731
    report = merge_bank(bank, EMB, gen, order="id", step=5)
    assert report.ok
    anchor = next(iter(report.updated))
    gone = ({a, b} - {anchor}).pop()
    mgr.apply_ops([DeleteOp(c)], step=7)
    ev = _events(bank)
    assert [(i, s, k) for i, s, k, _, _ in ev[:3]] == [(a, 2, "add"), (b, 2, "add"), (c, 2, "add")]
    assert (a, 4, "update", 1) == ev[3][:4]
    merge = [e for e in ev if e[2] == "merge"]
    assert [(m[0], m[1], json.loads(m[4])["sources"]) for m in merge] == [(anchor, 5, sorted([a, b]))]
    away = [e for e in ev if e[2] == "merged_away"]
    assert [(x[0], x[1], json.loads(x[4])["into"]) for x in away] == [(gone, 5, anchor)]
    assert json.loads(away[0][4])["text"] in ("go east twice", "walk east")
    assert ev[-1][:3] == (c, 7, "delete") and json.loads(ev[-1][4])["text"] == "eat the apple"
    mgr.close()
    bank.close()


def test_an_update_without_a_step_takes_the_latest_logged_one(tmp_path: Path) -> None:
    bank = ExperienceBank(tmp_path / "bank", dim=EMB.dim)
    i = bank.add("x y", EMB.encode(["x y"])[0], created_step=9)
    bank.update(i, "x y z", EMB.encode(["x y z"])[0])
    bank.close()
    bank = ExperienceBank(tmp_path / "bank", dim=EMB.dim)  # the latest step survives a reopen
    bank.update(i, "x", EMB.encode(["x"])[0])
    assert [(s, k) for _, s, k, _, _ in _events(bank)] == [(9, "add"), (9, "update"), (9, "update")]
    bank.close()


def test_credits_fold_into_rbar_over_every_episode(tmp_path: Path) -> None:
    bank = ExperienceBank(tmp_path / "bank", dim=EMB.dim)
    i = bank.add("x y", EMB.encode(["x y"])[0])
    assert bank.record_credits(0, [(i, 1.0, 2)]) == 1
    bank.record_credits(1, [(i, -1.0, 1), (i + 5, 0.5, 4)])  # an id gone meanwhile: logged, not folded
    rows = dict((r[0], r[1:]) for r in bank.read_sql("SELECT entry_id, reward_sum, episodes, steps, last_step, rbar FROM entry_credit"))
    assert rows == {i: (1.0, 3, 2, 1, 1.0 / 3)}
    assert bank.read_sql("SELECT step, value, n FROM entry_events WHERE kind='credit' AND entry_id=?", [i + 5]) == [(1, 0.5, 4)]
    bank.delete(i)  # its folded r̄(m) goes with it; its credit events stay
    assert bank.read_sql("SELECT count(*) FROM entry_credit") == [(0,)]
    assert len(bank.read_sql("SELECT 1 FROM entry_events WHERE kind='credit' AND entry_id=?", [i])) == 2
    assert bank.read_sql("SELECT step, value, n FROM entry_events WHERE kind='credit' AND entry_id=?", [i]) == [(0, 1.0, 2), (1, -1.0, 1)]
    bank.close()


def test_a_bank_written_before_the_event_log_opens_and_gains_it(tmp_path: Path) -> None:
    d = tmp_path / "bank"
    bank = ExperienceBank(d, dim=EMB.dim)
    i = bank.add("x y", EMB.encode(["x y"])[0])
    bank.close()
    conn = sqlite3.connect(d / "bank.sqlite")  # as an older version wrote it: entries and meta only
    conn.executescript("DROP TABLE entry_events; DROP TABLE entry_credit;")
    conn.close()
    ro = open_readonly(d / "bank.sqlite")
    assert {r[0] for r in ro.execute("SELECT name FROM sqlite_master WHERE type='table'")} >= {"entries", "meta"}
    ro.close()
    bank = ExperienceBank(d, dim=EMB.dim)
    assert [e.text for e in bank] == ["x y"]
    bank.update(i, "x", EMB.encode(["x"])[0])
    assert [k for _, _, k, _, _ in _events(bank)] == ["update"]
    bank.close()


def test_read_sql_refuses_writes() -> None:
    bank = ExperienceBank(None, dim=EMB.dim)
    bank.add("x y", EMB.encode(["x y"])[0])
    with pytest.raises(sqlite3.OperationalError):
        bank.read_sql("DELETE FROM entries")
    assert len(bank.read_sql("SELECT id FROM entries")) == 1
    bank.close()


def test_the_service_logs_each_steps_rbar_as_it_credits() -> None:
    from crl_gym.protocol import DistillationRequest, Trajectory
    from crl_train.extractor.oracle import OracleExtractor
    from crl_train.service import ExperienceService, ServiceOptions

    mgr = ExperienceManager(ExperienceBank(None, dim=EMB.dim), EMB)
    service = ExperienceService(mgr, OracleExtractor(), ServiceOptions(asynchronous=False, merge_every=0))
    try:
        a, b = mgr.apply_ops([AddOp("go north"), AddOp("go east")]).added
        ref_a, ref_b = mgr.bank.get(a).ref(), mgr.bank.get(b).ref()  # type: ignore[union-attr]

        def req(ref: object, ok: bool, step: int, cond: str = "guided") -> DistillationRequest:
            return DistillationRequest(task="t", trajectory=Trajectory(), outcome=float(ok), success=ok,
                                       experience=ref, condition=cond, env_id="e", seed=0, rollout_step=step)  # type: ignore[arg-type]
        for r in (req(ref_a, True, 0), req(ref_a, False, 0), req(ref_a, True, 0), req(ref_b, False, 0), req(None, True, 0, "free")):
            service.submit(r)
        service.end_step(0)
        service.submit(req(ref_a, True, 1))
        service.end_step(1)
        rows = {r[0]: r[1:] for r in mgr.bank.read_sql("SELECT entry_id, episodes, steps, rbar FROM entry_credit")}
        assert rows[a] == (4, 2, pytest.approx(((1 - 1 + 1) / 3 * 3 + 1) / 4))
        assert rows[b] == (1, 1, -1.0)
        events = mgr.bank.read_sql("SELECT entry_id, step, value, n FROM entry_events WHERE kind = 'credit' ORDER BY seq")
        by_key = {(i, step): (v, n) for i, step, v, n in events}
        assert len(events) == 3 and by_key[(a, 1)] == (1.0, 1) and by_key[(b, 0)] == (-1.0, 1)
        assert by_key[(a, 0)][0] == pytest.approx(1 / 3) and by_key[(a, 0)][1] == 3
    finally:
        service.close()
