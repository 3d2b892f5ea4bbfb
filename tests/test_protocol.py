"""Tests of crl_gym.protocol: JSON round trips, and bad fields refused with a message naming them."""

from __future__ import annotations

import doctest
import json
import math
from typing import Any

import numpy as np
import pytest

import crl_gym.protocol as protocol
from crl_gym.protocol import (
    DistillationRequest,
    ExperienceRef,
    ExtractorSample,
    SearchCall,
    Step,
    Trajectory,
)
from crl_gym.wrappers.recording import RecordedRequest


def _request() -> DistillationRequest:
    call = SearchCall("stuck?", "go east", ExperienceRef(3, "go east", 1), turn=1, refined=True,
                      provenance=ExtractorSample("p", "go east", [-0.5, -0.25], [7, 8]).to_dict())
    traj = Trajectory([Step("room", "north", 0.5), Step("room", "search_and_ask[stuck?]", 0.0, kind="search_and_ask")],
                      "start", [call])
    return DistillationRequest("reach the exit", traj, 0.5, True, ExperienceRef(3, "go east", 1), "guided",
                               env_id="corridor", seed=4, rollout_step=2, meta={"k": 1})


def test_round_trip_keeps_every_field() -> None:
    req = _request()
    back = DistillationRequest.from_json(req.to_json())
    assert back == req and back.trajectory.search_calls[0].provenance == req.trajectory.search_calls[0].provenance


def _with(path: str, value: Any) -> dict[str, Any]:
    """The request's dict with the value at ``path`` (dotted, ``[i]`` for list items) replaced."""
    d = json.loads(_request().to_json())
    node: Any = d
    keys = [int(k) if k.isdigit() else k for k in path.replace("[", ".").replace("]", "").split(".")]
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value
    return d


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        ("outcome", math.nan, r"outcome must be a finite number, got nan"),
        ("outcome", math.inf, r"outcome must be a finite number, got inf"),
        ("outcome", "1.0", r"outcome must be a finite number, got '1.0'"),
        ("outcome", None, r"outcome must be a finite number"),
        ("success", "false", r"success must be true or false"),
        ("task", None, r"task must be a string"),
        ("condition", "half", r"condition must be one of"),
        ("seed", 1.5, r"seed must be an integer"),
        ("rollout_step", "3", r"rollout_step must be an integer"),
        ("trajectory.steps[1].reward", -math.inf, r"trajectory.steps\[1\].reward must be a finite number, got -inf"),
        ("trajectory.steps[0].observation", None, r"trajectory.steps\[0\].observation must be a string"),
        ("trajectory.steps[0].kind", "teleport", r"trajectory.steps\[0\].kind must be one of"),
        ("trajectory.steps", {"a": 1}, r"trajectory.steps must be a list"),
        ("trajectory.search_calls[0].provenance.logprobs[1]", math.nan,
         r"trajectory.search_calls\[0\].provenance.logprobs\[1\] must be a finite number, got nan"),
        ("trajectory.search_calls[0].entry.id", -1, r"trajectory.search_calls\[0\].entry.id must be in \[0, 18446744073709551615\], got -1"),
        ("experience.id", 2**64, r"experience.id must be in \[0, 18446744073709551615\], got 18446744073709551616"),
        ("experience.text", 5, r"experience.text must be a string"),
        ("experience", "entry 3", r"experience must be a JSON object"),
        ("meta", [1], r"meta must be a JSON object"),
    ],
)
def test_from_dict_refuses_a_bad_field_naming_it(path: str, value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DistillationRequest.from_dict(_with(path, value))


def test_from_json_refuses_nan_written_by_a_lenient_encoder() -> None:
    # json.dumps writes NaN as the bare token NaN and json.loads reads it back: the check must catch it
    text = _request().to_json().replace('"outcome": 0.5', '"outcome": NaN')
    with pytest.raises(ValueError, match="outcome must be a finite number, got nan"):
        DistillationRequest.from_json(text)


def test_missing_required_fields_are_named() -> None:
    d = json.loads(_request().to_json())
    del d["outcome"]
    with pytest.raises(ValueError, match="outcome is missing"):
        DistillationRequest.from_dict(d)
    with pytest.raises(ValueError, match="experience.text is missing"):
        ExperienceRef.from_dict({"id": 1})


def test_construction_refuses_non_finite_outcome_and_bad_types() -> None:
    traj = Trajectory()
    with pytest.raises(ValueError, match="outcome must be a finite number, got nan"):
        DistillationRequest("t", traj, float("nan"), False, None)
    with pytest.raises(ValueError, match="outcome must be a finite number, got inf"):
        DistillationRequest("t", traj, np.float32("inf"), False, None)
    with pytest.raises(ValueError, match="task must be a string"):
        DistillationRequest(None, traj, 0.0, False, None)  # type: ignore[arg-type]
    # numpy scalars that are valid become Python values (they must survive JSON)
    req = DistillationRequest("t", traj, np.float32(1.0), np.bool_(True), None, seed=np.int64(3))  # type: ignore[arg-type]
    assert (req.outcome, req.success, req.seed) == (1.0, True, 3)
    assert type(req.outcome) is float and type(req.success) is bool and type(req.seed) is int


def test_experience_ref_and_extractor_sample_construction_is_checked() -> None:
    with pytest.raises(ValueError, match="experience.id"):
        ExperienceRef(-1, "x")
    with pytest.raises(ValueError, match="experience.version"):
        ExperienceRef(1, "x", version=-2)
    assert ExperienceRef(np.uint64(5), "x").id == 5  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"logprobs\[1\] must be a finite number, got -inf"):
        ExtractorSample("p", "r", [-0.1, float("-inf")])
    with pytest.raises(ValueError, match="logprobs has 1 values for 2 token_ids"):
        ExtractorSample("p", "r", [-0.1], [1, 2])
    with pytest.raises(ValueError, match=r"provenance.token_ids\[0\] must be >= 0, got -3"):
        ExtractorSample.from_dict({"prompt": "p", "response": "r", "token_ids": [-3]})


def test_an_episode_with_a_nan_reward_is_refused_at_its_end() -> None:
    rec = ["start", "east", 0.0, {}, "mid", "east", float("nan"), {}, "end"]
    with pytest.raises(ValueError, match="the reward of turn 2 is nan: a request's outcome must be a finite number"):
        RecordedRequest.from_record(rec, task="t", experience=None, condition="free", env_id="e", seed=0)
    ok = RecordedRequest.from_record(rec[:5], task="t", experience=None, condition="free", env_id="e", seed=0)
    assert ok.outcome == 0.0


def test_docstring_examples_run() -> None:
    result = doctest.testmod(protocol)
    assert result.attempted > 0 and result.failed == 0


def test_the_wrapper_refuses_an_episode_with_a_nan_reward_and_goes_on() -> None:
    import gymnasium as gym

    from crl_gym.clients import LocalClient
    from crl_gym.experience.bank import ExperienceBank
    from crl_gym.experience.embedders import HashingEmbedder
    from crl_gym.experience.manager import ExperienceManager
    from crl_gym.wrappers import ExperienceWrapper
    from crl_gym.wrappers.examples import CorridorEnv

    class NanReward(gym.Wrapper):  # type: ignore[type-arg]
        def step(self, action: Any) -> Any:
            obs, reward, terminated, truncated, info = self.env.step(action)
            return obs, float("nan") if self.env.unwrapped.turn == 1 else reward, terminated, truncated, info

    manager = ExperienceManager(ExperienceBank(None, dim=16), HashingEmbedder(16))
    try:
        env = ExperienceWrapper(NanReward(CorridorEnv(length=2)), LocalClient(manager))
        env.reset(seed=0)
        env.step("east")
        info = env.step("east")[4]
        assert info["distillation_request"] is None and manager.pending() == 0
        assert "the reward of turn 1 is nan" in info["experience_error"] and env.rejected_count == 1
        clean = ExperienceWrapper(CorridorEnv(length=2), LocalClient(manager))
        clean.reset(seed=0)
        clean.step("east")
        assert clean.step("east")[4]["distillation_request"] is not None and manager.pending() == 1
    finally:
        manager.close()
