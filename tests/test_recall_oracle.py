"""The oracle extractor (``extractor.model: oracle``) and what it buys an actor on crl/Recall-v0.

Unit tests of its ops, then the service and the run built around it, then the end-to-end check:
a guided method with the oracle fills the bank with the winning actions of the tasks it solved,
and an actor trained on its guided successes succeeds more often with the bank than without it on
those tasks, by a margin read from the episode counts (disjoint 95 % Wilson intervals).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from crl_gym.envs.recall import RecallEnv  # noqa: E402
from crl_gym.experience.bank import ExperienceBank  # noqa: E402
from crl_gym.experience.embedders import HashingEmbedder  # noqa: E402
from crl_gym.experience.manager import ExperienceManager  # noqa: E402
from crl_gym.experience.merge import merge_bank  # noqa: E402
from crl_gym.protocol import AddOp, DistillationRequest, ExperienceRef, ReturnOp, Step, Trajectory  # noqa: E402
from crl_train.algorithms import LOSSES, PolicyLoss  # noqa: E402
from crl_train.config import ConfigError, load_config  # noqa: E402
from crl_train.config.docs import config_reference  # noqa: E402
from crl_train.extractor import OracleExtractor  # noqa: E402
from crl_train.extractor.oracle import oracle_entry  # noqa: E402
from crl_train.policy.base import TrainBatch  # noqa: E402
from crl_train.rollout.tasks import eval_task_seeds, task_seeds  # noqa: E402
from crl_train.run.evaluate import evaluate_run  # noqa: E402
from crl_train.run.trainer import Trainer  # noqa: E402
from crl_train.service import ExperienceService, ServiceOptions  # noqa: E402


def _request(actions: list[str], ok: bool, *, task: str = "Task amber badger: repeat the 2 secret actions of amber badger.",
             invalid: tuple[int, ...] = (), step: int | None = 0, experience: ExperienceRef | None = None) -> DistillationRequest:
    steps = [Step("obs", a, info={"invalid_action": i in invalid}) for i, a in enumerate(actions)]
    steps.insert(1, Step("advice", "search_and_ask[what now?]", kind="search_and_ask"))
    return DistillationRequest(task, Trajectory(steps), float(ok), ok, experience,
                               condition="guided" if experience else "free", env_id="crl/Recall-v0", rollout_step=step)


def _recall_entries(env: RecallEnv) -> dict[int, tuple[str, str]]:
    """Task index → (task text, the oracle's entry for its secret)."""
    out = {}
    for i in range(env.num_tasks):
        env.reset(seed=i)
        out[i] = (env.task, oracle_entry(_request(list(env.secret), True, task=env.task)))
    return out


# ------------------------------------------------------------------------------------ the ops


def test_a_success_becomes_its_env_actions_verbatim_and_a_failure_writes_nothing() -> None:
    (s_ok, ops_ok), (s_bad, ops_bad) = OracleExtractor().distill(
        [_request(["north", "jump", "east"], True, invalid=(1,)), _request(["north"], False)])
    assert ops_ok == [AddOp("Task amber badger: repeat the 2 secret actions of amber badger. "
                            "Winning actions, one per line:\nnorth\neast")]
    assert len(ops_bad) == 1 and isinstance(ops_bad[0], ReturnOp) and not ops_bad[0].malformed
    for s in (s_ok, s_bad):  # nothing a model could be trained on
        assert s.token_ids == [] and s.logprobs == [] and s.prompt_token_ids == []


def test_refine_reflect_and_merge_leave_exact_entries_alone() -> None:
    oracle = OracleExtractor()
    entry = ExperienceRef(3, "Task x. Winning actions, one per line:\neast")
    assert oracle.refine("what now?", entry, "context") == (entry.text, None)
    _, ops = oracle.reflect("amber badger", [_request(["east"], False)], [_request(["north", "east"], True)] * 2)
    assert ops == [AddOp(oracle_entry(_request(["north", "east"], True)))]  # duplicates collapse
    _, ops = oracle.reflect("amber badger", [_request(["east"], False)], [])
    assert isinstance(ops[0], ReturnOp)
    emb = HashingEmbedder(64)
    bank = ExperienceBank(None, dim=64)
    texts = ["walk east", "walk east", "open the door"]
    for t in texts:
        bank.add(t, emb.encode([t])[0])
    report = merge_bank(bank, emb, oracle.merge_generate, token_budget=2000, count_tokens=oracle.count_tokens)
    assert report.ok and sorted(e.text for e in bank) == sorted(texts)
    assert oracle.trainable is False and oracle.get_state() == {"version": 0}


def test_retrieval_by_the_task_text_finds_each_tasks_own_entry() -> None:
    env = RecallEnv(num_tasks=256, length=3, num_actions=4)
    entries = _recall_entries(env)
    emb = HashingEmbedder(256)
    bank = ExperienceBank(None, dim=256)
    for _, text in entries.values():
        bank.add(text, emb.encode([text])[0])
    mgr = ExperienceManager(bank, emb)
    try:
        found = mgr.search_many([task for task, _ in entries.values()])
        assert [f[0].text for f in found] == [text for _, text in entries.values()]
    finally:
        mgr.close()


# ------------------------------------------------------------------------------------ the service and the run


def test_the_service_distils_with_the_oracle_and_never_trains_it() -> None:
    emb = HashingEmbedder(64)
    mgr = ExperienceManager(ExperienceBank(None, dim=64), emb)
    service = ExperienceService(mgr, OracleExtractor(), ServiceOptions(buffer_size=1, asynchronous=False, merge_every=1))
    try:
        assert service.track is not None and service.track.train is False
        first = mgr.apply_ops([AddOp("Task amber badger. Winning actions, one per line:\nnorth")]).added[0]
        ref = mgr.bank.get(first)
        assert ref is not None
        for r in (_request(["north", "east"], True, experience=ref.ref()), _request(["east"], False, experience=ref.ref())):
            service.submit(r)
        service.end_step(0)
        stats = service.stats().to_dict()
        assert stats["added"] == 1 and stats["returned"] == 1 and stats["extractor_updates"] == 0
        assert stats["merges"] == 1 and len(mgr.bank) == 2  # the merge kept both entries
        assert stats["uncreditable"] == 1  # the entry the guided episodes used has no sample to train on
    finally:
        service.close()


def test_the_oracle_also_serves_from_a_worker_process(tmp_path: Path) -> None:
    # crl-experience serve --extractor CONFIG and the Ray service always start a worker
    from crl_train.config import ModelConfig
    from crl_train.extractor import ExtractorSpec, ExtractorWorker

    worker = ExtractorWorker(ExtractorSpec(ModelConfig(model="oracle")))
    try:
        assert worker.trainable is False
        (_, ops), = worker.distill([_request(["north"], True)])
        assert ops == [AddOp(oracle_entry(_request(["north"], True)))]
        worker.save(tmp_path / "extractor")
        assert not (tmp_path / "extractor").exists()  # no weights, nothing written
        state = worker.get_state()  # no weights, no buffer: the version, and the process's generators (exact resume)
        assert set(state) == {"version", "rng"} and state["version"] == 0
    finally:
        worker.close()


def test_the_config_accepts_the_oracle_as_extractor_only_and_documents_it() -> None:
    assert load_config(None, ["extractor.model=oracle"]).extractor.model == "oracle"
    with pytest.raises(ConfigError, match="extractor, not an actor"):
        load_config(None, ["actor.model=oracle"])
    doc = {k.key: k.doc for k in config_reference()}["extractor.model"]
    assert "oracle" in doc and "never a default" in doc
    assert load_config(None, []).extractor.model == "tiny"


RECALL = ["env.ids=[crl/Recall-v0]", "env.kwargs={num_tasks: 64, length: 1, num_actions: 4}", "env.max_turns=2",
          "env.tasks_per_step=8", "env.group_size=8", "extractor.model=oracle", "experience.seed_entries=[]",
          "experience.asynchronous=false", "train.checkpoint_every=1000",
          # one exact entry per task: no duplicates (the vector index loses recall on hundreds of
          # identical vectors) and no diversification (it would show another task's entry)
          "manager.dedup_similarity=0.999", "manager.recency_window_s=0", "manager.diversity_lambda=0"]
"""L = 1, A = 4: the random actor succeeds a quarter of the time, so most of the 64 tasks are solved
(and written to the bank) within the first steps; 64 tasks keep memorising them apart slow."""


def test_an_oracle_run_needs_no_extractor_process_and_checkpoints_no_weights(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = load_config(None, ["method=complementary", "train.steps=1", *RECALL, "experience.asynchronous=true",
                             "env.tasks_per_step=1"])
    trainer = Trainer(cfg, tmp_path, progress=False)
    try:
        assert isinstance(trainer.c.service.extractor, OracleExtractor)  # in process: no worker to start
        trainer.run()
        assert not (tmp_path / "checkpoint" / "extractor").exists() and (tmp_path / "checkpoint" / "actor").is_dir()
    finally:
        trainer.close()
    caplog.clear()
    resumed = Trainer(cfg, tmp_path, resume=True, progress=False)  # no extractor/ to verify or to miss
    try:
        assert resumed.start_step == 1 and isinstance(resumed.c.service.extractor, OracleExtractor)
    finally:
        resumed.close()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def _train_on_guided_successes(trainer: Trainer, tasks: list[tuple[str, int]], rounds: int, epochs: int) -> None:
    """Rejection-sampling fine-tuning: collect guided episodes on ``tasks``, then next-token NLL on the
    successful ones (their prompts hold the entry), ``rounds`` times. Held-out style (step −1): the
    episodes credit nothing and their requests are dropped before they reach the bank."""
    actor = trainer.c.actor
    nll = LOSSES.get(PolicyLoss.SELF_DISTILL_NLL)
    for _ in range(rounds):
        with torch.no_grad():
            eps = trainer.c.runner.collect(tasks, guided=True, step=-1)
        trainer.c.client.get_requests(10**9)
        wins = [e for e in eps if e.condition == "guided" and e.success]
        for _ in range(epochs):
            for i in range(0, len(wins), 16):
                chunk = wins[i:i + 16]
                batch = TrainBatch.from_sequences([e.sequence for e in chunk], torch.zeros(len(chunk)), actor.pad_token_id)
                actor.train_step(batch, nll, loss_scale="tokens")


def test_guided_beats_free_on_seen_tasks_with_the_oracle_bank(tmp_path: Path) -> None:
    steps, eval_episodes = 8, 256
    cfg = load_config(None, ["method=static_online", f"train.steps={steps}", *RECALL])
    trainer = Trainer(cfg, tmp_path, progress=False)
    try:
        rows: list[dict[str, Any]] = [trainer.step(t) for t in range(steps)]
        seen = [ts for t in range(steps) for ts in task_seeds(cfg.env, t)]
        num_tasks = int(cfg.env.kwargs["num_tasks"])
        # held-out seeds, but tasks the run has seen: the task is the seed modulo num_tasks
        assert {s % num_tasks for _, s in eval_task_seeds(cfg.env, 2 * eval_episodes // cfg.env.group_size)} <= {
            s % num_tasks for _, s in seen}
        bank = trainer.c.service.manager.bank
        # one exact entry per solved task, and never a CISPO update
        assert 0.5 * num_tasks <= len(bank) <= num_tasks and rows[-1]["extractor_updates"] == 0
        assert all("Winning actions, one per line:\n" in e.text for e in bank)
        # a random-initialised actor does not copy from its prompt at first (guided ≈ free after a
        # few GRPO steps): train it on its guided successes, whose prompts hold the answer
        _train_on_guided_successes(trainer, seen, rounds=4, epochs=4)
        result = evaluate_run(trainer, eval_episodes)
    finally:
        trainer.close()
    guided, free = result["with_experience"], result["without_experience"]
    assert guided["episodes"] == free["episodes"] == eval_episodes
    # the margin is the counts' own, with each held-out task as the unit (the episodes of a task agree)
    assert result["experience_gain"]["difference_ci"][0] > 0.0, result
