"""ExperienceService: what ending a step credits, EDGE's utility, step order, sync mode, state.

The extractor is a real tiny one in this process; the numbers the service must produce are
worked out by hand in each test.
"""

from __future__ import annotations

from typing import Any

import pytest
from _trainer_fixtures import manager, tiny_policy

from crl_gym.experience.service import ClosedStep, StepOrderError
from crl_gym.protocol import AddOp, DistillationRequest, ExperienceRef, SearchCall, Trajectory
from crl_train.config import ExtractorSettings
from crl_train.extractor import Extractor
from crl_train.service import EdgeUtility, ExperienceService, ServiceOptions
from crl_train.service.credit import group_gains, step_credits, utility_updates


@pytest.fixture(scope="module")
def extractor() -> Extractor:
    return Extractor(
        tiny_policy(1, loss_scale="tokens"),
        ExtractorSettings(
            max_new_tokens=8,
            max_context_tokens=512,
            max_prompt_chars=400,
            constrained=True,
            cooldown=0,
        ),
    )


def _req(entry: int | None, ok: bool, step: int | None, *, cond: str = "guided", seed: int = 0,
         calls: list[SearchCall] | None = None) -> DistillationRequest:
    exp = ExperienceRef(entry, "advice") if entry is not None else None
    return DistillationRequest(task="walk east", trajectory=Trajectory(search_calls=calls or []), outcome=float(ok),
                               success=ok, experience=exp, condition=cond, env_id="corridor", seed=seed,  # type: ignore[arg-type]
                               rollout_step=step)


def _service(extractor: Extractor, **options: Any) -> tuple[ExperienceService, list[int]]:
    """A service (no distillation, B_φ never full) over two creditable entries (written with a sample)."""
    mgr = manager()
    sample = extractor.generate(["advice?"])[0]
    ids = mgr.apply_ops([AddOp("walk east"), AddOp("avoid the wall")], sample=sample).added
    opts = ServiceOptions(**{"distill": False, "buffer_size": 10_000, "asynchronous": False, **options})
    return ExperienceService(mgr, extractor, opts), ids


def test_step_credits_average_the_outcomes_per_entry_and_add_the_gate_bonus() -> None:
    reqs = [_req(7, True, 0), _req(7, False, 0), _req(7, True, 0), _req(9, False, 0), _req(None, True, 0, cond="free")]
    step = ClosedStep(0, reqs)
    # entry 7: (+1 − 1 + 1) / 3; entry 9: −1; the free episode credits nothing
    assert [(c.entry_id, round(c.reward, 6)) for c in step_credits(step)] == [(7, round(1 / 3, 6)), (9, -1.0)]
    step.bonus = {reqs[1].request_id: 0.5, reqs[3].request_id: 1.0}  # refine on a failure, accept on a failure
    assert [(c.entry_id, round(c.reward, 6)) for c in step_credits(step)] == [(7, round(1.5 / 3, 6)), (9, 0.0)]


def test_a_refinement_is_credited_with_its_episodes_outcome(extractor: Extractor) -> None:
    sample = extractor.generate(["refine?"])[0]
    call = SearchCall(query="q", answer="a", refined=True, provenance=sample.to_dict())
    credits = step_credits(ClosedStep(4, [_req(None, False, 4, cond="free", calls=[call])]))
    assert [(c.step, c.reward, c.entry_id) for c in credits] == [(4, -1.0, None)]
    assert credits[0].sample.token_ids == sample.token_ids


def test_edge_gain_and_utility_by_hand() -> None:
    # group seed 0: guided [1, 0] → 0.5, free [0, 0] → 0: Δe = 0.5; group seed 1: guided [0], free [1]: Δe = −1
    reqs = [_req(3, True, 0), _req(3, False, 0), _req(None, False, 0, cond="free"), _req(None, False, 0, cond="free"),
            _req(5, False, 0, seed=1), _req(None, True, 0, cond="free", seed=1)]
    step = ClosedStep(0, reqs)
    assert group_gains(reqs) == {("corridor", 0): 0.5, ("corridor", 1): -1.0}
    ups = utility_updates(step, {3: 0.0, 5: 0.2}, momentum=0.9, prune_below=-0.05)
    # U3 = 0.9·0 + 0.1·0.5 = 0.05 (kept); U5 = 0.9·0.2 + 0.1·(−1) = 0.08 (kept, ≥ −0.05)
    assert [(u.entry_id, round(u.utility, 6), u.prune) for u in ups] == [(3, 0.05, False), (5, 0.08, False)]
    ups = utility_updates(step, {3: 0.0, 5: -0.1}, momentum=0.9, prune_below=-0.05)
    assert [(u.entry_id, round(u.utility, 6), u.prune) for u in ups] == [(3, 0.05, False), (5, -0.19, True)]


def test_end_step_credits_its_entries_once_in_sync_mode(extractor: Extractor) -> None:
    service, (a, b) = _service(extractor)
    try:
        for r in (_req(a, True, 0), _req(a, False, 0), _req(a, True, 0), _req(b, False, 0)):
            service.submit(r)
        out = service.end_step(0)
        assert out.ended == [0] and out.requests == 4 and out.credited == 2
        buffer = service.track.buffer if service.track is not None else []
        assert sorted((it.entry_id, round(it.reward, 6)) for it in buffer) == sorted([(a, round(1 / 3, 6)), (b, -1.0)])
        stats = service.stats()
        assert stats.credited == 2 and stats.last_ended_step == 0
        with pytest.raises(StepOrderError, match="already ended"):
            service.end_step(0)
        service.submit(_req(a, True, 0))  # late: its step's rewards are already computed
        service.end_step(1)
        assert service.stats().late_requests == 1 and len(buffer) == 2  # nothing credited twice
        with pytest.raises(StepOrderError, match="out of order"):
            service.end_step(0)
    finally:
        service.close()


def test_end_step_ends_every_earlier_open_step_and_open_step_requests(extractor: Extractor) -> None:
    service, (a, _) = _service(extractor)
    try:
        service.submit(_req(a, True, 0))
        service.submit(_req(a, False, None))  # no step given: belongs to the open step, 0
        service.submit(_req(a, True, 1))
        out = service.end_step(2)
        assert out.ended == [0, 1, 2] and out.requests == 3
        assert sorted(round(it.reward, 6) for it in service.track.buffer) == [0.0, 1.0]  # type: ignore[union-attr]
    finally:
        service.close()


def test_edge_options_update_utilities_and_prune_through_the_service(extractor: Extractor) -> None:
    service, (a, b) = _service(extractor, train=False, edge=EdgeUtility(momentum=0.5, prune_below=-0.2))
    try:
        # seed 0: entry a guided [1], free [0] → Δe = 1; seed 1: entry b guided [0], free [1] → Δe = −1
        for r in (_req(a, True, 0), _req(None, False, 0, cond="free"),
                  _req(b, False, 0, seed=1), _req(None, True, 0, cond="free", seed=1)):
            service.submit(r)
        service.end_step(0)
        bank = service.manager.bank
        entry_a = bank.get(a)
        assert entry_a is not None and entry_a.utility == pytest.approx(0.5)  # 0.5·0 + 0.5·1
        assert bank.get(b) is None and service.stats().counters["pruned"] == 1  # 0.5·0 + 0.5·(−1) = −0.5 < −0.2
    finally:
        service.close()


def test_state_round_trip_keeps_the_last_step_and_the_buffer(extractor: Extractor) -> None:
    service, (a, _) = _service(extractor)
    try:
        service.submit(_req(a, True, 0))
        service.end_step(0)
        state = service.state()
    finally:
        service.close()
    other, _ = _service(extractor)
    try:
        other.load_state(state)
        assert other.ledger.last_ended == 0 and len(other.track.buffer) == 1  # type: ignore[union-attr]
        with pytest.raises(StepOrderError):
            other.end_step(0)
    finally:
        other.close()


def test_options_and_extractor_must_agree(extractor: Extractor) -> None:
    with pytest.raises(ValueError, match="extractor"):
        ExperienceService(manager(), None, ServiceOptions())
    with pytest.raises(ValueError, match="extractor"):
        ExperienceService(manager(), extractor, ServiceOptions(extractor=False))


@pytest.mark.parametrize("module", ["crl_gym.experience.service", "crl_train.service.credit", "crl_train.methods",
                                    "crl_train.rollout.tasks", "crl_train.run.outputs"])
def test_docstring_examples(module: str) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


def test_a_group_without_free_episodes_has_no_gain() -> None:
    reqs = [_req(3, True, 0), _req(None, False, 0, cond="free"), _req(4, True, 0, seed=1)]  # seed 1: guided only
    assert group_gains(reqs) == {("corridor", 0): 1.0}
    ups = utility_updates(ClosedStep(0, reqs), {3: 0.0, 4: 0.0}, momentum=0.5, prune_below=-1.0)
    assert [(u.entry_id, u.utility) for u in ups] == [(3, 0.5)]


def test_held_out_requests_are_counted_and_never_credited(extractor: Extractor) -> None:
    service, (a, _) = _service(extractor)
    try:
        service.submit(_req(a, True, -1))  # an evaluation episode
        assert service.end_step(0).requests == 0
        assert service.stats().held_out_requests == 1 and service.stats().late_requests == 0
    finally:
        service.close()


def test_gate_verdicts_add_their_score_and_a_rejected_entry_is_still_credited() -> None:
    accepted = _req(7, True, 0)
    accepted.meta["gate"] = {"verdict": "accept", "entry": 7, "score": 1.0}
    rejected = _req(None, False, 0)  # the episode ran without the entry it rejected
    rejected.meta["gate"] = {"verdict": "reject", "entry": 7, "score": 0.0}
    refined = _req(9, False, 0)
    refined.meta["gate"] = {"verdict": "refine", "entry": 9, "score": 0.5}
    credits = step_credits(ClosedStep(0, [accepted, rejected, refined]))
    # r̃ = s_c + r: entry 7 → ((1 + 1) + (0 − 1)) / 2 = 0.5; entry 9 → 0.5 − 1 = −0.5
    assert [(c.entry_id, c.reward) for c in credits] == [(7, 0.5), (9, -0.5)]


def test_relative_entry_reward_subtracts_the_free_subgroup_mean() -> None:
    # group: guided a ✓, guided a ✗, free ✓, free ✗ → free mean ±1 = 0: relative = direct = (1 − 1)/2 = 0
    # group seed 1: guided b ✓, free ✗, free ✗ → free mean −1: relative r = 1 − (−1) = 2 (direct: 1)
    reqs = [_req(3, True, 0), _req(3, False, 0), _req(None, True, 0, cond="free"), _req(None, False, 0, cond="free"),
            _req(4, True, 0, seed=1), _req(None, False, 0, cond="free", seed=1), _req(None, False, 0, cond="free", seed=1)]
    assert [(c.entry_id, c.reward) for c in step_credits(ClosedStep(0, reqs))] == [(3, 0.0), (4, 1.0)]
    assert [(c.entry_id, c.reward) for c in step_credits(ClosedStep(0, reqs), relative=True)] == [(3, 0.0), (4, 2.0)]


def test_a_service_without_an_extractor_counts_requests_without_holding_them() -> None:
    from crl_gym.experience.service import RetrievalService

    service = RetrievalService(manager())
    try:
        for _ in range(3):
            service.submit(_req(None, True, 0, cond="free"))
        assert service.stats().open_requests == 3 and not service.ledger._open  # counted, not kept
        assert service.end_step(0).requests == 3
    finally:
        service.close()


def _cat(ok: bool, category: str, seed: int = 0) -> DistillationRequest:
    r = _req(None, ok, 0, cond="free", seed=seed)
    r.meta["task_category"] = category
    return r


def test_reflections_are_for_the_failing_categories_only_worst_first() -> None:
    from crl_train.service.credit import reflections, task_category

    step = ClosedStep(2, [_cat(True, "pick"), _cat(False, "pick"), _cat(False, "pick"), _cat(False, "pick"),  # 1/4
                          _cat(True, "heat"), _cat(True, "heat"), _cat(True, "heat"), _cat(False, "heat"),  # 3/4
                          _cat(False, "cool"), _cat(False, "cool")])                                        # 0/2
    jobs = reflections(step, below=0.5)
    assert [(j.category, len(j.failures), len(j.successes), j.step) for j in jobs] == [("cool", 2, 0, 2), ("pick", 3, 1, 2)]
    assert reflections(step, below=0.25) == reflections(ClosedStep(2, step.requests[8:]), below=0.25)  # only cool (0 < .25)
    assert task_category(_req(None, True, 0)) == "corridor"  # no category from the env: its id


def test_the_service_reflects_within_the_step_budget(extractor: Extractor) -> None:
    from crl_train.service import EdgeReflection

    service, _ = _service(extractor, distill=True, train=False, reflection=EdgeReflection(below=0.5, max_entries=2))
    try:
        size = len(service.manager.bank)
        for r in (_cat(False, "pick"), _cat(False, "pick"), _cat(True, "heat"), _cat(True, "heat")):
            service.submit(r)
        service.end_step(0)  # synchronous: distillation and the one reflection ran inside end_step
        st = service.stats().to_dict()
        assert st["reflections"] == 1  # "pick" failed; "heat" did not
        assert 0 <= st["reflected"] <= 2
        assert len(service.manager.bank) == size + st["added"] + st["reflected"]
    finally:
        service.close()


def test_a_full_disk_costs_the_credit_log_its_rows_not_the_step_its_end(
        extractor: Extractor, monkeypatch: pytest.MonkeyPatch) -> None:
    from crl_gym.errors import StorageFault

    service, (a, b) = _service(extractor)
    try:
        def full(*args: Any, **kwargs: Any) -> int:
            raise StorageFault("disk full: recording 2 credits failed", cause="disk full", status=507)

        monkeypatch.setattr(service.manager.bank, "record_credits", full)
        for r in (_req(a, True, 0), _req(b, False, 0)):
            service.submit(r)
        out = service.end_step(0)  # B_φ gets its credits; the bank's event log could not take them
        assert out.ended == [0] and out.credited == 2
        assert service.stats().counters["unlogged_credits"] == 2
    finally:
        service.close()
