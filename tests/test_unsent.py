"""The wrappers' spill file lives in the run directory (the bank directory holds the queue's only),
and a restart queues what it holds, and what an older run left in its bank directory, once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from crl_gym import spill
from crl_gym.protocol import DistillationRequest, Trajectory
from crl_gym.wrappers.examples import CorridorEnv
from crl_gym.wrappers.experience import ExperienceWrapper
from crl_train.config import load_config
from crl_train.run.trainer import Trainer
from crl_train.run.unsent import UNSENT_FILE

SMALL = ["method=complementary", "env.ids=[corridor]", "env.tasks_per_step=1", "env.group_size=2", "env.max_turns=2",
         "train.eval_episodes=0", "actor.tiny_vocab_size=300", "extractor.tiny_vocab_size=300", "actor.tiny_hidden=32",
         "extractor.tiny_hidden=32", "actor.tiny_layers=1", "extractor.tiny_layers=1", "algo.buffer_size=2",
         "algo.merge_every=0", "experience.asynchronous=false", "experience.max_prompt_chars=600",
         "extractor.max_context_tokens=512", "train.checkpoint_every=1", "train.steps=1"]


def _corridor(env_id: str) -> Any:
    return CorridorEnv(length=1, max_turns=2)


def _line(task: str, step: int) -> str:
    return json.dumps(DistillationRequest(task, Trajectory(), 1.0, True, None, rollout_step=step).to_dict())


def _tasks(trainer: Trainer) -> list[str]:
    return [r.task for r in trainer.c.service.manager.get_requests(10**6)]


def test_wrappers_spill_into_the_run_dir_and_a_restart_queues_both_places_once(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = load_config(None, SMALL)
    trainer = Trainer(cfg, run, progress=False, env_factory=_corridor)
    try:
        env = trainer.c.runner.make_env("corridor")
        assert isinstance(env, ExperienceWrapper) and env.spill_path == run / UNSENT_FILE
        trainer.run()
        end_state = trainer.c.service.ledger.late
    finally:
        trainer.close()
    bank_files = sorted(p.name for p in (run / "bank").glob("*.jsonl"))
    assert UNSENT_FILE not in bank_files and "pending_requests.jsonl" in bank_files
    # what a start whose client was down leaves: the run dir's file, and an older run's in bank/
    spill.append(run / UNSENT_FILE, [_line("new-place-a", 0), _line("new-place-b", 0)])
    spill.append(run / "bank" / UNSENT_FILE, [_line("old-place", 0), "{broken"])

    trainer = Trainer(load_config(run / "config.yaml", []), run, resume=True, progress=False, env_factory=_corridor)
    try:
        tasks = _tasks(trainer)
        assert [t for t in tasks if "place" in t] == ["new-place-a", "new-place-b", "old-place"]
        assert not (run / UNSENT_FILE).exists() and not (run / "bank" / UNSENT_FILE).exists()
        assert spill.rejected_path(run / "bank" / UNSENT_FILE).read_bytes() == b"{broken\n"
        # queued for distillation, kept out of every step's credit
        assert trainer.c.service.ledger.open_requests() == 0 and trainer.c.service.ledger.late == end_state
    finally:
        trainer.close()

    # taken from the queue above: a further start delivers none of them again
    trainer = Trainer(load_config(run / "config.yaml", []), run, resume=True, progress=False, env_factory=_corridor)
    try:
        assert not [t for t in _tasks(trainer) if "place" in t]
    finally:
        trainer.close()
