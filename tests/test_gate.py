"""The actor-critic gate: judged before the episode; accept / refine / reject change what it sees."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from _trainer_fixtures import LocalClient, corridor_factory, manager, tiny_policy

from crl_gym.protocol import ExperienceRef
from crl_train.algorithms import perplexity_bonus, relative_outcomes
from crl_train.methods.gate import VERDICTS, WARMUP, ActorCriticGate, Verdict
from crl_train.rollout import RolloutRunner


class FixedGate:
    """A gate whose verdicts the test chooses (the runner's behaviour is what is under test)."""

    def __init__(self, verdict: str) -> None:
        self.verdict = verdict
        self.observed: list[bool] = []

    def judge(self, tasks: Sequence[str], entries: Sequence[ExperienceRef]) -> tuple[list[Verdict], float]:
        if self.verdict == "refine":
            return [Verdict("refine", ExperienceRef(e.id, "REWRITTEN: walk east", e.version), e.id, 0.5) for e in entries], 0.2
        if self.verdict == "reject":
            return [Verdict("reject", None, e.id, 0.0) for e in entries], 0.2
        return [Verdict("accept", e, e.id, 1.0) for e in entries], 0.2

    def observe(self, tasks: Sequence[str], successes: Sequence[bool]) -> None:
        self.observed += list(successes)


@pytest.fixture(scope="module")
def actor() -> Any:
    return tiny_policy(0)


@pytest.mark.parametrize("verdict", ["accept", "refine", "reject"])
def test_the_verdict_decides_what_the_guided_episode_sees(actor: Any, verdict: str) -> None:
    mgr = manager(("Walk east.",))
    client = LocalClient(mgr)
    runner = RolloutRunner(actor, corridor_factory(client, length=1), client=client, group_size=4, max_turns=2,
                           constrained=True)
    gate = FixedGate(verdict)
    runner.gate = gate
    try:
        eps = runner.collect([("c", 0)], guided=True, step=0)
    finally:
        runner.close()
        mgr.close()
    guided = [e for e in eps if e.condition == "guided"]
    assert all(e.info["gate"] == verdict and e.info["gate_s"] == pytest.approx(0.1) for e in guided)
    for e in guided:
        assert e.request is not None and e.request.meta["gate"]["verdict"] == verdict
        assert e.request.meta["gate"]["entry"] == 1
        if verdict == "reject":  # runs free: no entry in its prompt or its request
            assert e.experience is None and e.request.experience is None
        elif verdict == "refine":  # the episode is guided by the rewrite, credited to the entry
            assert e.experience is not None and e.experience.text == "REWRITTEN: walk east" and e.experience.id == 1
        else:
            assert e.experience is not None and e.experience.text == "Walk east."
    assert len(gate.observed) == 4  # the step's outcomes reach the gate's success rates


def test_actor_critic_gate_warms_up_then_judges_with_the_actor(actor: Any) -> None:
    gate = ActorCriticGate(actor, warmup_steps=1, rewrite_tokens=6)
    entries = [ExperienceRef(i, "Walk east.") for i in range(12)]
    verdicts, seconds = gate.judge(["Walk east"] * 12, entries)
    assert {v.verdict for v in verdicts} == {WARMUP} and seconds == 0.0 and all(v.score is None for v in verdicts)
    gate.observe(["Walk east", "Walk east"], [True, False])
    assert gate.success_rate("Walk east") == 0.5
    torch.manual_seed(0)
    verdicts, seconds = gate.judge(["Walk east"] * 12, entries)
    assert seconds > 0 and all(v.verdict in VERDICTS and v.verdict != WARMUP for v in verdicts)
    for v, e in zip(verdicts, entries, strict=True):
        assert v.entry_id == e.id and v.score == {"accept": 1.0, "refine": 0.5, "reject": 0.0}[v.verdict]
        assert (v.shown is None) == (v.verdict == "reject")
        if v.verdict == "accept":
            assert v.shown == e


def test_perplexity_bonus_transforms_by_hand() -> None:
    d, h = torch.tensor([0.5, -2.0, 0.0]), torch.tensor([2.0, 1.0, 1.0])

    def b(transform: str, **kw: Any) -> list[float]:
        return [round(x, 4) for x in perplexity_bonus(d, h, transform=transform, **kw).tolist()]

    assert b("relative") == [0.25, -1.0, 0.0]            # 0.5/2; −2/1 clipped to −1
    assert b("tanh", weight=0.5) == [0.2311, -0.482, 0.0]  # 0.5·tanh(0.5) = 0.23106; 0.5·tanh(−2) = −0.48201
    assert b("sigmoid", temperature=2.0) == [0.1244, -0.4621, 0.0]  # 2σ(0.25) − 1 = 0.12435; 2σ(−1) − 1 = −0.46212
    assert b("asymmetric") == [0.5, -0.1, 0.0]           # clip to [−0.1, 1]
    assert b("log") == [0.4055, -1.0986, 0.0]            # log 1.5; −log 3
    with pytest.raises(ValueError, match="accepted"):
        perplexity_bonus(d, h, transform="cube")


def test_relative_outcomes_by_hand() -> None:
    success = torch.tensor([True, False, True, True, False, False])
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    cond = torch.tensor([0, 0, 1, 0, 1, 1])  # group 0: guided ✓ ✗, free ✓ (mean +1); group 1: guided ✓, free ✗ ✗ (−1)
    assert relative_outcomes(success, group, cond).tolist() == [0.0, -2.0, 0.0, 2.0, 0.0, 0.0]
