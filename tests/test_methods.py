"""The method registry: what each method trains."""

import pytest

from crl_train.algorithms import AdvantageEstimator
from crl_train.config import METHOD_NAMES
from crl_train.methods import METHODS, get_method


def test_every_config_method_is_registered() -> None:
    assert sorted(m.value for m in METHODS.names()) == sorted(METHOD_NAMES)


@pytest.mark.parametrize(
    ("name", "exp", "actor", "distill", "extractor", "adv"),
    [
        ("grpo", False, True, False, False, AdvantageEstimator.GRPO),
        ("complementary", True, True, True, True, AdvantageEstimator.SPLIT_SUBGROUP),
        ("static_online", True, True, True, False, AdvantageEstimator.SPLIT_SUBGROUP),
        ("exp_only", True, False, True, True, AdvantageEstimator.SPLIT_SUBGROUP),
        ("offline_exp", True, True, False, False, AdvantageEstimator.SPLIT_SUBGROUP),
        ("edge", True, True, True, False, AdvantageEstimator.EDGE_POOLED),
    ],
)
def test_method_specs(name: str, exp: bool, actor: bool, distill: bool, extractor: bool, adv: AdvantageEstimator) -> None:
    m = get_method(name)
    assert (m.uses_experience, m.train_actor, m.distill_online, m.train_extractor, m.advantage) == (exp, actor, distill, extractor, adv)
    assert m.offline_bank == (name == "offline_exp") and m.edge == (name == "edge")


def test_unknown_method() -> None:
    with pytest.raises(KeyError, match="accepted: grpo"):
        get_method("ppo")


# --- every method through Trainer.step, on the corridor env with tiny models (fast) -------------

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from crl_gym.wrappers.examples import CorridorEnv  # noqa: E402
from crl_train.config import load_config  # noqa: E402
from crl_train.outputs import metric_fields  # noqa: E402
from crl_train.trainer import Trainer  # noqa: E402

SMALL = ["env.ids=[corridor]", "env.tasks_per_step=2", "env.group_size=4", "env.max_turns=3", "train.eval_episodes=0",
         "actor.tiny_vocab_size=300", "extractor.tiny_vocab_size=300", "actor.tiny_hidden=32", "extractor.tiny_hidden=32",
         "actor.tiny_layers=1", "extractor.tiny_layers=1", "algo.buffer_size=2", "algo.merge_every=1",
         "experience.asynchronous=false", "experience.max_prompt_chars=600", "extractor.max_context_tokens=512"]


def _corridor(env_id: str) -> Any:
    return CorridorEnv(length=1, max_turns=3)


@pytest.mark.parametrize("name", ["grpo", "complementary", "static_online", "exp_only", "edge"])
def test_method_runs_a_step(name: str, tmp_path: Path) -> None:
    extra = ["algo.gate=true", "algo.self_distill=true"] if name == "complementary" else []
    cfg = load_config(None, [f"method={name}", "train.steps=2", *SMALL, *extra])
    trainer = Trainer(cfg, tmp_path, progress=False, env_factory=_corridor)
    try:
        before = {n: p.detach().clone() for n, p in trainer.c.actor.model.named_parameters()}
        rows = [trainer.step(t) for t in range(2)]
        changed = any(not p.detach().equal(before[n]) for n, p in trainer.c.actor.model.named_parameters())
    finally:
        trainer.close()
    spec = get_method(name)
    assert all(0.0 <= r["success"] <= 1.0 for r in rows)
    if spec.uses_experience:
        assert rows[-1]["success_guided"] is not None
        assert (rows[-1]["distilled"] > 0) == spec.distill_online
    else:
        assert rows[-1]["success_guided"] is None and rows[-1]["bank_size"] == 1  # the seed entry only
    if not spec.train_actor:
        assert not changed  # exp_only: the actor is frozen
    if name == "edge":
        assert "edge_gain_mean" in rows[-1]
    # a real row has exactly the declared columns (crl_train.outputs is the one source of truth)
    for r in rows:
        assert list(r) == list(metric_fields(edge=spec.edge, self_distill=name == "complementary"))
    lines = (tmp_path / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == (2 * 8 if spec.uses_experience else 0)  # every experience episode's request is kept


def test_offline_exp_builds_its_bank_once_from_a_prior_run(tmp_path: Path) -> None:
    prior = Trainer(load_config(None, ["method=static_online", "train.steps=1", *SMALL]), tmp_path / "prior",
                    progress=False, env_factory=_corridor)
    try:
        prior.step(0)
    finally:
        prior.close()
    source = tmp_path / "prior" / "trajectories.jsonl"
    cfg = load_config(None, ["method=offline_exp", f"experience.offline_source={source}", "train.steps=1",
                             "experience.seed_entries=[]", *SMALL])
    trainer = Trainer(cfg, tmp_path / "offline", progress=False, env_factory=_corridor)
    try:
        size = len(trainer.c.manager.bank)
        row = trainer.step(0)
    finally:
        trainer.close()
    assert row["distilled"] == 0 and row["bank_size"] == size  # frozen after the one-off distillation
