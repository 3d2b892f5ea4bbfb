"""The TypedDicts of crl_gym.json_types name what the protocol's ``to_dict`` writes, key for key."""

from __future__ import annotations

import json
from typing import Any

from crl_gym.json_types import (
    ExperienceRefDict,
    GrammarSpec,
    OpDict,
    RequestDict,
    SampleDict,
    SearchCallDict,
    StepDict,
    TrajectoryDict,
)
from crl_gym.protocol import (
    AddOp,
    DeleteOp,
    DistillationRequest,
    ExperienceRef,
    ExtractorSample,
    ReturnOp,
    SearchCall,
    Step,
    Trajectory,
    TurnGuidance,
    UpdateOp,
    op_from_dict,
    op_to_dict,
)


def _keys(td: Any) -> set[str]:
    return set(td.__required_keys__) | set(td.__optional_keys__)


def test_each_payload_has_the_keys_its_typeddict_names() -> None:
    ref = ExperienceRef(3, "go east", 1)
    grammar: GrammarSpec = {"schema": "{}", "think_tokens": 0, "reasoning_end": None}
    sample = ExtractorSample("p", "go east", [-0.5], [7], grammar=grammar)
    provenance = dict(sample.to_dict())
    call = SearchCall("stuck?", "go east", ref, turn=1, refined=True, provenance=provenance)
    traj = Trajectory([Step("room", "north", 0.5)], "start", [call])
    req = DistillationRequest("task", traj, 0.5, True, ref, "guided",
                              turn_experience=[TurnGuidance(1, ref)])
    d = req.to_dict()
    assert set(d) == _keys(RequestDict)
    assert set(d["trajectory"]) == _keys(TrajectoryDict)
    assert set(d["trajectory"]["steps"][0]) == _keys(StepDict)
    assert set(d["trajectory"]["search_calls"][0]) == _keys(SearchCallDict)
    assert set(ref.to_dict()) == _keys(ExperienceRefDict)
    assert set(sample.to_dict()) == _keys(SampleDict)
    # a request of episode-level retrieval has no turn_experience key (its old form)
    assert "turn_experience" not in DistillationRequest("t", traj, 0.0, False, None).to_dict()
    assert DistillationRequest.from_json(json.dumps(d)).to_dict() == d


def test_ops_round_trip_through_their_opdict() -> None:
    ops = [AddOp("walk east", ("minihack",)), UpdateOp(4, "walk west"), DeleteOp(5),
           ReturnOp("nothing", True)]
    for op in ops:
        d: OpDict = op_to_dict(op)
        assert set(d) <= _keys(OpDict)
        assert op_from_dict(json.loads(json.dumps(d))) == op
