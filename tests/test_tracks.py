"""BackgroundTrack + Extractor: distil → ops → bank with provenance; credits → B_φ → CISPO; counts recorded."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch
from _trainer_fixtures import LocalClient, corridor_factory, manager, tiny_policy

from crl_gym.protocol import DistillationRequest, Step, Trajectory
from crl_train.extractor.model import Extractor, candidate_ops, sample_key
from crl_train.policy.base import TrainBatch
from crl_train.rollout.runner import RolloutRunner
from crl_train.service.track import BackgroundTrack, Credit


@pytest.fixture(scope="module")
def policies() -> tuple[Any, Any]:
    return tiny_policy(0), tiny_policy(1, loss_scale="tokens")


def _request(success: bool, exp: Any = None) -> DistillationRequest:
    steps = [Step("cell 0", "east", 0.0), Step("cell 1", "west", 0.0)]
    return DistillationRequest(task="Walk east", trajectory=Trajectory(steps=steps), outcome=float(success),
                               success=success, experience=exp, condition="guided" if exp else "free")


def test_candidate_ops_are_parseable_lines() -> None:
    c = candidate_ops(_request(True))
    assert c[0].startswith("RETURN") and any(x.startswith("ADD: Moving 'east' helped") for x in c)


def test_sync_track_distils_credits_trains_and_records_counts(policies: tuple[Any, Any]) -> None:
    actor, ext_policy = policies
    mgr = manager()
    extractor = Extractor(ext_policy, max_new_tokens=40, max_context_tokens=1024, max_prompt_chars=800, constrained=True,
                          cooldown=0, alpha=0.5)
    track = BackgroundTrack(mgr, extractor, buffer_size=2, asynchronous=False)
    torch.manual_seed(0)
    rounds = 0
    while len(mgr.bank) == 0 and rounds < 10:  # a random extractor may choose RETURN; retry a few batches
        for s in (True, False, True, False):
            mgr.submit(_request(s))
        track.run_until_idle()
        rounds += 1
    assert track.stats.distilled == 4 * rounds and mgr.pending() == 0
    assert track.stats.cpu_s > 0  # the passes' CPU in this process is accounted
    adds = track.stats.added
    assert len(mgr.bank) == adds
    entries = list(mgr.bank)
    assert all(e.provenance is not None and e.provenance.token_ids and e.provenance.logprobs for e in entries)
    assert entries, "10 batches of distillation produced no entry"
    e0 = entries[0]
    v0 = extractor.version
    track.credit([Credit(step=0, reward=1.0, entry_id=e0.id), Credit(step=0, reward=-1.0, entry_id=e0.id)])
    track.run_until_idle()
    assert track.stats.updates == 1 and extractor.version == v0 + 1
    trained = mgr.bank.get(e0.id)
    assert trained is not None and trained.train_count == 1 and trained.last_trained_step == track.ext_step == 1
    assert track.stats.last_update.get("skipped") == 0.0 and track.buffer == []
    mgr.close()


def test_uncreditable_and_malformed_are_counted(policies: tuple[Any, Any]) -> None:
    _, ext_policy = policies
    mgr = manager(("seed entry without provenance",))
    # unconstrained random model: its text is not an op → a counted malformed Return, bank unchanged
    extractor = Extractor(ext_policy, max_new_tokens=8, max_context_tokens=1024, max_prompt_chars=600, constrained=False)
    track = BackgroundTrack(mgr, extractor, buffer_size=64, asynchronous=False)
    mgr.submit(_request(False))
    track.run_until_idle()
    assert track.stats.malformed + track.stats.returned >= 1 and len(mgr.bank) == 1 + track.stats.added
    seed_id = mgr.bank.ids()[0]
    track.credit([Credit(step=0, reward=1.0, entry_id=seed_id), Credit(step=0, reward=1.0, entry_id=999)])
    track.run_until_idle()
    assert track.stats.uncreditable == 2 and track.buffer == []
    mgr.close()


def test_async_track_never_blocks_and_drains_queue(policies: tuple[Any, Any]) -> None:
    actor, ext_policy = policies
    mgr = manager()
    client = LocalClient(mgr)
    extractor = Extractor(ext_policy, max_new_tokens=40, max_context_tokens=1024, max_prompt_chars=600, constrained=True)
    track = BackgroundTrack(mgr, extractor, buffer_size=64, asynchronous=True)
    track.start()
    runner = RolloutRunner(actor, corridor_factory(client, max_turns=2), client=client, group_size=2, max_turns=2, max_new_tokens=4, constrained=True)
    eps = runner.collect([("c", 0)], guided=True)
    assert all(e.request is not None for e in eps)  # submitted by the wrapper, without waiting
    deadline = time.time() + 60
    while track.stats.distilled < 2 and time.time() < deadline:
        time.sleep(0.05)
    track.stop()
    assert track.stats.distilled == 2 and track.stats.errors == 0
    mgr.close()


def test_state_roundtrip(policies: tuple[Any, Any]) -> None:
    _, ext_policy = policies
    mgr = manager()
    extractor = Extractor(ext_policy, max_new_tokens=40, max_context_tokens=1024, max_prompt_chars=600, constrained=True)
    track = BackgroundTrack(mgr, extractor, buffer_size=64, asynchronous=False)
    (sample,) = extractor.generate(["p"], [["RETURN: nothing new", "ADD: x"]])
    track.credit([Credit(step=3, reward=-1.0, sample=sample)])
    state = track.state()
    other = BackgroundTrack(mgr, Extractor(ext_policy, constrained=True), buffer_size=64, asynchronous=False)
    other.load_state(state)
    assert [b.to_dict() for b in other.buffer] == [b.to_dict() for b in track.buffer]
    assert other.extractor.constraints == extractor.constraints and len(other.buffer) == 1
    mgr.close()


def test_thinking_extractor_reasons_then_answers_one_op_and_recomputes_its_logprobs(policies: tuple[Any, Any]) -> None:
    _, ext_policy = policies
    extractor = Extractor(ext_policy, max_new_tokens=96, max_context_tokens=1024, max_prompt_chars=600,
                          constrained=True, think_tokens=12)
    torch.manual_seed(0)
    reqs = [_request(True), _request(False)]
    out = extractor.distill(reqs)
    eos = ext_policy.eos_token_ids[0]
    for r, (s, ops) in zip(reqs, out, strict=True):
        assert s.response in candidate_ops(r)  # the reasoning never reaches the answer
        assert len(ops) == 1 and s.token_ids[-1] == eos and len(s.token_ids) > 12
        assert eos not in s.token_ids[:12]
        cons = extractor.constraints[sample_key(s)]
        assert all(a is cons[0] for a in cons[:12]) and len(cons[0]) > 100  # reasoning: any non-special token
    # the stored masks make the recomputed log-probs those sampled (CISPO's ratio starts at 1)
    seqs = [extractor._sequence(s) for s, _ in out]
    batch = TrainBatch.from_sequences(seqs, [0.0, 0.0], ext_policy.pad_token_id)
    new = ext_policy.logprobs(batch)
    for i, (s, _) in enumerate(out):
        start = len(s.prompt_token_ids)
        assert torch.allclose(new[i, start : start + len(s.token_ids)], torch.tensor(s.logprobs), atol=1e-4)
    # a checkpoint writes the shared reasoning set once, and reads back to the same constraints
    state = extractor.get_state()
    assert sum(len(a) > 100 for a in state["allowed_sets"]) == 1
    other = Extractor(ext_policy, constrained=True, think_tokens=12)
    other.set_state(state)
    assert other.constraints == extractor.constraints
    # the older checkpoint form (sets written inline) still loads
    inline = {k: [list(a) if a is not None else None for a in v] for k, v in extractor.constraints.items()}
    other.set_state({"version": 3, "constraints": inline})
    assert other.constraints == extractor.constraints and other.version == 3
    # a state whose references point past its sets is refused, naming the problem
    bad = {**state, "allowed_sets": state["allowed_sets"][:1]}
    with pytest.raises(ValueError, match="refers to allowed set 1, but the state holds 1 sets"):
        other.set_state(bad)


def test_think_tokens_need_a_constrained_extractor(policies: tuple[Any, Any]) -> None:
    with pytest.raises(ValueError, match="needs constrained=True"):
        Extractor(policies[1], constrained=False, think_tokens=4)


# --- through the trainer: sync waits, async uses the worker, a dead worker costs nothing but counts ------------

SMALL = ["method=complementary", "env.ids=[corridor]", "env.tasks_per_step=2", "env.group_size=4", "env.max_turns=3",
         "train.eval_episodes=0", "actor.tiny_vocab_size=300", "extractor.tiny_vocab_size=300", "actor.tiny_hidden=32",
         "extractor.tiny_hidden=32", "actor.tiny_layers=1", "extractor.tiny_layers=1", "algo.buffer_size=2",
         "algo.merge_every=2", "algo.cooldown=0", "experience.max_prompt_chars=600", "extractor.max_context_tokens=512"]


def _corridor(env_id: str) -> Any:
    from crl_gym.wrappers.examples import CorridorEnv

    return CorridorEnv(length=1, max_turns=3)


def _wait(cond: Any, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "background track did not catch up in time"
        time.sleep(0.05)


def test_sync_step_returns_only_after_distillation_and_update(tmp_path: Any) -> None:
    from crl_train.config import load_config
    from crl_train.run.trainer import Trainer

    cfg = load_config(None, [*SMALL, "experience.asynchronous=false"])
    trainer = Trainer(cfg, tmp_path, progress=False, env_factory=_corridor)
    try:
        assert isinstance(trainer.c.service.extractor, Extractor)  # auto: a synchronous run keeps π_φ in process
        st = trainer.c.service.track.stats
        for t in range(3):
            row = trainer.step(t)
            # when the actor's step returns, every request of it is distilled and every credit is in B_φ …
            assert row["queue_depth"] == 0 and row["distilled"] == st.distilled == 8 * (t + 1)
            assert trainer.c.service.track.credits.empty()
            # … and B_φ was trained on as soon as it held buffer_size (2) samples: none is left waiting
            assert len(trainer.c.service.track.buffer) < 2 and 2 * st.updates + len(trainer.c.service.track.buffer) == st.credited
    finally:
        trainer.close()


@pytest.mark.slow
def test_async_trainer_uses_the_worker_and_survives_its_death(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    import os
    import signal

    from crl_gym.protocol import ExperienceRef
    from crl_train.config import load_config
    from crl_train.extractor.worker import ExtractorWorker
    from crl_train.run.trainer import Trainer

    cfg = load_config(None, [*SMALL, "experience.asynchronous=true", "experience.search_and_ask=true"])
    trainer = Trainer(cfg, tmp_path, progress=False, env_factory=_corridor)
    c = trainer.c
    worker = c.service.extractor
    try:
        assert isinstance(worker, ExtractorWorker) and worker.pid != os.getpid()
        # search_and_ask refinements asked by the wrappers go to the worker too
        assert c.service.manager.refiner == worker.refine
        _, prov = c.client.ask("I am stuck", ExperienceRef(1, "Walk east.", 0), "cell 0")
        assert prov is not None and prov["token_ids"] and prov["extractor_version"] == 0
        c.service.track.start()
        for t in range(2):
            trainer.step(t)
        _wait(lambda: c.service.track.stats.distilled == 16 and c.service.manager.pending() == 0)
        trainer.checkpoint(1)
        assert (tmp_path / "checkpoint" / "extractor" / "policy_state.pt").exists()

        os.kill(worker.wait_ready(), signal.SIGKILL)
        with caplog.at_level(logging.ERROR):
            trainer.step(2)  # rollouts (refinements fall back to the raw entry) and the actor update go on
            _wait(lambda: c.service.track.stats.skipped_distill == 8 and c.service.manager.pending() == 0)
            row = trainer.step(3)
            trainer.checkpoint(3)  # the previous extractor weights are carried over
        assert row["extractor_alive"] is False and row["skipped_distill"] >= 8 and row["track_errors"] == 0
        assert (tmp_path / "checkpoint" / "extractor" / "policy_state.pt").exists()
        assert any("extractor worker died" in r.getMessage() for r in caplog.records)
    finally:
        c.service.track.stop()
        trainer.close()
    assert not worker.process.is_alive()
