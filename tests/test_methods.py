"""The method registry: what each method trains."""

import pytest

from crl_train.algorithms import AdvantageEstimator
from crl_train.config import METHOD_NAMES, load_config
from crl_train.methods import METHODS, Method, make_method


def test_every_config_method_is_registered() -> None:
    assert sorted(m.value for m in METHODS.names()) == sorted(METHOD_NAMES)


@pytest.mark.parametrize(
    ("name", "guided", "actor", "distill", "train", "adv"),
    [
        ("grpo", False, True, False, False, AdvantageEstimator.GRPO),
        ("complementary", True, True, True, True, AdvantageEstimator.SPLIT_SUBGROUP),
        ("static_online", True, True, True, False, AdvantageEstimator.SPLIT_SUBGROUP),
        ("exp_only", True, False, True, True, AdvantageEstimator.SPLIT_SUBGROUP),
        ("offline_exp", True, True, False, False, AdvantageEstimator.SPLIT_SUBGROUP),
        ("edge", True, True, True, False, AdvantageEstimator.EDGE_POOLED),
    ],
)
def test_methods_actor_and_service_sides(name: str, guided: bool, actor: bool, distill: bool, train: bool,
                                         adv: AdvantageEstimator) -> None:
    extra = ["experience.offline_source=x.jsonl"] if name == "offline_exp" else []
    m = make_method(load_config(None, [f"method={name}", *extra]))
    assert isinstance(m, Method) and m.name == name
    opts = m.service_options()
    assert (m.guided, m.trains_actor, opts.distill, opts.train, m.advantage) == (guided, actor, distill, train, adv)  # type: ignore[attr-defined]
    assert opts.extractor == guided and (opts.edge is not None) == (name == "edge")
    assert (opts.offline_source is not None) == (name == "offline_exp")


def test_unknown_method() -> None:
    with pytest.raises(KeyError, match="accepted: grpo"):
        METHODS.get("ppo")


# --- every method through Trainer.step, on the corridor env with tiny models (fast) -------------

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from crl_gym.wrappers.examples import CorridorEnv  # noqa: E402
from crl_train.run.outputs import metric_fields  # noqa: E402
from crl_train.run.trainer import Trainer  # noqa: E402

SMALL = ["env.ids=[corridor]", "env.tasks_per_step=2", "env.group_size=4", "env.max_turns=3", "train.eval_episodes=0",
         "actor.tiny_vocab_size=300", "extractor.tiny_vocab_size=300", "actor.tiny_hidden=32", "extractor.tiny_hidden=32",
         "actor.tiny_layers=1", "extractor.tiny_layers=1", "algo.buffer_size=2", "algo.merge_every=1",
         "experience.asynchronous=false", "experience.max_prompt_chars=600", "extractor.max_context_tokens=512",
         "experience.seed_entries=['Walk east to the exit.']"]  # the preset's own seed entry is MiniHack's only


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
    method = make_method(cfg)
    assert all(0.0 <= r["success"] <= 1.0 for r in rows)
    if method.guided:
        assert rows[-1]["success_guided"] is not None
        assert (rows[-1]["distilled"] > 0) == method.service_options().distill
        assert rows[-1]["credited"] is not None
    else:
        assert rows[-1]["success_guided"] is None and rows[-1]["bank_size"] == 1  # the seed entry only
    if not method.trains_actor:
        assert not changed  # exp_only: the actor is frozen
    if name == "edge":
        assert rows[-1]["edge_gain_mean"] is not None and rows[-1]["edge_pruned"] is not None
    # a real row has exactly the declared columns (crl_train.run.outputs is the one source of truth)
    for r in rows:
        assert list(r) == list(metric_fields(method.metric_fields()))
    lines = (tmp_path / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == (2 * 8 if method.guided else 0)  # every experience episode's request is kept


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
        size = len(trainer.c.service.manager.bank)
        row = trainer.step(0)
    finally:
        trainer.close()
    assert row["distilled"] == 0 and row["bank_size"] == size  # frozen after the one-off distillation


# --- the method objects on hand-made rollouts ----------------------------------------------------

import torch  # noqa: E402

from crl_train.rollout import Episode  # noqa: E402


def _rollout(rewards: list[float], conds: list[str], errors: tuple[int, ...] = ()) -> Any:
    from crl_train.methods import Rollout

    eps = [Episode(group=0, condition=c, env_id="e", seed=0, success=r > 0) for r, c in zip(rewards, conds, strict=True)]
    for i in errors:
        eps[i].info["error"] = "step: RuntimeError: env crashed"
    return Rollout.of(eps)


def test_an_episode_the_env_ended_by_raising_is_left_out_of_the_subgroup_statistics() -> None:
    method = make_method(load_config(None, ["method=complementary"]))
    # guided [1, 0, (error)], free [1, 0]: the guided subgroup's mean/std are over [1, 0] only
    ro = _rollout([1.0, 0.0, 0.0, 1.0, 0.0], ["guided", "guided", "guided", "free", "free"], errors=(2,))
    adv = method.advantages(ro)
    # mean 0.5, population std 0.5 → ±1 (ε = 1e-6); the errored episode gets 0
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 1.0, -1.0]), atol=1e-5)
    assert method.train_mask(ro).tolist() == [True, True, False, True, True]


def test_edge_gain_ignores_errored_episodes_and_its_distillation_weight_is_the_config_lambda() -> None:
    edge = make_method(load_config(None, ["method=edge"]))
    # guided [1, (error, would count as 0)], free [0, 0]: Δe = 1 − 0 = 1 (it would be 0.5 with the error)
    ro = _rollout([1.0, 0.0, 0.0, 0.0], ["guided", "guided", "free", "free"], errors=(1,))
    mask = edge.train_mask(ro)
    assert mask.tolist() == [True, False, True, True]
    _, metrics = edge.extra_terms(ro, actor=None)  # type: ignore[arg-type]  # no prompt ids: no distillation pair
    assert metrics["edge_gain_mean"] == pytest.approx(1.0)
    assert load_config(None, []).algo.edge_lambda == 0.1
    with pytest.raises(Exception, match="edge_lambda"):
        load_config(None, ["algo.edge_lambda=-1"])


@pytest.mark.parametrize(("estimator", "loss"), [("topk", "reverse_kl_topk"), ("sampled", "reverse_kl_sampled")])
def test_edge_distillation_term_uses_lambda_and_the_configured_estimator(tmp_path: Path, estimator: str, loss: str) -> None:
    cfg = load_config(None, ["method=edge", "algo.edge_lambda=0.3", "algo.edge_threshold=-2", "train.steps=1",
                             f"algo.edge_kl_estimator={estimator}", "algo.edge_top_k=3", *SMALL])
    trainer = Trainer(cfg, tmp_path, progress=False, env_factory=_corridor)
    try:
        eps = trainer.c.runner.collect([("corridor", 0)], guided=True, step=0)
        from crl_train.methods import Rollout

        terms, _ = trainer.method.extra_terms(Rollout.of(eps), trainer.c.actor)
        assert [(u.loss.value, u.params.kwargs()) for u in terms] == [(loss, {"coef": 0.3})]
        batch, actor = terms[0].batch, trainer.c.actor
        if estimator == "topk":
            ids, own = actor.support_logprobs(batch, k=3)
            assert torch.equal(batch.extra["support_ids"], ids)  # the student's own top-3 under the current weights
            assert batch.extra["teacher_support"].shape == ids.shape
            trained = batch.loss_mask.bool()
            # EDGE's bank starts empty: the guided prompt carries no entry yet, so the teacher is the
            # student and its log-probs of the same ids line up position by position
            assert torch.allclose(batch.extra["teacher_support"][trained], own[trained], atol=1e-5)
        else:
            assert batch.extra["teacher"].shape == batch.loss_mask.shape
    finally:
        trainer.close()


def test_edge_teacher_log_probs_are_read_at_the_student_s_positions_behind_a_longer_prompt(tmp_path: Path) -> None:
    from crl_train.methods.edge import distillation_term
    from crl_train.policy.base import TrainBatch
    from crl_train.rollout.runner import swap_prompt

    cfg = load_config(None, ["method=edge", "train.steps=1", *SMALL])
    trainer = Trainer(cfg, tmp_path, progress=False, env_factory=_corridor)
    try:
        actor = trainer.c.actor
        e = next(x for x in trainer.c.runner.collect([("corridor", 0)], guided=True, step=0) if x.condition == "free")
        teacher_prompt = e.prompt_ids + e.prompt_ids[-7:]  # 7 more tokens of context: every position shifts by 7
        term = distillation_term([(e, teacher_prompt)], actor, 0.1, top_k=3)
        ids, got = term.batch.extra["support_ids"][0], term.batch.extra["teacher_support"][0]
        tb = TrainBatch.from_sequences([swap_prompt(e, teacher_prompt)], [0.0], actor.pad_token_id)
        vocab = actor.model.config.vocab_size
        _, full = actor.support_logprobs(tb, ids=torch.arange(vocab).expand(1, tb.input_ids.shape[1], vocab).contiguous())
        start = len(e.prompt_ids)
        for p in range(start, len(e.sequence)):
            assert torch.allclose(got[p], full[0, p + 7, ids[p]], atol=1e-5)
        assert not got[:start].any()  # the student's prompt is not distilled
    finally:
        trainer.close()


def test_edge_trains_rl_and_distillation_in_one_actor_step(tmp_path: Path) -> None:
    cfg = load_config(None, ["method=edge", "algo.edge_threshold=-2", "train.steps=1", *SMALL])
    trainer = Trainer(cfg, tmp_path, progress=False, env_factory=_corridor)
    try:
        before = trainer.c.actor.step
        row = trainer.step(0)
        assert trainer.c.actor.step == before + 1  # one optimizer step for RL loss + λ·KL
        assert row["edge_kl"] is not None and row["edge_topk_mass"] is not None
        assert row["actor_objective"] == pytest.approx(row["actor_loss"] + 0.1 * row["edge_kl"], rel=1e-4, abs=1e-6)
    finally:
        trainer.close()


def test_one_cooldown_default_that_really_cools_down() -> None:
    from crl_train.algorithms import training_count_weights
    from crl_train.config import AlgoConfig, ExtractorSettings

    algo = AlgoConfig()

    # the Extractor reads its cooldown from ExtractorSettings, whose default is the config's
    assert ExtractorSettings().cooldown == algo.cooldown == 2
    # an entry trained at extractor step 4 gets weight 0 at step 5 under the default δ
    w = training_count_weights(torch.tensor([1]), torch.tensor([4]), 5, cooldown=algo.cooldown, alpha=algo.count_alpha)
    assert w.tolist() == [0.0]
