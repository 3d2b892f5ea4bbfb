"""Full episodes through OpenRLHF's own agent classes (``openrlhf.utils.agent``), our executor inside.

The engine is the tiny HF policy behind vLLM's ``generate`` shape (``_openrlhf_fixtures.HFEngine``);
the K samples of a prompt run as OpenRLHF's ``RolloutRayActor.generate_responses`` runs them:
``asyncio.gather`` of K ``execute`` calls with one label.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openrlhf.utils.agent")

from _openrlhf_fixtures import ACTIONS, HFEngine, SamplingParamsLike, agent_policy  # noqa: E402
from _trainer_fixtures import manager  # noqa: E402
from openrlhf.utils.agent import AgentExecutorBase, AgentInstanceBase, MultiTurnAgentExecutor  # noqa: E402

from crl_gym.clients import LocalClient  # noqa: E402
from crl_gym.experience.service import RetrievalService  # noqa: E402
from crl_gym.wrappers.examples import CorridorEnv  # noqa: E402
from crl_train.config import load_config  # noqa: E402
from crl_train.openrlhf import executor as ex  # noqa: E402
from crl_train.openrlhf.settings import SETTINGS_ENV, ClusterSettings, SettingsMissing  # noqa: E402
from crl_train.openrlhf.tasks import TaskLabel  # noqa: E402

ENTRY = "Walk east until the exit."
K = 4
OUTPUT_KEYS = {"prompt", "label", "images", "mm_train_inputs", "reward", "scores", "observation_tokens",
               "action_ranges", "rollout_log_probs", "truncated", "extra_logs"}
"""The keys of OpenRLHF's ``MultiTurnAgentExecutor.execute`` result (what its sample generator reads)."""


@pytest.fixture(scope="module")
def policy() -> Any:
    return agent_policy(seed=0)


def runtime_of(tmp_path: Path, *, length: int = 2, max_turns: int = 3, method: str = "complementary",
               env_factory: Any = None, extra: tuple[str, ...] = ()) -> tuple[ex.EpisodeRuntime, RetrievalService]:
    cfg = load_config(None, [f"method={method}", f"env.group_size={K}", f"env.max_turns={max_turns}",
                             "actor.max_new_tokens=24", "experience.search_and_ask=true",
                             "experience.max_search_calls=2", *extra])
    service = RetrievalService(manager((ENTRY,)))
    factory = env_factory or (lambda env_id: CorridorEnv(length=length, max_turns=50))
    return ex.EpisodeRuntime(cfg, LocalClient(service), env_factory=factory, env_threads=8), service


async def group(executor: Any, engine: HFEngine, tokenizer: Any, *, seed: int = 0, max_length: int = 2048,
                logprobs: int | None = 1) -> list[dict[str, Any]]:
    """K samples of one prompt, as ``RolloutRayActor.generate_responses`` runs them."""
    label = TaskLabel("corridor", seed).encode()
    params = SamplingParamsLike(logprobs=logprobs)
    return list(await asyncio.gather(*[
        executor.execute(prompt="corridor task", label=label, sampling_params=params, max_length=max_length,
                         hf_tokenizer=tokenizer, llm_engine=engine) for _ in range(K)]))


def first_prompt(out: dict[str, Any], tokenizer: Any) -> str:
    return str(tokenizer.decode(out["observation_tokens"][: out["action_ranges"][0][0]]))


def test_group_runs_guided_then_free_with_experience_and_requests(tmp_path: Path, policy: Any) -> None:
    runtime, service = runtime_of(tmp_path)
    engine = HFEngine(policy, choices=ACTIONS)
    executor = ex.AgentExecutor(runtime)
    assert isinstance(executor, AgentExecutorBase) and isinstance(executor, MultiTurnAgentExecutor)
    outs = asyncio.run(group(executor, engine, policy.tokenizer))
    tok = policy.tokenizer
    assert [o["extra_logs"]["crl_guided"] for o in outs] == [1.0, 1.0, 0.0, 0.0]
    for o in outs:
        assert set(o) == OUTPUT_KEYS and tuple(o["extra_logs"]) == ex.EXTRA_LOG_KEYS
        n = len(o["observation_tokens"])
        assert len(o["rollout_log_probs"]) == n and n <= 2048
        assert 1 <= len(o["action_ranges"]) <= 3 and o["extra_logs"]["crl_turns"] <= 3
        for start, end in o["action_ranges"]:
            assert 0 < start < end <= n
        assert o["reward"] == o["scores"] == o["extra_logs"]["crl_success"]
        assert o["extra_logs"]["crl_valid"] == 1.0
        # experience injection: only the guided half's first prompt carries the entry
        assert (ENTRY in first_prompt(o, tok)) == (o["extra_logs"]["crl_guided"] == 1.0)
        assert o["extra_logs"]["crl_experience"] == o["extra_logs"]["crl_guided"]
    # per-turn cap: OpenRLHF would have asked for the whole remaining budget
    assert engine.requested and max(engine.requested) <= 24
    # log-probs: the engine's, at the action positions; 0 elsewhere
    o = outs[0]
    start, end = o["action_ranges"][0]
    assert all(lp == 0.0 for lp in o["rollout_log_probs"][:start])
    assert all(lp <= 0.0 for lp in o["rollout_log_probs"][start:end]) and any(lp < 0 for lp in o["rollout_log_probs"][start:end])
    # every episode reached the service once (the env's own end or the executor's cut), then the step ends
    assert service.counters["submitted"] == K
    ended = service.end_step(0)
    assert ended.requests == K
    runtime.close()


def test_success_is_the_reward_and_the_wrapper_submits(tmp_path: Path, policy: Any) -> None:
    runtime, service = runtime_of(tmp_path, length=1)
    outs = asyncio.run(group(ex.AgentExecutor(runtime), HFEngine(policy, choices=["<action>east</action>"]),
                             policy.tokenizer, logprobs=None))
    for o in outs:
        assert o["reward"] == 1.0 and o["extra_logs"]["crl_success"] == 1.0 and o["extra_logs"]["crl_turns"] == 1.0
        assert o["rollout_log_probs"] is None and len(o["action_ranges"]) == 1
    reqs = service.manager.get_requests(10)
    assert len(reqs) == K and all(r.success for r in reqs)
    assert sorted(r.condition for r in reqs) == ["free", "free", "guided", "guided"]
    assert all((r.experience is not None) == (r.condition == "guided") for r in reqs)
    runtime.close()


def test_turn_cap_ends_the_episode_and_its_request_is_sent(tmp_path: Path, policy: Any) -> None:
    runtime, service = runtime_of(tmp_path, length=5, max_turns=3)
    outs = asyncio.run(group(ex.AgentExecutor(runtime), HFEngine(policy, choices=["<action>west</action>"]),
                             policy.tokenizer))
    for o in outs:
        logs = o["extra_logs"]
        assert logs["crl_turns"] == 3.0 and logs["crl_turn_cap"] == 1.0 and o["reward"] == 0.0
        assert len(o["action_ranges"]) == 3
    reqs = service.manager.get_requests(10)
    assert len(reqs) == K and all(r.meta.get("turn_cap") and not r.success for r in reqs)
    assert all(len(r.trajectory.steps) == 3 and r.trajectory.steps[0].action == "west" for r in reqs)
    assert runtime.counters["turn_caps"] == K
    runtime.close()


def test_search_and_ask_is_answered_from_the_bank(tmp_path: Path, policy: Any) -> None:
    runtime, service = runtime_of(tmp_path, length=5, max_turns=4)
    outs = asyncio.run(group(ex.AgentExecutor(runtime), HFEngine(policy, choices=[ACTIONS[2]]), policy.tokenizer))
    text = policy.tokenizer.decode(outs[0]["observation_tokens"])
    assert "Answer to search_and_ask[which way is the exit?]:" in text and ENTRY in text
    assert "you have used all 2 calls" in text  # the third call is over the wrapper's cap
    assert [o["extra_logs"]["crl_search_calls"] for o in outs] == [4.0] * K
    reqs = service.manager.get_requests(10)
    assert all(s.kind == "search_and_ask" for r in reqs for s in r.trajectory.steps)
    runtime.close()


def test_context_limit_cuts_an_episode_before_it_overflows(tmp_path: Path, policy: Any) -> None:
    runtime, service = runtime_of(tmp_path, length=5, max_turns=2)
    tok = policy.tokenizer
    engine = HFEngine(policy, choices=["<action>west</action>"])
    one = asyncio.run(group(ex.AgentExecutor(runtime), engine, tok))[0]
    first_turn = one["action_ranges"][1][0] if len(one["action_ranges"]) > 1 else len(one["observation_tokens"])
    limit = first_turn + 30  # room for the first turn's feedback, not for another 24-token turn after it
    runtime2, service2 = runtime_of(tmp_path, length=5, max_turns=30)
    outs = asyncio.run(group(ex.AgentExecutor(runtime2), engine, tok, max_length=limit))
    for o in outs:
        assert o["extra_logs"]["crl_context_truncated"] == 1.0 and o["reward"] == 0.0
        assert len(o["observation_tokens"]) <= limit and o["extra_logs"]["crl_turns"] < 30
    assert runtime2.counters["context_truncations"] == K
    assert len(service2.manager.get_requests(10)) == K
    runtime.close()
    runtime2.close()


class Broken(CorridorEnv):
    def __init__(self, where: str) -> None:
        super().__init__(length=3)
        self.where = where

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        if self.where == "reset":
            raise RuntimeError("the simulator crashed in reset")
        return super().reset(seed=seed, options=options)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        raise RuntimeError("the simulator crashed in step")


@pytest.mark.parametrize("where", ["reset", "step"])
def test_env_errors_end_the_episode_not_the_batch(tmp_path: Path, policy: Any, where: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    runtime, _ = runtime_of(tmp_path, env_factory=lambda env_id: Broken(where))
    with caplog.at_level(logging.WARNING, logger="crl_train.openrlhf.executor"):
        # env actions only: a search_and_ask turn never reaches the env's step
        outs = asyncio.run(group(ex.AgentExecutor(runtime), HFEngine(policy, choices=ACTIONS[:2]), policy.tokenizer))
    assert len(outs) == K
    for o in outs:
        assert o["extra_logs"]["crl_valid"] == 0.0 and o["extra_logs"]["crl_env_error"] == 1.0
        assert o["reward"] == 0.0 and len(o["action_ranges"]) == 1  # one turn, then the episode ends
    assert runtime.counters["env_errors"] == K
    assert sum(f"{where} failed" in r.message and "crashed" in r.message for r in caplog.records) == K
    runtime.close()


STEP_S = 0.6


class SlowEnv(CorridorEnv):
    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        time.sleep(STEP_S)  # a blocking simulator step
        return super().step(action)


def test_env_steps_never_block_the_event_loop(tmp_path: Path, policy: Any) -> None:
    engine = HFEngine(policy, choices=["<action>east</action>"])

    def timed(env_cls: type[CorridorEnv]) -> tuple[float, float]:
        runtime, _ = runtime_of(tmp_path, length=1, env_factory=lambda env_id: env_cls(length=1))
        ticks: list[float] = []

        async def main() -> None:
            task = asyncio.ensure_future(group(ex.AgentExecutor(runtime), engine, policy.tokenizer))
            while not task.done():
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.01)
            await task

        t0 = time.perf_counter()
        asyncio.run(main())
        runtime.close()
        gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
        return time.perf_counter() - t0, max(gaps, default=0.0)

    fast, _ = timed(CorridorEnv)
    slow, gap = timed(SlowEnv)
    assert gap < STEP_S - 0.1, f"the event loop stalled for {gap:.2f} s during an env step"
    # the K steps ran side by side: one step's time, not K of them (sequential would add K x STEP_S)
    assert slow < fast + STEP_S * K / 2


def test_openrlhf_multiturn_executor_runs_our_instance(tmp_path: Path, policy: Any) -> None:
    """OpenRLHF's own executor builds ``CRLAgentInstance()`` with no arguments, per sample."""
    runtime, service = runtime_of(tmp_path, length=5, max_turns=2)
    runtime.tokenizer = policy.tokenizer
    ex.set_default_runtime(runtime)
    try:
        assert issubclass(ex.CRLAgentInstance, AgentInstanceBase)
        executor = MultiTurnAgentExecutor(ex.CRLAgentInstance)
        outs = asyncio.run(group(executor, HFEngine(policy, choices=["<action>west</action>"]), policy.tokenizer))
    finally:
        ex.set_default_runtime(None)
    assert [o["extra_logs"]["crl_guided"] for o in outs] == [1.0, 1.0, 0.0, 0.0]
    assert all(o["extra_logs"]["crl_turn_cap"] == 1.0 and len(o["action_ranges"]) == 2 for o in outs)
    assert service.counters["submitted"] == K
    runtime.close()


def test_grpo_runs_free_without_a_service(tmp_path: Path, policy: Any) -> None:
    cfg = load_config(None, ["method=grpo", f"env.group_size={K}", "env.max_turns=2", "actor.max_new_tokens=24"])
    runtime = ex.EpisodeRuntime(cfg, None, env_factory=lambda env_id: CorridorEnv(length=1))
    outs = asyncio.run(group(ex.AgentExecutor(runtime), HFEngine(policy, choices=["<action>east</action>"]),
                             policy.tokenizer))
    assert all(o["extra_logs"]["crl_guided"] == 0.0 and o["reward"] == 1.0 for o in outs)
    with pytest.raises(ValueError, match="needs a service client"):
        ex.EpisodeRuntime(load_config(None), None)
    runtime.close()


def test_agent_file_loads_as_openrlhf_loads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``openrlhf.trainer.ray.vllm_engine._load_agent_executor`` (which imports vLLM) does exactly this."""
    from crl_train.openrlhf.launcher import AGENT_FILE

    spec = importlib.util.spec_from_file_location("agent_module", str(AGENT_FILE))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert issubclass(module.AgentExecutor, AgentExecutorBase)
    executor = module.AgentExecutor()  # no arguments: the settings come from the environment
    ex.set_default_runtime(None)
    monkeypatch.delenv(SETTINGS_ENV, raising=False)
    with pytest.raises(SettingsMissing, match="crl-train --backend openrlhf"):
        _ = executor.runtime
    cfg = load_config(None, ["method=grpo"])
    monkeypatch.setenv(SETTINGS_ENV, ClusterSettings.of(cfg, service_name="s", namespace="n", run_dir="/r",
                                                        env_threads=4).to_json())
    try:
        runtime = module.AgentExecutor().runtime
        assert runtime.cfg.method == "grpo" and runtime.client is None and runtime.threads._max_workers == 4
    finally:
        ex.set_default_runtime(None)


def test_runtime_submit_is_deprecated_and_still_submits(tmp_path: Path) -> None:
    from crl_gym.protocol import DistillationRequest, Trajectory

    runtime, service = runtime_of(tmp_path)
    with pytest.warns(DeprecationWarning, match="EpisodeRuntime.submit"):
        asyncio.run(runtime.submit(DistillationRequest("t", Trajectory(), 0.0, False, None)))
    assert service.counters["submitted"] == 1
    runtime.close()
