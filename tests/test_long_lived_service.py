"""One long-lived service, several training runs one after another: each run has its own
rollout-step space (``RunSteps``), so the second run's step 0 never ends a step twice and its
episodes are credited in its own steps. TRL's callback path and a plain loop over the wrappers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import TrainerControl, TrainerState, TrainingArguments

from crl_gym.clients import RemoteClient, RunSteps, StepOrderError
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.service import RetrievalService
from crl_gym.integrations.trl import TRLExperience
from crl_gym.protocol import AddOp
from crl_gym.server import BackgroundServer
from crl_gym.wrappers import wrap
from crl_gym.wrappers.examples import CorridorEnv

TIP = "Walk east to the exit."
STEPS = 3


@pytest.fixture()
def server() -> Any:
    manager = ExperienceManager(ExperienceBank(None, dim=64), HashingEmbedder(64))
    manager.apply_ops([AddOp(TIP)])
    service = RetrievalService(manager)
    with BackgroundServer(service) as srv:
        yield srv, service
    service.close()


def trl_run(url: str, tmp_path: Path) -> TRLExperience:
    """A TRL run of ``STEPS`` optimizer steps (the callback as GRPOTrainer calls it), one guided
    episode per step, against the server at ``url`` with a client of its own."""
    session = TRLExperience(RemoteClient(url, timeout=30), lambda: CorridorEnv(length=1))
    callback = session.callback()
    args, control, state = TrainingArguments(output_dir=str(tmp_path), report_to="none"), TrainerControl(), TrainerState()
    try:
        for step in range(STEPS):
            state.global_step = step
            callback.on_step_begin(args, state, control)
            env = session.environment_factory()
            env.reset(prompt=[], seed=step, experience="guided")
            env.take_action("east")
            env.get_reward()
            session.client.flush()  # type: ignore[attr-defined]
            state.global_step = step + 1
            callback.on_step_end(args, state, control)
    finally:
        session.client.close()  # type: ignore[attr-defined]
    return session


def test_two_trl_runs_one_after_another_against_one_server(server: Any, tmp_path: Path) -> None:
    srv, service = server
    first, second = trl_run(srv.url, tmp_path / "a"), trl_run(srv.url, tmp_path / "b")
    assert [r.step for r in first.ended] == [0, 1, 2] and [r.step for r in second.ended] == [3, 4, 5]
    assert [r.requests for r in first.ended + second.ended] == [1] * 6  # each run's episodes in its own steps
    assert second.steps.base == 3 and service.stats().late_requests == 0


def test_a_plain_loop_twice_and_the_step_order_it_replaces(server: Any) -> None:
    srv, service = server
    for run in range(2):
        client = RemoteClient(srv.url, timeout=30)
        steps = RunSteps(client)
        env = wrap(CorridorEnv(length=1), client)
        try:
            for t in range(STEPS):
                env.reset(seed=t, options={"experience": "guided", "rollout_step": steps.service_step(t)})
                env.step("east")
                client.flush()
                assert steps.end_step(t).requests == 1
        finally:
            client.close()
        assert steps.base == run * STEPS
    with pytest.raises(StepOrderError):  # what a second run without its own step space hit
        RemoteClient(srv.url, timeout=30).end_step(0)
    assert service.stats().late_requests == 0


def test_run_steps_refuses_a_bad_base(server: Any) -> None:
    srv, _ = server
    with pytest.raises(ValueError, match="base must be an integer >= 0"):
        RunSteps(RemoteClient(srv.url), base=-2)
