"""The pieces of an exact resume, each on its own: the tokenizer a checkpoint reloads, a sample that
carries its grammar, the bank and queue rolled back to a checkpoint's copy, and track failures that
are shown and can stop a run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _trainer_fixtures import tiny_policy
from _waiting import settle

from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.distill_queue import DistillQueue
from crl_gym.experience.store import BankCorruptError, verify_bank_copy
from crl_gym.protocol import DistillationRequest, ExtractorSample, Step, Trajectory
from crl_gym.wrappers.examples import CorridorEnv
from crl_train.config import ExtractorSettings, load_config
from crl_train.extractor.model import Extractor
from crl_train.policy.hf import HFPolicy
from crl_train.run.trainer import TrackFailure, Trainer


def _request(task: str = "Walk east") -> DistillationRequest:
    steps = [Step("cell 0", "east", 0.0), Step("cell 1", "west", 0.0)]
    return DistillationRequest(task=task, trajectory=Trajectory(steps=steps), outcome=1.0, success=True,
                               experience=None, condition="free")


def test_a_tiny_tokenizer_reloads_as_saved_and_its_samples_replay(tmp_path: Path) -> None:
    # AutoTokenizer once turned the tiny byte-level BPE into a Qwen2Tokenizer (digits split one by
    # one, NFC): a sample holding the token "16" no longer replayed under its grammar after a resume.
    policy = tiny_policy(1, loss_scale="tokens")
    extractor = Extractor(
        policy,
        ExtractorSettings(
            max_new_tokens=40,
            max_context_tokens=1024,
            max_prompt_chars=600,
            constrained=True,
        ),
    )
    (sample, _), = extractor.distill([_request()])
    policy.save(tmp_path / "ext")
    saved = json.loads((tmp_path / "ext" / "model" / "tokenizer.json").read_text())
    reloaded = HFPolicy.from_checkpoint(tmp_path / "ext")
    got = json.loads(reloaded.tokenizer.backend_tokenizer.to_str())
    for part in ("normalizer", "pre_tokenizer", "model", "decoder"):
        assert got.get(part) == saved.get(part), part
    text = 'id 16, text: "go 123 east" café'
    assert reloaded.tokenizer.encode(text) == policy.tokenizer.encode(text)
    # a fresh extractor (a restarted process: no grammar map) replays the sample from the grammar it carries
    fresh = Extractor(
        reloaded,
        ExtractorSettings(
            max_new_tokens=40,
            max_context_tokens=1024,
            max_prompt_chars=600,
            constrained=True,
        ),
    )
    assert sample.grammar is not None and not fresh.grammars
    assert fresh.allowed_of(sample) == extractor.allowed_of(sample)


def test_a_sample_keeps_its_grammar_through_json_and_a_bad_one_is_named() -> None:
    s = ExtractorSample("p", "[]", [-0.1], [5], [1, 2], 3, {"schema": '{"type":"array"}', "think_tokens": 0,
                                                            "reasoning_end": None})
    assert ExtractorSample.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    with pytest.raises(ValueError, match=r"provenance\.grammar\.think_tokens"):
        ExtractorSample.from_dict({**s.to_dict(), "grammar": {"schema": "{}", "think_tokens": -1}})
    assert ExtractorSample.from_dict({k: v for k, v in s.to_dict().items() if k != "grammar"}).grammar is None


def _vec(i: int) -> np.ndarray:
    v = np.zeros(8, np.float32)
    v[i % 8] = 1.0
    v[(i + 3) % 8] = 0.5
    return v


def test_the_bank_rolls_back_to_its_copy_and_issues_the_same_ids_again(tmp_path: Path) -> None:
    bank = ExperienceBank(tmp_path / "bank", dim=8)
    ids = [bank.add(f"entry {i}", _vec(i)) for i in range(4)]
    bank.record_training(ids[:2], 1)
    before = {e.id: (e.text, e.train_count, e.version) for e in bank}
    bank.backup(tmp_path / "copy")
    verify_bank_copy(tmp_path / "copy")
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == ["bank.sqlite", "index.json", "index.usearch"]
    later = bank.add("written after the checkpoint", _vec(7))
    bank.update(ids[0], "rewritten after the checkpoint", _vec(0))
    bank.delete(ids[1])
    bank.restore(tmp_path / "copy")
    assert {e.id: (e.text, e.train_count, e.version) for e in bank} == before
    assert not bank.index_recoveries  # the copy's index came with it: nothing rebuilt
    assert bank.add("the next entry", _vec(5)) == later  # the id written after the checkpoint is issued again
    assert [[i for i, _ in hits] for hits in bank.search(_vec(2)[None, :], k=1)] == [[ids[2]]]
    bank.close()
    reopened = ExperienceBank(tmp_path / "bank", dim=8)
    assert {e.id for e in reopened} == {*ids, later}
    reopened.close()
    (tmp_path / "copy" / "bank.sqlite").write_bytes(b"not a database at all" * 100)
    with pytest.raises(BankCorruptError, match=r"copy/bank.sqlite"):
        verify_bank_copy(tmp_path / "copy")


def test_the_queue_goes_back_to_its_snapshot_in_order(tmp_path: Path) -> None:
    q = DistillQueue(maxsize=2, spill_path=tmp_path / "pending.jsonl")
    for t in "abcde":  # a, b in memory; c, d, e spilled
        q.put(_request(t))
    assert [r.task for r in q.get(1)] == ["a"]
    assert q.snapshot(tmp_path / "snap.jsonl") == 4
    assert [r.task for r in q.get(2)] == ["b", "c"]
    q.put(_request("f"))
    assert q.restore(tmp_path / "snap.jsonl") == 4
    q.put(_request("g"))
    assert [r.task for r in q.get(10)] == ["b", "c", "d", "e", "g"]
    q.close()


# ------------------------------------------------------------------ failures of the background track
SMALL = ["method=complementary", "env.ids=[corridor]", "env.tasks_per_step=1", "env.group_size=4", "env.max_turns=3",
         "train.eval_episodes=0", "actor.tiny_vocab_size=300", "extractor.tiny_vocab_size=300", "actor.tiny_hidden=32",
         "extractor.tiny_hidden=32", "actor.tiny_layers=1", "extractor.tiny_layers=1", "algo.buffer_size=1",
         "algo.merge_every=0", "experience.asynchronous=false", "experience.max_prompt_chars=600",
         "extractor.max_context_tokens=512", "train.checkpoint_every=10"]


def _corridor(env_id: str) -> Any:
    return CorridorEnv(length=1, max_turns=3)


def _failing_trainer(run: Path, limit: int) -> Trainer:
    cfg = load_config(None, [*SMALL, "train.steps=4", f"train.max_track_failures={limit}"])
    trainer = Trainer(cfg, run, progress=False, env_factory=_corridor)
    track = trainer.c.service.track
    assert track is not None

    def broken(*args: Any, **kwargs: Any) -> dict[str, float]:
        raise ValueError("replay: token 376 at position 9 is not allowed by its grammar")

    track.extractor.update = broken  # type: ignore[method-assign]
    return trainer


def test_a_repeating_track_error_stops_the_run_at_the_limit_naming_the_cause(tmp_path: Path) -> None:
    trainer = _failing_trainer(tmp_path / "run", limit=2)
    try:
        with pytest.raises(TrackFailure, match=r"failed 2 times by step \d.*max_track_failures=2.*"
                                               r"last cause: ValueError: replay: token 376"):
            trainer.run()
    finally:
        trainer.close()


def test_without_a_limit_the_failures_are_in_the_summary(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    trainer = _failing_trainer(tmp_path / "run", limit=0)
    try:
        row = trainer.run()
    finally:
        trainer.close()
    assert row["track_errors"] >= 2 and row["extractor_updates"] == 0
    assert trainer.problems["track_failures"] == row["track_errors"]
    assert trainer.problems["cause"].startswith("ValueError: replay: token 376")
    assert "background track has failed" in caplog.text


# ------------------------------------------------------------------ crl-experience serve --extractor, restarted
def _guided(task: str, entry: Any, step: int, success: bool) -> DistillationRequest:
    steps = [Step("cell 0", "east", 0.0), Step("cell 1", "west", 1.0 if success else 0.0)]
    return DistillationRequest(task=task, trajectory=Trajectory(steps=steps), outcome=float(success), success=success,
                               experience=entry, condition="guided", rollout_step=step)


def _play(service: Any, step: int, n: int = 8) -> None:
    """One rollout step of ``n`` guided episodes, each on an entry the extractor wrote (it has a sample)."""
    from crl_gym.protocol import ExperienceRef

    written = [e for e in service.manager.bank if e.provenance is not None and e.provenance.token_ids]
    for i in range(n):
        e = written[i % len(written)]
        service.submit(_guided(f"task {step}.{i}", ExperienceRef(e.id, e.text, e.version), step, success=i % 2 == 0))
    service.end_step(step)


@pytest.mark.slow
def test_a_restarted_extractor_server_keeps_its_buffer_and_trains(tmp_path: Path) -> None:
    from crl_train.serve import SERVICE_DIR, build_served_service

    bank_dir = tmp_path / "bank"
    service = build_served_service(bank_dir, "tiny")
    try:
        for i in range(4):  # free episodes: the extractor writes entries (with their samples)
            service.submit(DistillationRequest(f"task {i}", Trajectory([Step("cell 0", "east", 1.0)]), 1.0, True, None,
                                               condition="free", rollout_step=0))
        service.end_step(0)
        settle(service, lambda s: s.distilled >= 4 and s.queue_depth == 0, "4 distilled", timeout=600.0)
        _play(service, 1, n=11)  # 11 credits: one update of 8, 3 left in B_φ
        before = settle(service, lambda s: s.distilled >= 15 and s.queue_depth == 0 and s.credited >= 1,
                        "15 distilled and a credit", timeout=600.0)
    finally:
        service.close()  # the server's SIGTERM path: the checkpoint is written here
    assert (bank_dir / SERVICE_DIR / "checkpoint" / "state.json").is_file()
    restarted = build_served_service(bank_dir, "tiny")
    try:
        again = restarted.stats()
        for key in ("buffer_size", "extractor_updates", "credited", "distilled", "errors"):
            assert again.get(key) == before.get(key), key
        assert restarted.ledger.last_ended == 1
        _play(restarted, 2)  # B_φ's restored samples and the new ones reach 8: the extractor trains
        after = settle(restarted, lambda s: s.extractor_updates > before.extractor_updates,
                       "an update after the restart", timeout=600.0)
        assert after.get("errors") == 0 and after.get("unreplayable") == 0 and after.extractor == "alive"
    finally:
        restarted.close()
