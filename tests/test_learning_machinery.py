"""The learning machinery learns: on a trivially learnable rule, the tiny extractor (through the service's
real credit → B_φ → CISPO path) and the tiny actor (through the trainer's GRPO step) raise their reward
from its initial rate to at least twice that within a fixed number of updates, and the same run with
the advantage's sign flipped does not.

Both models are random-initialised tiny ones with fixed seeds; the assertions are on the rise, never
on time. The flipped run is the control that makes each test able to fail: a sign error anywhere
between the reward and the gradient turns the rise into a fall.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _trainer_fixtures import TEXTS, manager

import crl_train.extractor.model as extractor_model
from crl_gym.envs.recall import RecallEnv
from crl_gym.experience.schemas import MAX_OPS
from crl_gym.protocol import DistillationRequest, ExperienceRef, Step, Trajectory
from crl_train.config import ExtractorSettings, load_config
from crl_train.extractor.model import Extractor
from crl_train.methods.grpo import GRPO
from crl_train.policy.base import OptimConfig, SamplingConfig
from crl_train.policy.tiny import build_tiny_policy
from crl_train.run.trainer import Trainer
from crl_train.service import ExperienceService, ServiceOptions

GOAL = "Play east."
"""The extractor's rule: an entry whose chosen action (the action slot) is ``east`` makes its episode succeed."""
ROUNDS = 24
"""Distillation rounds of the extractor (one rollout step each; a CISPO update every 16 credited samples)."""
REQUESTS = 16
"""Finished episodes distilled per round."""
STEPS = 20
"""GRPO steps of the actor (2 groups of 8 episodes each)."""
LAST = 5
"""The final rate is pooled over this many last rounds / steps."""


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread: per-token Python work dominates a tiny model on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def negated(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def flipped(*args: Any) -> torch.Tensor:
        return -fn(*args)

    return flipped


# ------------------------------------------------------------------------------------ the extractor


def _episode(env: RecallEnv, seed: int) -> tuple[str, Trajectory, float]:
    """One finished one-step Recall episode (its action cycles through the four)."""
    obs, info = env.reset(seed=seed)
    action = info["admissible_actions"][seed % 4]
    _, reward, _, _, after = env.step(action)
    return str(info["task"]), Trajectory(steps=[Step(obs, action, float(reward), after)], initial_observation=obs), float(reward)


def extractor_rates(rounds: int) -> list[tuple[int, int]]:
    """Per round: (entries written, entries that follow the rule).

    Each round submits ``REQUESTS`` finished Recall episodes to a real :class:`ExperienceService`. From
    the second round on, each episode was guided by an entry the previous round wrote, and it succeeded
    iff that entry follows the rule. ``end_step`` credits those entries (r̄(m) = ±1), B_φ fills with
    their samples, CISPO updates every 16, and the round's episodes are distilled into new entries.
    """
    policy = build_tiny_policy([*TEXTS, "north east south west", GOAL], vocab_size=300, hidden=32, layers=1, heads=2,
                               kv_heads=1, intermediate=64, seed=1, sampling=SamplingConfig(seed=1),
                               optim=OptimConfig(lr=1e-2, loss_scale="tokens"))  # type: ignore[arg-type]
    extractor = Extractor(
        policy,
        ExtractorSettings(
            max_new_tokens=24,
            max_context_tokens=1024,
            max_prompt_chars=500,
            constrained=True,
            max_entry_chars=8,
            action_slot=1,
            cooldown=0,
        ),
    )
    options = ServiceOptions(distill=True, train=True, buffer_size=16, asynchronous=False, merge_every=0, refine=False)
    service = ExperienceService(manager(), extractor, options)
    env = RecallEnv(num_tasks=4, length=1, num_actions=4)
    previous: list[tuple[int, str]] = []
    out = []
    try:
        for step in range(rounds):
            before = set(service.manager.bank.ids())
            for j in range(REQUESTS):
                seed = step * REQUESTS + j
                task, trajectory, reward = _episode(env, seed)
                entry = previous[j % len(previous)] if previous else None
                ok = entry[1].startswith(GOAL) if entry else reward > 0
                service.submit(DistillationRequest(
                    task=task, trajectory=trajectory, outcome=float(ok), success=ok,
                    experience=ExperienceRef(*entry) if entry else None, condition="guided" if entry else "free",
                    env_id="crl/Recall-v0", seed=seed, rollout_step=step))
            service.end_step(step)  # credit → B_φ → CISPO, then distil this round's episodes
            new = [(e.id, e.text) for e in service.manager.bank if e.id not in before]
            previous = new or previous
            out.append((len(new), sum(text.startswith(GOAL) for _, text in new)))
        assert service.stats().extractor_updates >= 10  # the rule was learned (or not) by CISPO updates
    finally:
        service.close()
    return out


def _rate(rows: list[tuple[int, int]]) -> float:
    written = sum(n for n, _ in rows)
    assert written >= 10, rows  # enough entries for a rate
    return sum(k for _, k in rows) / written


def _initial_and_final(rows: list[tuple[int, int]]) -> tuple[float, float]:
    """The untrained extractor's rate (the first two rounds: no update has run yet) and the last rounds'."""
    return _rate(rows[:2]), _rate(rows[-LAST:])


def test_cispo_through_the_service_teaches_the_tiny_extractor_a_rule() -> None:
    initial, final = _initial_and_final(extractor_rates(ROUNDS))
    assert 0.1 <= initial <= 0.5  # four actions: the untrained choice is a draw
    assert final >= 2 * initial, (initial, final)


def test_with_the_advantage_sign_flipped_the_extractor_does_not_learn_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extractor_model, "batch_advantages", negated(extractor_model.batch_advantages))
    initial, final = _initial_and_final(extractor_rates(ROUNDS))
    assert not final >= 2 * initial, (initial, final)  # the test above, failing
    assert final <= initial, (initial, final)  # the rule's share falls instead


# ------------------------------------------------------------------------------------ the actor


def actor_successes(tmp_path: Path) -> list[float]:
    """Success rate per step of ``grpo`` with the tiny actor on one Recall task (one step, four actions)."""
    cfg = load_config(None, [
        "method=grpo", "env.ids=[crl/Recall-v0]", "env.kwargs={num_tasks: 1, length: 1, num_actions: 4}",
        "env.tasks_per_step=2", "env.group_size=8", "env.max_turns=1", "train.eval_episodes=0",
        "actor.tiny_vocab_size=300", "actor.tiny_hidden=32", "actor.tiny_layers=1", "actor.lr=0.01",
        "experience.asynchronous=false", f"train.steps={STEPS}"])
    trainer = Trainer(cfg, tmp_path, progress=False)
    try:
        return [float(trainer.step(t)["success"]) for t in range(STEPS)]
    finally:
        trainer.close()


def test_grpo_teaches_the_tiny_actor_a_recall_task(tmp_path: Path) -> None:
    rates = actor_successes(tmp_path)
    initial, final = rates[0], sum(rates[-LAST:]) / LAST  # step 0 rolls out before any update
    assert 0.1 <= initial <= 0.5  # four actions
    assert final >= 2 * initial, rates


def test_with_the_advantage_sign_flipped_the_actor_does_not_learn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GRPO, "advantages", negated(GRPO.advantages))
    rates = actor_successes(tmp_path)
    initial, final = rates[0], sum(rates[-LAST:]) / LAST  # step 0 rolls out before any update
    assert not final >= 2 * initial, rates
    assert final <= initial, rates


def test_the_cispo_normalisation_option_reaches_the_extractors_loss() -> None:
    from crl_train.algorithms import PolicyLoss
    from crl_train.config import ConfigError
    from crl_train.service.build import extractor_spec

    assert load_config(None, []).algo.cispo_normalisation == "tokens"  # Eq. 3 is the default
    spec = extractor_spec(load_config(None, ["algo.cispo_normalisation=sequences"]), None)
    assert spec.settings is not None and spec.settings.normalisation == "sequences"
    policy = build_tiny_policy(TEXTS, vocab_size=300, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, seed=0)
    assert Extractor(policy).loss == PolicyLoss.CISPO
    sequences = ExtractorSettings(normalisation="sequences")
    assert Extractor(policy, sequences).loss == PolicyLoss.CISPO_SEQUENCES
    with pytest.warns(DeprecationWarning, match="ExtractorSettings"):  # the old keyword form
        assert Extractor(policy, normalisation="sequences").loss == PolicyLoss.CISPO_SEQUENCES
    with pytest.raises(ValueError, match="normalisation"):
        Extractor(policy, ExtractorSettings(normalisation="bytes"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cispo_normalisation"):
        load_config(None, ["algo.cispo_normalisation=bytes"])


def test_the_max_ops_option_bounds_every_distillation_answer() -> None:
    from crl_train.config import ConfigError
    from crl_train.service.build import extractor_spec

    assert load_config(None, []).experience.max_ops == MAX_OPS
    spec = extractor_spec(load_config(None, ["experience.max_ops=1"]), None)
    assert spec.extractor_settings.max_ops == 1
    with pytest.raises(ConfigError, match="max_ops"):
        load_config(None, ["experience.max_ops=0"])
    env = RecallEnv(num_tasks=4, length=1, num_actions=4)
    requests = []
    for seed in range(16):
        task, trajectory, reward = _episode(env, seed)
        requests.append(DistillationRequest(task=task, trajectory=trajectory, outcome=reward, success=reward > 0,
                                            experience=None))

    def ops_per_answer(max_ops: int) -> list[int]:
        policy = build_tiny_policy([*TEXTS, "north east south west"], vocab_size=300, hidden=32, layers=1, heads=2,
                                   kv_heads=1, intermediate=64, seed=1, sampling=SamplingConfig(seed=1))
        extractor = Extractor(
            policy,
            ExtractorSettings(
                max_new_tokens=24,
                max_context_tokens=1024,
                max_prompt_chars=500,
                constrained=True,
                max_entry_chars=8,
                action_slot=1,
                max_ops=max_ops,
            ),
        )
        return [len(ops) for _, ops in extractor.distill(requests)]

    assert max(ops_per_answer(MAX_OPS)) > 1  # allowed several, the untrained model writes several
    assert set(ops_per_answer(1)) == {1}
    with pytest.raises(ValueError, match="max_ops"):
        ops_per_answer(0)


def test_the_return_reward_option_reaches_the_service_track() -> None:
    from crl_train.config import ConfigError
    from crl_train.service.build import service_options

    assert load_config(None, []).algo.return_reward is None  # the paper's rule: a Return is never credited
    options = service_options(load_config(None, ["algo.return_reward=0.0"]))
    assert options.return_reward == 0.0
    service = ExperienceService(manager(), Extractor(build_tiny_policy(
        TEXTS, vocab_size=300, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, seed=0)),
        ServiceOptions(asynchronous=False, return_reward=-0.25))
    try:
        assert service.track is not None and service.track.return_reward == -0.25
    finally:
        service.close()
    with pytest.raises(ConfigError, match="return_reward"):
        load_config(None, ["algo.return_reward=.nan"])


def test_the_distill_fraction_option_reaches_the_service_track() -> None:
    from crl_train.config import ConfigError
    from crl_train.service.build import service_options

    assert load_config(None, []).experience.distill_fraction == 1.0  # the paper: every episode is distilled
    options = service_options(load_config(None, ["experience.distill_fraction=0.25", "seed=7"]))
    assert (options.distill_fraction, options.draw_seed) == (0.25, 7)
    for bad in ("0", "1.5"):
        with pytest.raises(ConfigError, match="distill_fraction"):
            load_config(None, [f"experience.distill_fraction={bad}"])
