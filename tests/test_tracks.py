"""BackgroundTrack + Extractor: distil → ops → bank with provenance; credits → B_φ → CISPO; counts recorded."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import jsonschema
import pytest
import torch
from _trainer_fixtures import LocalClient, corridor_factory, manager, tiny_policy

from crl_gym.experience.schemas import ops_schema
from crl_gym.protocol import (
    DistillationRequest,
    ExperienceRef,
    ReturnOp,
    Step,
    Trajectory,
    UpdateOp,
)
from crl_train.config import ExtractorSettings
from crl_train.extractor.model import Extractor, sample_key
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


def test_structured_distillation_answers_are_valid_ops_of_their_schema(policies: tuple[Any, Any]) -> None:
    _, ext_policy = policies
    extractor = Extractor(
        ext_policy,
        ExtractorSettings(
            max_new_tokens=40,
            max_context_tokens=1024,
            max_prompt_chars=600,
            constrained=True,
            max_entry_chars=48,
        ),
    )
    reqs = [_request(True), _request(False, ExperienceRef(5, "Walk east.", 0))] * 4
    for r, (s, ops) in zip(reqs, extractor.distill(reqs), strict=True):
        ids = {5} if r.experience else set()
        jsonschema.validate(json.loads(s.response), ops_schema(ids, max_text=48))
        assert ops and not any(isinstance(op, ReturnOp) and op.malformed for op in ops)
        assert all(op.id == 5 for op in ops if isinstance(op, UpdateOp)) and s.token_ids[-1] == ext_policy.eos_token_ids[0]


def test_sync_track_distils_credits_trains_and_records_counts(policies: tuple[Any, Any]) -> None:
    actor, ext_policy = policies
    mgr = manager()
    extractor = Extractor(
        ext_policy,
        ExtractorSettings(
            max_new_tokens=40,
            max_context_tokens=1024,
            max_prompt_chars=800,
            constrained=True,
            cooldown=0,
            alpha=0.5,
        ),
    )
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
    # unstructured random model: its text is not an op → a counted malformed Return, bank unchanged
    extractor = Extractor(
        ext_policy,
        ExtractorSettings(
            max_new_tokens=8,
            max_context_tokens=1024,
            max_prompt_chars=600,
            structured=False,
        ),
    )
    track = BackgroundTrack(mgr, extractor, buffer_size=64, asynchronous=False)
    mgr.submit(_request(False))
    track.run_until_idle()
    assert track.stats.malformed + track.stats.returned >= 1 and len(mgr.bank) == 1 + track.stats.added
    seed_id = mgr.bank.ids()[0]
    track.credit([Credit(step=0, reward=1.0, entry_id=seed_id), Credit(step=0, reward=1.0, entry_id=999)])
    track.run_until_idle()
    assert track.stats.uncreditable == 2 and track.buffer == []
    mgr.close()


def recorded_distills(extractor: Extractor, monkeypatch: pytest.MonkeyPatch) -> list[tuple[DistillationRequest, Any]]:
    """Every (request, (sample, ops)) that ``extractor.distill`` answers from now on, in order."""
    calls: list[tuple[DistillationRequest, Any]] = []
    distill = extractor.distill

    def recording(reqs: Any) -> Any:
        out = distill(reqs)
        calls.extend(zip(reqs, out, strict=True))
        return out

    monkeypatch.setattr(extractor, "distill", recording)
    return calls


@pytest.mark.parametrize("return_reward", [None, 0.5])
def test_return_only_answers_enter_the_buffer_only_with_the_return_reward_option(
        policies: tuple[Any, Any], return_reward: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    _, ext_policy = policies
    mgr = manager()
    extractor = Extractor(
        ext_policy,
        ExtractorSettings(
            max_new_tokens=40,
            max_context_tokens=1024,
            max_prompt_chars=800,
            constrained=True,
        ),
    )
    track = BackgroundTrack(mgr, extractor, buffer_size=64, asynchronous=False, return_reward=return_reward)
    calls = recorded_distills(extractor, monkeypatch)
    torch.manual_seed(0)
    for s in (True, False) * 4:
        mgr.submit(_request(s))
    track.run_until_idle()
    answers = [[json.loads(sample.response)[i]["op"] for i in range(len(ops))] for _, (sample, ops) in calls]
    returns = sum(all(op == "return" for op in a) for a in answers)
    assert len(answers) == 8 and 0 < returns < 8, answers  # the seeded random extractor answers both ways
    if return_reward is None:  # the paper's rule: nothing in B_φ until an entry is credited
        assert track.buffer == [] and track.stats.credited_returns == 0
    else:
        assert track.stats.credited_returns == len(track.buffer) == returns
        assert all(b.reward == 0.5 and b.entry_id is None and b.sample.token_ids for b in track.buffer)
        assert all(all(op["op"] == "return" for op in json.loads(b.sample.response)) for b in track.buffer)
    mgr.close()


def test_distill_fraction_distils_a_seeded_share_and_the_same_one_on_a_resend(
        policies: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    _, ext_policy = policies
    extractor = Extractor(
        ext_policy,
        ExtractorSettings(
            max_new_tokens=16,
            max_context_tokens=1024,
            max_prompt_chars=400,
            constrained=True,
        ),
    )
    calls = recorded_distills(extractor, monkeypatch)

    def distilled_tasks(fraction: float, seed: int) -> list[str]:
        """The tasks the track distils out of 24 distinct episodes (new request ids on every call)."""
        calls.clear()
        mgr = manager()
        track = BackgroundTrack(mgr, extractor, buffer_size=64, asynchronous=False, train=False,
                                distill_fraction=fraction, draw_seed=seed)
        for i in range(24):
            mgr.submit(DistillationRequest(task=f"Walk to cell {i}", trajectory=Trajectory(steps=[Step("cell 0", "east", 0.0)]),
                                           outcome=0.0, success=False, experience=None))
        track.run_until_idle()
        seen = [r.task for r, _ in calls]
        assert track.stats.distilled == len(seen) and track.stats.undrawn == 24 - len(seen) and mgr.pending() == 0
        mgr.close()
        return seen

    assert len(distilled_tasks(1.0, 0)) == 24  # the default: every episode
    half = distilled_tasks(0.5, 0)
    assert 0 < len(half) < 24, half  # 24 draws of a fair coin: all or none has probability 2^-23
    assert distilled_tasks(0.5, 0) == half  # new request ids, the same episodes: the same draw
    assert distilled_tasks(0.5, 1) != half  # another seed draws others


def test_async_track_never_blocks_and_drains_queue(policies: tuple[Any, Any]) -> None:
    actor, ext_policy = policies
    mgr = manager()
    client = LocalClient(mgr)
    extractor = Extractor(
        ext_policy,
        ExtractorSettings(
            max_new_tokens=40,
            max_context_tokens=1024,
            max_prompt_chars=600,
            constrained=True,
        ),
    )
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
    extractor = Extractor(
        ext_policy,
        ExtractorSettings(
            max_new_tokens=40,
            max_context_tokens=1024,
            max_prompt_chars=600,
            constrained=True,
        ),
    )
    track = BackgroundTrack(mgr, extractor, buffer_size=64, asynchronous=False)
    (sample,) = extractor.generate(["p"], [["RETURN: nothing new", "ADD: x"]])
    (s2, _), = extractor.distill([_request(True)])
    track.credit([Credit(step=3, reward=-1.0, sample=sample), Credit(step=3, reward=1.0, sample=s2)])
    state = json.loads(json.dumps(track.state()))  # a checkpoint is JSON
    other_extractor = Extractor(ext_policy, ExtractorSettings(constrained=True))
    other = BackgroundTrack(mgr, other_extractor, buffer_size=64, asynchronous=False)
    other.load_state(state)
    assert [b.to_dict() for b in other.buffer] == [b.to_dict() for b in track.buffer]
    assert other.extractor.constraints == extractor.constraints and len(other.buffer) == 2
    # the grammar sample's grammar survives (written once, under "constraints", which the track carries)
    assert other.extractor.grammars == extractor.grammars and sample_key(s2) in other.extractor.grammars
    assert other.extractor.allowed_of(s2) == extractor.allowed_of(s2) is not None
    mgr.close()


def test_thinking_extractor_reasons_then_answers_under_the_schema_and_recomputes_its_logprobs(
        policies: tuple[Any, Any]) -> None:
    _, ext_policy = policies
    extractor = Extractor(
        ext_policy,
        ExtractorSettings(
            max_new_tokens=96,
            max_context_tokens=1024,
            max_prompt_chars=600,
            constrained=True,
            think_tokens=12,
            max_entry_chars=48,
        ),
    )
    torch.manual_seed(0)
    reqs = [_request(True), _request(False)]
    out = extractor.distill(reqs)
    eos = ext_policy.eos_token_ids[0]
    for s, ops in out:
        jsonschema.validate(json.loads(s.response), ops_schema(set(), max_text=48))  # the reasoning never reaches the answer
        assert ops and s.token_ids[-1] == eos and len(s.token_ids) > 12
        assert eos not in s.token_ids[:12]
        cons = extractor.allowed_of(s)
        assert cons is not None and len(cons) == len(s.token_ids)
        assert all(a is cons[0] for a in cons[:12]) and len(cons[0]) > 100  # reasoning: any non-special token
        assert all(a is not None and len(a) < len(cons[0]) for a in cons[12:])  # the answer: the grammar's sets
    # the replayed masks make the recomputed log-probs those sampled (CISPO's ratio starts at 1)
    seqs = [extractor._sequence(s) for s, _ in out]
    batch = TrainBatch.from_sequences(seqs, [0.0, 0.0], ext_policy.pad_token_id)
    new = ext_policy.logprobs(batch)
    for i, (s, _) in enumerate(out):
        start = len(s.prompt_token_ids)
        assert torch.allclose(new[i, start : start + len(s.token_ids)], torch.tensor(s.logprobs), atol=1e-4)
    # without the masks they differ: the replay matters
    bare = TrainBatch.from_sequences(seqs, [0.0, 0.0], ext_policy.pad_token_id)
    bare.constraints = None
    free = ext_policy.logprobs(bare)
    assert not torch.allclose(free, new, atol=1e-3)
    # a checkpoint writes the grammar once, and reads back to the same grammars and masks
    state = json.loads(json.dumps(extractor.get_state()))
    assert sum(k.startswith("grammar:") for k in state["constraints"]) == 1 and state["allowed_sets"] == []
    other = Extractor(ext_policy, ExtractorSettings(constrained=True, think_tokens=12))
    other.set_state(state)
    assert other.grammars == extractor.grammars and other.allowed_of(out[0][0]) == extractor.allowed_of(out[0][0])
    # the older checkpoint form (sets written inline) still loads
    inline = {"k": [[1, 2], None]}
    other.set_state({"version": 3, "constraints": inline})
    assert other.constraints == {"k": [(1, 2), None]} and other.version == 3 and other.grammars == {}
    # a state whose references point past its sets, or to a grammar it lacks, is refused, naming the problem
    with pytest.raises(ValueError, match="refers to allowed set 1, but the state holds 1 sets"):
        other.set_state({"allowed_sets": [[1]], "constraints": {"k": [0, 1]}})
    key = next(k for k in state["constraints"] if not k.startswith("grammar:"))
    with pytest.raises(ValueError, match="refers to grammar"):
        other.set_state({"constraints": {key: state["constraints"][key]}})
    assert other.version == 3  # nothing changed on a refused state


def test_think_tokens_need_a_structured_extractor(policies: tuple[Any, Any]) -> None:
    with pytest.raises(ValueError, match="needs structured=True"):
        Extractor(policies[1], ExtractorSettings(structured=False, think_tokens=4))
    with pytest.raises(ValueError, match="needs structured=True"):
        Extractor(policies[1], ExtractorSettings(structured=False, constrained=True))


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
