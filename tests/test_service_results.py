"""The service's typed answers: each face returns them, their JSON forms round-trip, and an answer a
client cannot read is a ValueError naming the field."""

from __future__ import annotations

import pytest

from crl_gym.clients import LocalClient
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.results import STATS_FIELDS, Health, OpsApplied, ServiceStats, StepEnded
from crl_gym.protocol import AddOp, DistillationRequest, Trajectory


def test_local_answers_are_typed_and_their_json_forms_round_trip() -> None:
    client = LocalClient(ExperienceManager(ExperienceBank(None, dim=32), HashingEmbedder(32)))
    try:
        ops = client.apply_ops([AddOp("walk east"), AddOp("push the box")])
        assert isinstance(ops, OpsApplied) and ops.added == 2 and len(ops.added_ids) == 2
        client.submit(DistillationRequest(task="t", trajectory=Trajectory(), outcome=1.0, success=True,
                                          experience=None, rollout_step=0))
        ended = client.end_step(0)
        assert isinstance(ended, StepEnded) and (ended.step, ended.ended, ended.requests) == (0, [0], 1)
        stats = client.stats()
        assert isinstance(stats, ServiceStats)
        assert (stats.bank_size, stats.submitted, stats.steps_ended, stats.ops_applied) == (2, 1, 1, 1)
        assert stats.extractor is None and stats.last_error == "" and "requests" in stats.manager
        health = client.health()
        assert isinstance(health, Health) and health.status == "ok" and health.extractor is None
        for answer in (ops, ended, stats, health):
            assert type(answer).from_dict(answer.to_dict()) == answer
        flat = stats.to_dict()
        assert all(flat[k] == stats.get(k) for k in STATS_FIELDS) and flat["manager"] == stats.manager
    finally:
        client.service.close()


def test_counters_beyond_the_fixed_fields_travel_flat_and_read_by_name() -> None:
    stats = ServiceStats(bank_size=3, queue_depth=1, last_ended_step=4, extractor="alive", distilled=5,
                         counters={"pruned": 2, "last_error": "RuntimeError: boom", "extractor_loss": None})
    d = stats.to_dict()
    assert d["pruned"] == 2 and d["extractor"] == "alive" and d["distilled"] == 5 and "counters" not in d
    back = ServiceStats.from_dict(d)
    assert back == stats and back.get("pruned") == 2 and back.last_error == "RuntimeError: boom"
    assert back.get("extractor_loss") is None and back.get("never_reported") is None


@pytest.mark.parametrize(("cls", "answer", "match"), [
    (StepEnded, {"step": 0, "ended": [0], "requests": 1}, "no 'credited'"),
    (StepEnded, {"step": 0, "ended": ["0"], "requests": 1, "credited": 0}, "'ended' must be a list of ints"),
    (StepEnded, [1, 2], "end_step must be a JSON object"),
    (OpsApplied, {"added": True, "added_ids": [], "updated": 0, "deleted": 0, "returned": 0, "malformed": 0},
     "'added' must be int"),
    (Health, {"status": "down", "pending": 0}, "'status' must be 'ok'"),
    (Health, {"status": "ok", "pending": 0, "extractor": "asleep"}, "'extractor' must be one of"),
    (ServiceStats, {"queue_depth": 0, "last_ended_step": -1}, "no 'bank_size'"),
    (ServiceStats, {"bank_size": 0, "queue_depth": 0, "last_ended_step": -1, "odd": [1]}, "'odd' must be a number"),
])
def test_an_answer_a_client_cannot_read_names_the_field(cls: type, answer: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cls.from_dict(answer)  # type: ignore[attr-defined]
