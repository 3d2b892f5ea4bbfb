"""RecordedRequest: a DistillationRequest built lazily from the wrapper's flat record.

It must be indistinguishable from an eagerly built request for every consumer (fields, JSON,
pickle, equality, the queue's spill file), build its Steps only when read, build them once
under concurrent readers, and the wrapper must retain no object of its own per step."""

from __future__ import annotations

import copy
import dataclasses
import doctest
import gc
import json
import pickle
import threading
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from crl_gym.experience.distill_queue import DistillQueue
from crl_gym.protocol import DistillationRequest, ExperienceRef, SearchCall, Step, Trajectory
from crl_gym.wrappers import ExperienceWrapper, wrap
from crl_gym.wrappers.examples import CorridorEnv
from crl_gym.wrappers.recording import RecordedRequest, steps_and_calls, text_record

TIP = ExperienceRef(id=3, text="Walk east.", version=2)
CALL = SearchCall(query="where?", answer="east", entry=TIP, turn=1, refined=True, provenance={"prompt": "p"})


def record() -> list[Any]:
    """obs0, then (action, reward, info, obs) per turn; turn 2 is a search_and_ask turn."""
    return [
        "start",
        "west", 0.5, {"turn": 1, "admissible_actions": ["east", "west"]}, "o1",
        "search_and_ask[where?]", 0.0, {"turn": 1, "search_and_ask": {"status": "answered", "call": CALL}}, "o2",
        "east", np.float32(0.25), {"turn": 2, "n": np.int64(2)}, "o3",
        "east", 1, {"turn": 3, "success": True}, "end",
    ]


def eager(rec: list[Any], rid: str) -> DistillationRequest:
    """The same request built the old way: one Step per turn, up front."""
    steps = [
        Step("start", "west", 0.5, rec[3], "env"),
        Step("o1", "search_and_ask[where?]", 0.0, rec[7], "search_and_ask"),
        Step("o2", "east", 0.25, rec[11], "env"),
        Step("o3", "east", 1.0, rec[15], "env"),
    ]
    return DistillationRequest(
        task="leave", trajectory=Trajectory(steps=steps, initial_observation="start", search_calls=[CALL]),
        outcome=1.75, success=True, experience=TIP, condition="guided", env_id="corridor", seed=4,
        request_id=rid, meta={"k": 1},
    )


def lazy(rec: list[Any] | None = None, **kw: Any) -> RecordedRequest:
    args: dict[str, Any] = dict(task="leave", experience=TIP, condition="guided", env_id="corridor", seed=4,
                                success=True, meta={"k": 1})
    args.update(kw)
    return RecordedRequest.from_record(rec if rec is not None else record(), **args)


def test_outcome_and_success_from_the_record() -> None:
    req = lazy(success=None)
    # 0.5 + 0.0 + 0.25 + 1.0 = 1.75 (np.float32(0.25) and int 1 are converted like Step.reward)
    assert req.outcome == 1.75 and type(req.outcome) is float
    assert req.success is True  # None: falls back to outcome > 0
    zero = lazy(["s", "a", 0.0, {}, "o"], success=None)
    assert zero.outcome == 0.0 and zero.success is False
    assert lazy(success=False).success is False  # the env's verdict wins over the return


def test_steps_are_built_on_first_read_only_and_match_the_eager_request() -> None:
    rec = record()
    req = lazy(rec)
    assert isinstance(req, DistillationRequest) and not req.materialized
    rid = req.request_id  # the id is lazy too, and stable
    assert req.request_id == rid and len(rid) == 32
    assert not req.materialized  # reading the id builds no Step
    ref = eager(rec, rid)  # same info dicts (numpy arrays inside compare by identity)
    # to_dict straight from the record equals the eager request's dict, still without Steps
    assert req.to_dict() == ref.to_dict() and not req.materialized
    traj = req.trajectory
    assert req.materialized and req.trajectory is traj  # built once
    assert [s.kind for s in traj.steps] == ["env", "search_and_ask", "env", "env"]
    assert traj.search_calls == [CALL] and traj.initial_observation == "start"
    assert traj.steps[0].info is req.trajectory.steps[0].info  # references, not copies
    assert req == ref and ref == req
    assert req.to_dict() == ref.to_dict()  # the materialised path gives the same dict
    assert DistillationRequest.from_json(req.to_json()).to_dict() == req.to_dict()


def test_consumer_edits_stick_and_dataclass_tools_work() -> None:
    req = lazy()
    req.rollout_step = 9  # what the trainer does after the episode
    new_traj = Trajectory(steps=[Step("x", "y")])
    req.trajectory = new_traj
    assert req.trajectory is new_traj and req.materialized
    req.request_id = "abc"
    assert req.to_dict()["request_id"] == "abc" and req.to_dict()["rollout_step"] == 9
    other = dataclasses.replace(req, task="other")
    assert other.task == "other" and other.trajectory is new_traj and other.request_id == "abc"
    assert copy.deepcopy(req) == req
    with pytest.raises(TypeError):
        hash(req)  # mutable, like the parent dataclass


@pytest.mark.parametrize("read_first", [False, True])
def test_pickle_round_trip(read_first: bool) -> None:
    req = lazy()
    rid = req.request_id
    if read_first:
        _ = req.trajectory
    back = pickle.loads(pickle.dumps(req))
    assert isinstance(back, RecordedRequest) and back.materialized is read_first
    assert back.request_id == rid and back == req and back.to_dict() == req.to_dict()


def test_concurrent_readers_get_one_trajectory_and_one_id() -> None:
    for _ in range(20):
        req = lazy()
        seen: list[Any] = []
        barrier = threading.Barrier(8)

        def read(req: RecordedRequest = req, barrier: threading.Barrier = barrier, seen: list[Any] = seen) -> None:
            barrier.wait()
            seen.append((req.trajectory, req.request_id))

        threads = [threading.Thread(target=read) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({id(t) for t, _ in seen}) == 1 and len({r for _, r in seen}) == 1


def test_bad_record_length_is_named() -> None:
    with pytest.raises(ValueError, match="4n\\+1"):
        lazy(["start", "east"])
    steps, calls = steps_and_calls(["only the first observation"])
    assert steps == [] and calls == []


def test_text_record_converts_in_place_and_leaves_text_records_alone() -> None:
    rec = record()
    before = list(rec)
    assert text_record(rec) is None and rec == before and all(a is b for a, b in zip(rec, before, strict=True))
    rec = [np.str_("start"), np.int64(1), 0.0, {}, b"o\xe91", bytearray(b"east"), 1, {"n": np.int64(2)}, np.array("end")]
    assert text_record(rec) is None
    assert rec[0::4] == ["start", "o\ufffd1", "end"] and rec[1::4] == ["1", "east"]
    assert all(type(x) is str for x in rec[0::4] + rec[1::4])
    assert rec[3] == {} and rec[7]["n"] == 2  # rewards and infos are not touched
    assert json.loads(RecordedRequest.from_record(rec, task="t", experience=None, condition="free", env_id="",
                                                  seed=None).to_json())["trajectory"]["steps"][1]["action"] == "east"


@pytest.mark.parametrize(("index", "value", "named"), [
    (0, None, "the first observation is None, not text"),
    (1, np.zeros((2, 2)), "the action of turn 1 is a numpy.ndarray of shape (2, 2), not text"),
    (4, {"obs": 1}, "the observation after turn 1 is a dict, not text"),
    (9, [1], "the action of turn 3 is a list, not text"),
])
def test_text_record_names_the_first_value_without_a_text_form(index: int, value: Any, named: str) -> None:
    rec = record()
    rec[index] = value
    assert text_record(rec) == named


def test_rollout_step_is_a_field_of_the_recorded_request() -> None:
    req = RecordedRequest.from_record(record(), task="t", experience=None, condition="free", env_id="e", seed=1,
                                      rollout_step=7)
    assert req.rollout_step == 7 and DistillationRequest.from_json(req.to_json()).rollout_step == 7
    assert RecordedRequest.from_record(record(), task="t", experience=None, condition="free", env_id="e",
                                       seed=1).rollout_step is None


def test_spilled_lazy_requests_come_back_equal(tmp_path: Any) -> None:
    q = DistillQueue(maxsize=1, spill_path=tmp_path / "pending.jsonl")
    reqs = [lazy(task=f"t{i}") for i in range(3)]
    for r in reqs:
        q.put(r)
    assert q.spilled_total == 2 and not reqs[1].materialized  # spilled straight from the record
    lines = [json.loads(x) for x in (tmp_path / "pending.jsonl").read_text().splitlines()]
    assert [d["task"] for d in lines] == ["t1", "t2"] and lines[0]["trajectory"]["search_calls"][0]["query"] == "where?"
    got = q.get(10)
    assert [g.to_dict() for g in got] == [r.to_dict() for r in reqs]
    q.close()


def test_wrapper_submits_a_lazy_request_that_is_also_in_info() -> None:
    submitted: list[Any] = []

    class Sink:
        def search(self, query: str) -> ExperienceRef | None:
            return TIP

        def submit(self, request: DistillationRequest) -> None:
            submitted.append(request)

    env = ExperienceWrapper(CorridorEnv(length=2), Sink())
    env.reset(seed=0, options={"experience": "guided"})
    env.step("east")
    info = env.step("east")[4]
    req = info["distillation_request"]
    assert submitted == [req] and submitted[0] is req and not req.materialized
    assert req.experience == TIP and len(req.trajectory) == 2 and req.trajectory.num_actions == 2


class ReplayEnv(gym.Env):
    """Returns pre-built step tuples, so that any object made during a step is the wrapper's."""

    metadata = {"render_modes": []}
    observation_space = gym.spaces.Text(max_length=100)
    action_space = gym.spaces.Text(max_length=100)

    def __init__(self, n: int) -> None:
        self.outs = [(f"obs {i}", 0.0, False, False, {"turn": i}) for i in range(n)]
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        self.t = 0
        return "start", {"task": "replay"}

    def step(self, action: Any) -> tuple[Any, ...]:
        self.t += 1
        return self.outs[self.t - 1]


def test_wrappers_keep_no_object_of_their_own_per_step() -> None:
    class NoBank:
        def search(self, query: str) -> None:
            return None

        def submit(self, request: Any) -> None:
            pass

    env = wrap(ReplayEnv(400), NoBank())
    env.reset(seed=0)
    for _ in range(5):
        env.step("east")  # warm up (first-call caches)
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(300):
        env.step("east")
    gc.collect()
    # 300 recorded steps, 0 new GC-tracked objects: only references are appended.
    assert len(gc.get_objects()) - before <= 2


def test_docstring_examples_run() -> None:
    import crl_gym.wrappers.recording as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
