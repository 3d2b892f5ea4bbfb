"""Resume robustness of the trainer (in process, corridor env, tiny models): config saved on resume,
counters restored, outputs trimmed, crash-safe checkpoint swap, pending requests persisted,
crl-eval leaves the bank alone, grpo builds no extractor."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import yaml

from crl_gym.experience.distill_queue import DistillQueue
from crl_gym.experience.store import BankCorruptError
from crl_gym.protocol import DistillationRequest, Trajectory
from crl_gym.wrappers.examples import CorridorEnv
from crl_train.cli import evaluate_dir
from crl_train.config import load_config
from crl_train.run.outputs import ResumeError, resolve_checkpoint, truncate_jsonl
from crl_train.run.trainer import Trainer

SMALL = ["env.ids=[corridor]", "env.tasks_per_step=1", "env.group_size=4", "env.max_turns=3", "train.eval_episodes=0",
         "actor.tiny_vocab_size=300", "extractor.tiny_vocab_size=300", "actor.tiny_hidden=32", "extractor.tiny_hidden=32",
         "actor.tiny_layers=1", "extractor.tiny_layers=1", "algo.buffer_size=2", "algo.merge_every=0",
         "experience.asynchronous=false", "experience.max_prompt_chars=600", "extractor.max_context_tokens=512",
         "train.checkpoint_every=1"]


def _corridor(env_id: str) -> Any:
    return CorridorEnv(length=1, max_turns=3)


def _train(run: Path, steps: int, *extra: str, resume: bool = False) -> dict[str, Any]:
    cfg = load_config(None, ["method=complementary", f"train.steps={steps}", *SMALL, *extra])
    trainer = Trainer(cfg, run, resume=resume, progress=False, env_factory=_corridor)
    try:
        return trainer.run()
    finally:
        trainer.close()


def _step(ckpt: Path) -> int:
    return int(json.loads((ckpt / "state.json").read_text())["step"])


def test_resume_saves_config_restores_counters_and_trims_outputs(tmp_path: Path) -> None:
    run = tmp_path / "run"
    last = _train(run, 2)
    assert last["distilled"] > 0 and last["distill_batches"] > 0
    # What a kill after checkpoint 1 leaves behind: rows of a step 2 that the resumed run redoes,
    # and a line cut mid-write.
    for name, key in (("metrics.jsonl", "step"), ("trajectories.jsonl", "rollout_step")):
        with (run / name).open("a") as f:
            f.write(json.dumps({key: 2, "killed_run": True}) + "\n" + '{"step": 2, "cut')
    cfg = load_config(run / "config.yaml", ["train.steps=3"])
    trainer = Trainer(cfg, run, resume=True, progress=False, env_factory=_corridor)
    try:
        st = trainer.c.service.track.stats
        # (b) the cumulative counters continue from the checkpoint's values, not from 0
        assert (st.distilled, st.distill_batches, st.added) == (last["distilled"], last["distill_batches"], last["added"])
        # (c) the killed run's later rows are gone before the resumed run writes its own
        assert "killed_run" not in (run / "metrics.jsonl").read_text()
        assert "killed_run" not in (run / "trajectories.jsonl").read_text()
        row = trainer.run()
    finally:
        trainer.close()
    assert row["distilled"] >= last["distilled"]
    # (a) the --set is saved: a later plain resume runs to step 3, not back to 2
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 3
    assert yaml.safe_load((run / "config.before_step2.yaml").read_text())["train"]["steps"] == 2
    assert load_config(run / "config.yaml").train.steps == 3
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]
    traj = [json.loads(x)["rollout_step"] for x in (run / "trajectories.jsonl").read_text().splitlines()]
    assert sorted(traj) == [0] * 4 + [1] * 4 + [2] * 4  # K=4 episodes per step, none twice


def test_truncate_jsonl_is_atomic_and_counts_cut_lines(tmp_path: Path) -> None:
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3, "cu')
    assert truncate_jsonl(p, lambda r: r["step"] <= 1) == (2, 2)  # step 2 and the cut line dropped
    assert p.read_text() == '{"step": 0}\n{"step": 1}\n'
    assert not (tmp_path / "m.jsonl.tmp").exists()


@pytest.mark.parametrize("tmp_complete", [True, False])
def test_resume_after_a_kill_between_the_checkpoint_renames(tmp_path: Path, tmp_complete: bool) -> None:
    run = tmp_path / "run"
    _train(run, 1)
    saved0 = tmp_path / "ckpt0"
    shutil.copytree(run / "checkpoint", saved0)
    _train(run, 2, resume=True)
    assert _step(run / "checkpoint") == 1
    assert _step(run / "checkpoint.old") == 0  # the previous checkpoint is kept
    # The crash state: checkpoint/ was renamed to .old, checkpoint.tmp/ not yet to checkpoint/.
    shutil.rmtree(run / "checkpoint.old")
    (run / "checkpoint").rename(run / "checkpoint.tmp")
    saved0.rename(run / "checkpoint.old")
    if not tmp_complete:  # killed while writing tmp: no state.json, so not a checkpoint
        (run / "checkpoint.tmp" / "state.json").unlink()
    ckpt = resolve_checkpoint(run)
    assert ckpt == run / "checkpoint" and _step(ckpt) == (1 if tmp_complete else 0)
    assert not (run / "checkpoint.tmp").exists()
    if tmp_complete:  # the older complete one stays as the previous checkpoint
        assert _step(run / "checkpoint.old") == 0
    else:
        assert not (run / "checkpoint.old").exists()
    cfg = load_config(run / "config.yaml", ["train.steps=3"])
    trainer = Trainer(cfg, run, resume=True, progress=False, env_factory=_corridor)
    try:
        assert trainer.start_step == (2 if tmp_complete else 1)
    finally:
        trainer.close()


def test_resume_without_any_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    cfg = load_config(None, ["method=complementary", *SMALL])
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Trainer(cfg, tmp_path, resume=True, progress=False, env_factory=_corridor)


def _req(task: str) -> DistillationRequest:
    return DistillationRequest(task, Trajectory(), 0.0, False, None)


def test_checkpoint_persists_requests_still_in_memory(tmp_path: Path) -> None:
    cfg = load_config(None, ["method=complementary", "train.steps=1", *SMALL])
    trainer = Trainer(cfg, tmp_path, progress=False, env_factory=_corridor)
    try:
        trainer.c.service.manager.submit(_req("queued-before-the-checkpoint"))
        trainer.checkpoint(0)
        # A SIGKILL now would skip close(): the spill file alone must hold the request.
        spill = trainer.c.service.manager.queue.spill_path
        assert "queued-before-the-checkpoint" in spill.read_text()
        copy = tmp_path / "after_kill.jsonl"
        shutil.copy(spill, copy)
        reopened = DistillQueue(maxsize=4, spill_path=copy)
        assert [r.task for r in reopened.get(10)] == ["queued-before-the-checkpoint"]
        reopened.close()
        assert [r.task for r in trainer.c.service.manager.get_requests(10)] == ["queued-before-the-checkpoint"]
    finally:
        trainer.close()


def test_distill_queue_persist_keeps_fifo_order(tmp_path: Path) -> None:
    q = DistillQueue(maxsize=2, spill_path=tmp_path / "p.jsonl")
    for t in "abcd":  # a, b in memory; c, d spilled
        q.put(_req(t))
    assert [r.task for r in q.get(1)] == ["a"]
    assert q.persist() == 3 and len(q) == 3  # b moved in front of c, d on disk
    q.put(_req("e"))
    shutil.copy(tmp_path / "p.jsonl", tmp_path / "killed.jsonl")  # what a kill would leave
    reopened = DistillQueue(maxsize=2, spill_path=tmp_path / "killed.jsonl")
    assert [r.task for r in reopened.get(10)] == ["b", "c", "d", "e"]
    reopened.close()
    assert [r.task for r in q.get(10)] == ["b", "c", "d", "e"]
    q.close()


def _bank_rows(run: Path) -> list[tuple[Any, ...]]:
    with sqlite3.connect(run / "bank" / "bank.sqlite") as db:
        return sorted(db.execute("SELECT * FROM entries").fetchall())


def test_crl_eval_does_not_mutate_the_runs_bank(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(run, 1)
    before = _bank_rows(run)
    files = sorted(p.name for p in (run / "bank").iterdir())
    cfg = load_config(run / "config.yaml")
    result = evaluate_dir(cfg, run, 4, (True,), env_factory=_corridor)
    assert result["with_experience"]["episodes"] >= 4  # retrievals happened (on the copy)
    assert _bank_rows(run) == before  # retrieval_count / last_retrieved untouched
    assert sorted(p.name for p in (run / "bank").iterdir()) == files
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0]


def test_grpo_builds_no_extractor_and_resumes(tmp_path: Path) -> None:
    cfg = load_config(None, ["method=grpo", "train.steps=1", *SMALL])
    trainer = Trainer(cfg, tmp_path, progress=False, env_factory=_corridor)
    try:
        assert trainer.c.service.extractor is None
        row = trainer.run()
    finally:
        trainer.close()
    assert row["extractor_alive"] is None
    assert not (tmp_path / "checkpoint" / "extractor").exists()
    trainer = Trainer(load_config(tmp_path / "config.yaml", ["train.steps=2"]), tmp_path, resume=True, progress=False,
                      env_factory=_corridor)
    try:
        assert trainer.start_step == 1 and trainer.c.service.extractor is None
    finally:
        trainer.close()


# ------------------------------------------------------------------ a damaged checkpoint
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 2 steps: checkpoint/ holds step 1, checkpoint.old/ step 0 (made once, copied per test)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    _train(run, 2)
    return run


def _tree(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _edit_state(run: Path, edit: Any) -> None:
    path = run / "checkpoint" / "state.json"
    state = json.loads(path.read_text())
    edit(state)
    path.write_text(json.dumps(state))


def _nan_reward(state: dict[str, Any]) -> None:
    sample = {"prompt": "p", "response": "ADD: x", "logprobs": [-0.5], "token_ids": [4]}
    state["service"]["track"]["buffer"] = [{"sample": sample, "reward": float("nan"), "entry_id": 1, "step": 0}]


def _bad_set(state: dict[str, Any]) -> None:
    state["service"]["track"]["allowed_sets"] = []
    state["service"]["track"]["constraints"] = {"k": [3]}


DAMAGES: dict[str, tuple[Any, str]] = {
    "state.json missing": (lambda run: (run / "checkpoint" / "state.json").unlink(), r"checkpoint/state.json is missing"),
    "state.json garbage": (lambda run: (run / "checkpoint" / "state.json").write_bytes(b"\x00{garbage"),
                           r"checkpoint/state.json is unreadable"),
    "state.json step": (lambda run: _edit_state(run, lambda s: s.update(step="two")), r"'step' must be a non-negative integer"),
    "actor weights cut": (lambda run: _cut(run / "checkpoint" / "actor" / "model" / "model.safetensors"),
                          r"checkpoint/actor/model/model.safetensors: \d+ bytes, but \d+ were written"),
    "actor optimizer cut": (lambda run: _cut(run / "checkpoint" / "actor" / "policy_state.pt"),
                            r"checkpoint/actor/policy_state.pt: \d+ bytes, but \d+ were written"),
    "extractor weights cut": (lambda run: _cut(run / "checkpoint" / "extractor" / "model" / "model.safetensors"),
                              r"checkpoint/extractor/model/model.safetensors"),
    "track reward nan": (lambda run: _edit_state(run, _nan_reward),
                         r"checkpoint/state.json: service.track.buffer\[0\].reward must be a finite number, got nan"),
    "track allowed set": (lambda run: _edit_state(run, _bad_set),
                          r"service.track.constraints\['k'\]\[0\] refers to allowed set 3, but the state holds 0 sets"),
    "runner counter": (lambda run: _edit_state(run, lambda s: s["runner"].update(errors=-1)),
                       r"runner.errors must be a non-negative integer"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_checkpoint_is_one_clear_error_and_changes_nothing(trained_run: Path, tmp_path: Path, damage: str) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    with (run / "metrics.jsonl").open("a") as f:  # a later row a successful resume would trim
        f.write(json.dumps({"step": 5, "killed_run": True}) + "\n")
    apply, match = DAMAGES[damage]
    apply(run)
    before = _tree(run)
    cfg = load_config(run / "config.yaml", ["train.steps=4"])
    with pytest.raises(ResumeError, match=match) as err:
        Trainer(cfg, run, resume=True, progress=False, env_factory=_corridor)
    message = str(err.value)
    assert f"Nothing in {run} was changed" in message
    assert "previous checkpoint" in message and "checkpoint.old (step 0)" in message
    assert _tree(run) == before  # not a byte of the run directory changed (config, metrics, bank, checkpoints)


def test_following_the_advice_resumes_from_the_previous_checkpoint(trained_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    _cut(run / "checkpoint" / "actor" / "model" / "model.safetensors")
    cfg = load_config(run / "config.yaml", ["train.steps=3"])
    with pytest.raises(ResumeError):
        Trainer(cfg, run, resume=True, progress=False, env_factory=_corridor)
    (run / "checkpoint").rename(run / "checkpoint.broken")
    (run / "checkpoint.old").rename(run / "checkpoint")
    trainer = Trainer(cfg, run, resume=True, progress=False, env_factory=_corridor)
    try:
        assert trainer.start_step == 1
    finally:
        trainer.close()


def test_resume_over_an_emptied_bank_is_an_error_not_a_new_bank(trained_run: Path, tmp_path: Path) -> None:
    # A 0-byte bank.sqlite once resumed as a new, empty bank (122 entries became 2) with a warning.
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    (run / "bank" / "bank.sqlite").write_bytes(b"")
    before = _tree(run)
    cfg = load_config(run / "config.yaml", ["train.steps=3"])
    with pytest.raises(BankCorruptError, match=r"bank/bank.sqlite is empty \(0 bytes\)"):
        Trainer(cfg, run, resume=True, progress=False, env_factory=_corridor)
    assert _tree(run) == before
    shutil.rmtree(run / "bank")
    with pytest.raises(FileNotFoundError, match=r"bank/bank.sqlite does not exist"):
        Trainer(cfg, run, resume=True, progress=False, env_factory=_corridor)
