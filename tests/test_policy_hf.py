"""HFPolicy on the tiny preset: batched generation, log-prob consistency, training, checkpoints."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from crl_train.policy import Policy  # noqa: E402
from crl_train.policy.base import LossTerm, OptimConfig, SamplingConfig, TokenSequence, TrainBatch  # noqa: E402
from crl_train.policy.hf import HFPolicy, resolve_dtype  # noqa: E402
from crl_train.policy.tiny import build_tiny_policy  # noqa: E402

TEXTS = ["You are in a room.", "go north", "go south", "open door", "wait", "<action>north</action>"] * 3
ACTIONS = [["go north", "go south"], None, ["open door", "wait", "go north"], ["wait"]]
SMALL = dict(hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64)


def make_policy(temperature: float = 0.7, **optim: Any) -> HFPolicy:
    return build_tiny_policy(TEXTS, vocab_size=320, sampling=SamplingConfig(temperature=temperature, seed=0),
                             optim=OptimConfig(**optim) if optim else None, **SMALL)


@pytest.fixture(scope="module")
def policy() -> HFPolicy:
    return make_policy()


def prompts_for(policy: HFPolicy) -> list[list[int]]:
    # Different lengths, so left padding is exercised.
    return [policy.apply_chat([{"role": "user", "content": "where now? " * k}]) for k in (1, 4, 2, 7)]


def sequences(policy: HFPolicy, prompts: list[list[int]], gens: list[Any]) -> list[TokenSequence]:
    out = []
    for p, g in zip(prompts, gens, strict=True):
        s = TokenSequence()
        s.append_context(p)
        s.append_generation(g)
        s.append_context(policy.chat.user_turn_ids("You see a wall."))
        out.append(s)
    return out


def test_is_a_policy(policy: HFPolicy) -> None:
    assert isinstance(policy, Policy)


def test_generation_shapes_constraints_and_finish(policy: HFPolicy) -> None:
    prompts = prompts_for(policy)
    gens = policy.generate(prompts, 10, allowed=ACTIONS)
    assert len(gens) == 4
    for g, acts, p in zip(gens, ACTIONS, prompts, strict=True):
        assert g.prompt_ids == p and len(g.logprobs) == len(g.token_ids) <= 10
        assert all(lp <= 0.0 for lp in g.logprobs)
        if acts is not None:  # a random model still writes a valid action
            assert g.text in acts and g.finish_reason == "stop"
            assert g.token_ids[-1] == policy.tokenizer.eos_token_id and g.allowed is not None
            assert all(tok in allowed for tok, allowed in zip(g.token_ids, g.allowed, strict=True))
        else:
            assert g.allowed is None
    # A single admissible action is forced: every token has probability 1.
    assert gens[3].logprobs == pytest.approx([0.0] * len(gens[3].logprobs), abs=1e-6)


def test_generate_logprobs_equal_recomputed(policy: HFPolicy) -> None:
    prompts = prompts_for(policy)
    gens = policy.generate(prompts, 12, allowed=ACTIONS)
    batch = TrainBatch.from_sequences(sequences(policy, prompts, gens), [1.0, -1.0, 0.5, 0.0], policy.pad_token_id)
    assert batch.constraints is not None
    recomputed = policy.logprobs(batch)
    mask = batch.loss_mask.bool()
    assert torch.allclose(recomputed[mask], batch.old_logprobs[mask], atol=1e-4)
    assert (recomputed[~batch.attention_mask.bool()] == 0).all()
    # Without the stored masks the constrained tokens' log-probs differ: the masks matter.
    batch.constraints = None
    unmasked = policy.logprobs(batch)
    row = 0
    assert not torch.allclose(unmasked[row][mask[row]], batch.old_logprobs[row][mask[row]], atol=1e-3)


def test_seeded_sampling_is_reproducible_and_greedy_is_argmax(policy: HFPolicy) -> None:
    prompts = prompts_for(policy)
    # Same seed, same weights: the same samples; the seeded stream advances between calls.
    one, two = make_policy(temperature=5.0), make_policy(temperature=5.0)
    a1, a2 = one.generate(prompts, 6), one.generate(prompts, 6)
    b1 = two.generate(prompts, 6)
    assert [g.token_ids for g in a1] == [g.token_ids for g in b1]
    assert [g.token_ids for g in a1] != [g.token_ids for g in a2]
    greedy = policy.generate(prompts[:1], 1, sampling=SamplingConfig(temperature=0.7, greedy=True))[0]
    logits = policy.model(torch.tensor([prompts[0]])).logits[0, -1]
    assert greedy.token_ids == [int(logits.argmax())]


def test_length_and_stop_strings(policy: HFPolicy) -> None:
    prompt = prompts_for(policy)[:1]
    greedy = SamplingConfig(temperature=0.7, greedy=True)
    g = policy.generate(prompt, 8, sampling=greedy)[0]
    assert g.finish_reason == "length" and len(g.token_ids) == 8  # this seed's model never picks EOS greedily
    # Stop on the first non-empty decoded prefix of the greedy text (a random byte-level model may
    # emit partial UTF-8, decoded as U+FFFD; the check runs on the same decode): it ends right there.
    prefixes = [policy.tokenizer.decode(g.token_ids[:j], skip_special_tokens=True) for j in range(1, 9)]
    j, stop = next((j, d) for j, d in enumerate(prefixes, 1) if d)
    cut = policy.generate(prompt, 8, sampling=SamplingConfig(temperature=0.7, greedy=True, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.text == stop and cut.token_ids == g.token_ids[:j]


def test_generate_bad_input(policy: HFPolicy) -> None:
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        policy.generate([[1], []], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        policy.generate([[1]], 0)
    with pytest.raises(ValueError, match="allowed has 1 entries for 2"):
        policy.generate([[1], [2]], 4, allowed=[None])
    with pytest.raises(TypeError, match="list of action strings"):
        policy.generate([[1]], 4, allowed=["north"])


def _greedy(policy: HFPolicy, prompts: list[list[int]], new: int, **kw: Any) -> list[Any]:
    return policy.generate(prompts, new, sampling=SamplingConfig(temperature=policy.sampling.temperature, greedy=True), **kw)


def test_prefix_cache_encodes_only_new_tokens_and_changes_nothing() -> None:
    policy = make_policy()
    policy.prefix_cache = True
    first = prompts_for(policy)[:3]
    turn1 = _greedy(policy, first, 5, cache_keys=["a", "b", "c"], allowed=[ACTIONS[0], None, ACTIONS[2]])
    assert set(policy._kv) == {"a", "b", "c"}
    for key, prompt, g in zip("abc", first, turn1, strict=True):  # every token fed: prompt + response[:-1]
        kv = policy._kv[key]
        assert kv.ids == tuple(prompt) + tuple(g.token_ids[:-1])
        assert all(k.shape[1] == len(kv.ids) == v.shape[1] for k, v in kv.layers)
    # turn 2: "a" and "c" extend their cached conversations, "b" was edited (no prefix: encoded
    # in full), "d" is new; the batch mixes all four cached lengths
    second = [first[0] + turn1[0].token_ids + policy.chat.user_turn_ids("You see a wall."),
              policy.apply_chat([{"role": "user", "content": "something else entirely"}]),
              first[2] + turn1[2].token_ids + policy.chat.user_turn_ids("open door"),
              policy.apply_chat([{"role": "user", "content": "wait"}])]
    cached = _greedy(policy, second, 6, cache_keys=["a", "b", "c", "d"], allowed=[ACTIONS[0], None, None, ACTIONS[3]])
    policy.prefix_cache = False
    policy.release_cache()
    plain = _greedy(policy, second, 6, allowed=[ACTIONS[0], None, None, ACTIONS[3]])
    for x, y in zip(cached, plain, strict=True):
        assert x.token_ids == y.token_ids and x.allowed == y.allowed
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)


def test_prefix_cache_is_dropped_when_the_weights_change(tmp_path: Path) -> None:
    policy = make_policy(lr=1e-2)
    policy.prefix_cache = True
    prompts = prompts_for(policy)[:2]
    gens = policy.generate(prompts, 4, cache_keys=[0, 1])
    assert len(policy._kv) == 2
    with pytest.raises(ValueError, match="cache_keys has 1 entries for 2 prompts"):
        policy.generate(prompts, 4, cache_keys=[0])
    policy.release_cache([0])
    assert list(policy._kv) == [1]
    policy.save(tmp_path / "ckpt")
    batch = TrainBatch.from_sequences(sequences(policy, prompts, gens), [1.0, -1.0], policy.pad_token_id)
    policy.train_step(batch, pg_loss)
    assert policy._kv == {}  # keys/values of the old weights would be wrong now
    policy.generate(prompts, 4, cache_keys=[0, 1])
    policy.load(tmp_path / "ckpt")
    assert policy._kv == {}
    policy.prefix_cache = False
    policy.generate(prompts, 4, cache_keys=[0, 1])
    assert policy._kv == {}  # cache_keys are ignored with the cache off


def pg_loss(logprobs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, **kw: Any):  # type: ignore[no-untyped-def]
    """-mean over sequences of adv * (token-mean log-prob): a per-sequence-mean loss."""
    per_seq = (logprobs * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    loss = -(adv * per_seq).mean()
    return loss, {"seen_groups": float(kw["group_ids"].numel()) if "group_ids" in kw else 0.0}


def token_loss(logprobs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, **kw: Any):  # type: ignore[no-untyped-def]
    """-token-mean of adv * log-prob: a token-mean loss (like CISPO's normalisation)."""
    return -((adv[:, None] * logprobs * mask).sum() / mask.sum()), {}


def _grads(policy: HFPolicy, batch: TrainBatch, loss_fn: Any) -> torch.Tensor:
    policy.model.zero_grad(set_to_none=True)
    ok, _, _ = policy.accumulate_gradients(batch, loss_fn)
    assert ok
    return torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None])


@pytest.mark.parametrize(("scale", "loss_fn"), [("samples", pg_loss), ("tokens", token_loss)])
def test_micro_batching_gives_the_full_batch_gradient(scale: str, loss_fn: Any) -> None:
    pol = make_policy(micro_batch_size=8, loss_scale=scale)
    prompts = prompts_for(pol)
    gens = pol.generate(prompts, 6, allowed=ACTIONS)
    batch = TrainBatch.from_sequences(sequences(pol, prompts, gens), [1.0, -0.5, 2.0, 0.3], pol.pad_token_id)
    full = _grads(pol, batch, loss_fn)
    for mbs in (3, 1):  # micro-batches of like length, each cut to its own width
        pol.optim = OptimConfig(micro_batch_size=mbs, loss_scale=scale)  # type: ignore[arg-type]
        split = _grads(pol, batch, loss_fn)
        assert torch.allclose(full, split, atol=1e-6, rtol=1e-4)


def test_loss_scale_weights_by_hand() -> None:
    pol = make_policy(micro_batch_size=2, loss_scale="tokens")
    ids = torch.ones(3, 4, dtype=torch.long)
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 1, 1]], dtype=torch.float32)
    batch = TrainBatch(ids, ids.clone(), mask, torch.zeros(3, 4), torch.zeros(3))
    first, second = batch.select(slice(0, 2)), batch.select(slice(2, 3))
    # tokens: (2 + 1) / 6 and 3 / 6; samples: 2 / 3 and 1 / 3.
    assert pol._scale(first, batch, 6) == pytest.approx(0.5) and pol._scale(second, batch, 6) == pytest.approx(0.5)
    pol.optim = OptimConfig(loss_scale="samples")
    assert pol._scale(first, batch, 6) == pytest.approx(2 / 3) and pol._scale(second, batch, 6) == pytest.approx(1 / 3)


def test_train_step_raises_logprobs_of_rewarded_actions() -> None:
    pol = make_policy(lr=1e-2, micro_batch_size=2)
    prompts = prompts_for(pol)[:2]
    gens = pol.generate(prompts, 6, allowed=[["go north", "go south"]] * 2)
    batch = TrainBatch.from_sequences(sequences(pol, prompts, gens), [1.0, 1.0], pol.pad_token_id,
                                      group_ids=[0, 0], condition_ids=[0, 1])
    before = (pol.logprobs(batch) * batch.loss_mask).sum()
    metrics = {}
    for _ in range(3):
        metrics = pol.train_step(batch, pg_loss)
    after = (pol.logprobs(batch) * batch.loss_mask).sum()
    assert after > before
    assert metrics["skipped"] == 0.0 and metrics["step"] == 3.0 and pol.step == 3
    assert metrics["lr"] == pytest.approx(1e-2) and metrics["seen_groups"] == pytest.approx(2.0)  # one micro-batch of 2
    assert metrics["num_tokens"] == batch.num_tokens and metrics["grad_norm"] > 0


def test_train_step_skips_bad_updates(caplog: pytest.LogCaptureFixture) -> None:
    pol = make_policy(lr=1e-2)
    prompts = prompts_for(pol)[:2]
    gens = pol.generate(prompts, 4)
    batch = TrainBatch.from_sequences(sequences(pol, prompts, gens), [1.0, 1.0], pol.pad_token_id)
    weights = [p.detach().clone() for p in pol.model.parameters()]

    def nan_loss(lp, old, adv, mask, **kw):  # type: ignore[no-untyped-def]
        return lp.sum() * float("nan"), {}

    out = pol.train_step(batch, nan_loss)
    assert out["skipped"] == 1.0 and pol.step == 0 and pol.skipped_steps == 1
    assert "non-finite" in caplog.text
    empty = TrainBatch.from_sequences(sequences(pol, prompts, gens), [1.0, 1.0], pol.pad_token_id)
    empty.loss_mask.zero_()
    assert pol.train_step(empty, pg_loss)["skipped"] == 1.0 and pol.skipped_steps == 2
    assert all(torch.equal(w, p) for w, p in zip(weights, pol.model.parameters(), strict=True))


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    pol = make_policy(lr=1e-3)
    prompts = prompts_for(pol)[:2]
    gens = pol.generate(prompts, 5, allowed=ACTIONS[:2])
    batch = TrainBatch.from_sequences(sequences(pol, prompts, gens), [1.0, -1.0], pol.pad_token_id)
    pol.train_step(batch, pg_loss)
    pol.save(tmp_path / "ckpt")
    pol.save(tmp_path / "ckpt")  # overwriting an existing checkpoint works and leaves no temp dirs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    expected = pol.logprobs(batch)

    fresh = make_policy(lr=1e-3)
    fresh.load(tmp_path / "ckpt")
    assert fresh.step == 1 and torch.allclose(fresh.logprobs(batch), expected, atol=1e-6)
    assert fresh.optimizer is not None
    exp_state = pol.optimizer.state_dict()["state"]  # type: ignore[union-attr]
    got_state = fresh.optimizer.state_dict()["state"]
    assert torch.equal(exp_state[0]["exp_avg"], got_state[0]["exp_avg"])

    rebuilt = HFPolicy.from_checkpoint(tmp_path / "ckpt")
    assert rebuilt.name == pol.name and rebuilt.step == 1
    assert rebuilt.sampling == pol.sampling and rebuilt.optim == pol.optim
    assert torch.allclose(rebuilt.logprobs(batch), expected, atol=1e-6)
    # Both continue training identically from the restored optimizer state.
    m1, m2 = pol.train_step(batch, pg_loss), rebuilt.train_step(batch, pg_loss)
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    with pytest.raises(FileNotFoundError, match="not a policy checkpoint"):
        fresh.load(tmp_path)


def test_from_pretrained_local_dir_with_thinking_flag(tmp_path: Path, policy: HFPolicy) -> None:
    # The real-model code path (AutoTokenizer/AutoModelForCausalLM) on a local directory.
    policy.model.save_pretrained(tmp_path)
    policy.tokenizer.save_pretrained(tmp_path)
    loaded = HFPolicy.from_pretrained(tmp_path, dtype="float32", enable_thinking=False)
    assert loaded.chat.chat_kwargs == {"enable_thinking": False} and loaded.name == str(tmp_path)
    prompt = loaded.apply_chat([{"role": "user", "content": "hi"}])
    assert prompt == policy.apply_chat([{"role": "user", "content": "hi"}])
    assert torch.equal(loaded.model(torch.tensor([prompt])).logits, policy.model(torch.tensor([prompt])).logits)
    # auto computes in bf16 on CUDA and on a CPU with bf16 units (tests/test_precision.py), float32 on others
    from crl_train.policy.precision import cpu_bf16_supported

    cpu_auto = torch.bfloat16 if cpu_bf16_supported() else torch.float32
    assert resolve_dtype("auto", "cpu") == cpu_auto and resolve_dtype("auto", "cuda:0") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float99", "cpu")


class FakeGenerator:
    def __init__(self) -> None:
        self.synced: list[int] = []
        self.calls = 0

    def sync_weights(self, named: Any) -> int:
        self.synced.append(len(list(named)))
        return self.synced[-1]

    def generate(self, prompts: Any, max_new_tokens: int, allowed: Any = None, *, sampling: Any = None) -> list[Any]:
        self.calls += 1
        return []


def test_attached_generator_serves_free_text_and_gets_weights() -> None:
    pol = make_policy(lr=1e-3)
    gen = FakeGenerator()
    pol.attach_generator(gen)
    assert len(gen.synced) == 1 and gen.synced[0] == len(pol.model.state_dict())
    prompts = prompts_for(pol)[:2]
    assert pol.generate(prompts, 4) == [] and gen.calls == 1
    constrained = pol.generate(prompts, 6, allowed=[["wait"], ["go north"]])  # stays on the hf path
    assert [g.text for g in constrained] == ["wait", "go north"] and gen.calls == 1
    batch = TrainBatch.from_sequences(sequences(pol, prompts, constrained), [1.0, -1.0], pol.pad_token_id)
    pol.train_step(batch, pg_loss)
    assert len(gen.synced) == 2


def test_stop_cut_takes_the_earliest_end() -> None:
    from crl_train.policy.generate import _stop_cut

    # "</a>" ends at index 9, "go" ends at index 4: the earlier end wins.
    assert _stop_cut("x go <x></a>", ("</a>", "go")) == "x go"
    assert _stop_cut("nothing", ("</a>",)) is None


# ---------------------------------------------------------------- loss scaling per train_step
def _scaling_batch(pol: HFPolicy) -> TrainBatch:
    """4 sequences of different lengths (so micro-batches differ in token counts), with every
    batch tensor a registered loss may read: weights (summing to 1), teacher, group/condition ids."""
    prompts = prompts_for(pol)
    gens = pol.generate(prompts, 6, allowed=[ACTIONS[0], None, ACTIONS[2], None])  # no forced (zero-grad) action
    seqs = sequences(pol, prompts, gens)
    batch = TrainBatch.from_sequences(seqs, [1.0, -0.5, 2.0, 0.3], pol.pad_token_id, group_ids=[0, 0, 1, 1],
                                      condition_ids=[0, 1, 0, 1], extra={"weights": [0.1, 0.2, 0.3, 0.4]})
    g = torch.Generator().manual_seed(0)
    m = batch.loss_mask
    batch.old_logprobs = batch.old_logprobs + 0.1 * torch.randn(m.shape, generator=g) * m
    batch.extra["teacher"] = (batch.old_logprobs - torch.rand(m.shape, generator=g)) * m
    ids, lp = pol.support_logprobs(batch, k=4)  # the student's top-4 under the weights every delta starts from
    batch.extra["support_ids"] = ids
    batch.extra["teacher_support"] = lp - torch.rand(lp.shape, generator=g)
    assert len(set(m.sum(1).tolist())) > 1  # unequal token counts: a per-micro-batch mean is not the batch mean
    return batch


def _sgd_delta(pol: HFPolicy, init: dict[str, torch.Tensor], batch: TrainBatch, mbs: int, loss_fn: Any,
               **kw: Any) -> torch.Tensor:
    """Weights after one plain SGD step (lr 1, no clip) minus the weights before: −(accumulated grad)."""
    pol.model.load_state_dict(init)
    pol.optim = OptimConfig(micro_batch_size=mbs, loss_scale="none", grad_clip=0.0)  # the actor's default
    params = [p for p in pol.model.parameters() if p.requires_grad]
    pol.optimizer = torch.optim.SGD(params, lr=1.0)
    out = pol.train_step(batch, loss_fn, **kw)
    assert out["skipped"] == 0.0
    return torch.cat([(p.detach() - init[n]).flatten() for n, p in pol.model.named_parameters()])


HYPER: dict[str, dict[str, Any]] = {
    "clip": {"clip_eps": 0.2, "ratio_level": "sequence"},
    "cispo": {"eps_low": 0.1, "eps_high": 0.1},
    "cispo_sequences": {"eps_low": 0.1, "eps_high": 0.1},
    "reverse_kl_sampled": {"coef": 1.0},
    "reverse_kl_topk": {"coef": 1.0},
    "self_distill_nll": {"coef": 0.5},
}


@pytest.mark.parametrize("name", ["reverse_kl_sampled", "reverse_kl_topk", "self_distill_nll"])
def test_token_mean_losses_are_micro_batch_invariant_on_the_actor(name: str) -> None:
    # the actor's policy defaults to loss_scale="none"; a token-mean loss says "tokens" for its call,
    # and the update is then the same for micro-batches of 1, 2 and the full batch of 4
    from crl_train.algorithms import LOSSES

    pol = make_policy()
    batch = _scaling_batch(pol)
    init = {k: v.detach().clone() for k, v in pol.model.state_dict().items()}
    deltas = [_sgd_delta(pol, init, batch, mbs, LOSSES.get(name), loss_scale="tokens", **HYPER[name]) for mbs in (4, 2, 1)]
    assert deltas[0].abs().sum() > 0
    for d in deltas[1:]:
        assert torch.allclose(d, deltas[0], atol=1e-6, rtol=1e-4)


def test_none_scale_sums_micro_batch_means_and_tokens_weights_them_by_hand() -> None:
    # The old behaviour: under the actor's "none", micro-batches of one sequence add up each
    # sequence's own token mean, Σ_b g_b, while the full batch gives the token mean Σ_b (n_b/N) g_b.
    from crl_train.algorithms import LOSSES

    pol = make_policy()
    batch = _scaling_batch(pol)
    init = {k: v.detach().clone() for k, v in pol.model.state_dict().items()}
    fn = LOSSES.get("reverse_kl_sampled")
    n = batch.loss_mask.sum(1)
    per_seq = [_sgd_delta(pol, init, batch.select(slice(b, b + 1)), 1, fn) for b in range(4)]  # −g_b
    full = _sgd_delta(pol, init, batch, 4, fn)
    assert torch.allclose(full, sum(float(n[b] / n.sum()) * per_seq[b] for b in range(4)), atol=1e-6, rtol=1e-4)
    old = _sgd_delta(pol, init, batch, 1, fn)  # no loss_scale: the policy's "none"
    assert torch.allclose(old, sum(per_seq), atol=1e-6, rtol=1e-4)
    assert not torch.allclose(old, full, atol=1e-6, rtol=1e-2)
    assert torch.allclose(_sgd_delta(pol, init, batch, 1, fn, loss_scale="tokens"), full, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("name", ["clip", "cispo", "cispo_sequences", "reverse_kl_sampled", "reverse_kl_topk", "self_distill_nll"])
def test_every_registered_loss_trains_through_train_step_by_name(name: str) -> None:
    # the trainer's call: train_step(batch, LOSSES.get(name), loss_scale=loss_scale_for(name), **hyper);
    # the loss gets group/condition ids, weights and teacher whether it reads them or not
    from crl_train.algorithms import LOSSES, loss_scale_for

    assert sorted(n.value for n in LOSSES.names()) == sorted(HYPER)
    pol = make_policy()
    batch = _scaling_batch(pol)
    init = {k: v.detach().clone() for k, v in pol.model.state_dict().items()}
    deltas = [_sgd_delta(pol, init, batch, mbs, LOSSES.get(name), loss_scale=loss_scale_for(name), **HYPER[name])
              for mbs in (4, 3, 1)]
    assert bool(torch.isfinite(deltas[0]).all()) and deltas[0].abs().sum() > 0
    for d in deltas[1:]:
        assert torch.allclose(d, deltas[0], atol=1e-6, rtol=1e-4)


def _objective_delta(pol: HFPolicy, init: dict[str, torch.Tensor], terms: list[LossTerm], mbs: int) -> torch.Tensor:
    """Weights after one plain SGD step (lr 1, no clip) on the sum of ``terms``, minus the weights before."""
    pol.model.load_state_dict(init)
    pol.optim = OptimConfig(micro_batch_size=mbs, loss_scale="none", grad_clip=0.0)
    pol.optimizer = torch.optim.SGD([p for p in pol.model.parameters() if p.requires_grad], lr=1.0)
    out = pol.train_objective(terms)
    assert out["skipped"] == 0.0
    return torch.cat([(p.detach() - init[n]).flatten() for n, p in pol.model.named_parameters()])


def test_a_joint_objective_is_one_step_on_the_sum_of_its_terms() -> None:
    # EDGE's objective: the RL loss and λ · the top-k reverse KL in one update. Under SGD the step on
    # the sum is the sum of the steps on each term from the same weights, for any micro-batch size.
    from crl_train.algorithms import LOSSES, loss_scale_for

    pol = make_policy()
    batch = _scaling_batch(pol)
    init = {k: v.detach().clone() for k, v in pol.model.state_dict().items()}

    def term(name: str, coef: float | None = None) -> LossTerm:
        kw = dict(HYPER[name]) if coef is None else {**HYPER[name], "coef": coef}
        return LossTerm(batch, LOSSES.get(name), loss_scale_for(name), kw, name=name)

    rl, kl = term("clip"), term("reverse_kl_topk", coef=0.1)
    each = _objective_delta(pol, init, [rl], 4) + _objective_delta(pol, init, [kl], 4)
    for mbs in (4, 1):
        joint = _objective_delta(pol, init, [rl, kl], mbs)
        assert torch.allclose(joint, each, atol=1e-6, rtol=1e-4)
    assert not torch.allclose(each, _objective_delta(pol, init, [rl], 4), atol=1e-6, rtol=1e-3)  # the KL term counts
    pol.model.load_state_dict(init)
    pol.optimizer, before = None, pol.step
    m = pol.train_objective([rl, kl])
    assert pol.step == before + 1 and {"loss_clip", "loss_reverse_kl_topk", "edge_kl", "clip_frac"} <= set(m)
    assert m["loss"] == pytest.approx(m["loss_clip"] + m["loss_reverse_kl_topk"])
    assert m["loss_reverse_kl_topk"] == pytest.approx(0.1 * m["edge_kl"], rel=1e-5)


def test_a_joint_objective_skips_empty_terms_and_an_empty_objective() -> None:
    from crl_train.algorithms import LOSSES

    pol = make_policy()
    batch = _scaling_batch(pol)
    empty = batch.select(slice(0, 1))
    empty.loss_mask = torch.zeros_like(empty.loss_mask)
    fn = LOSSES.get("self_distill_nll")
    out = pol.train_objective([LossTerm(empty, fn, "tokens", name="a"), LossTerm(batch, fn, "tokens", name="b")])
    assert out["skipped"] == 0.0 and "loss_a" not in out and out["num_tokens"] == batch.num_tokens
    assert pol.train_objective([LossTerm(empty, fn, "tokens")])["skipped"] == 1.0 and pol.skipped_steps == 1


def test_support_logprobs_are_aligned_like_logprobs_and_the_top_k_is_the_policy_s() -> None:
    pol = make_policy()
    prompts = prompts_for(pol)
    gens = pol.generate(prompts, 5, allowed=[None, None, None, None])
    batch = TrainBatch.from_sequences(sequences(pol, prompts, gens), [0.0] * 4, pol.pad_token_id)
    own, own_lp = pol.support_logprobs(batch, ids=batch.input_ids[..., None])  # each position's actual token
    assert torch.equal(own[:, 1:, 0], (batch.input_ids * batch.attention_mask)[:, 1:]) and not own[:, 0].any()
    read = batch.loss_mask.bool()  # logprobs() runs training's forward: it may skip the shared prompt prefix
    assert torch.allclose(own_lp[..., 0][read], pol.logprobs(batch)[read], atol=1e-5)
    ids, lp = pol.support_logprobs(batch, k=3)
    assert ids.shape == (*batch.input_ids.shape, 3) and bool((lp[:, 1:].diff(dim=-1) <= 1e-6).all())
    _, every = pol.support_logprobs(batch, k=10**9)  # k clamped to the vocabulary: the whole distribution
    assert every.shape[-1] == pol.model.config.vocab_size
    assert torch.allclose(lp, every[..., :3], atol=1e-6)  # the 3 most likely tokens, most likely first
    real = batch.attention_mask.bool()
    real[:, 0] = False
    assert torch.allclose(every[real].exp().sum(-1), torch.ones(int(real.sum())), atol=1e-4)
    assert float(lp[:, 0].abs().sum()) == 0.0 and float(lp[~batch.attention_mask.bool()].abs().sum()) == 0.0
    with pytest.raises(ValueError, match="not both or neither"):
        pol.support_logprobs(batch)


def test_train_step_rejects_an_unknown_loss_scale() -> None:
    pol = make_policy()
    batch = _scaling_batch(pol)
    with pytest.raises(ValueError, match="loss_scale must be one of"):
        pol.train_step(batch, pg_loss, loss_scale="mean")  # type: ignore[arg-type]
    assert pol.step == 0 and pol.skipped_steps == 0


def test_train_step_signature_matches_the_protocol() -> None:
    import inspect

    for fn in (Policy.train_step, HFPolicy.train_step, HFPolicy.accumulate_gradients):
        params = inspect.signature(fn).parameters
        assert list(params)[:3] == ["self", "batch", "loss_fn"]
        assert params["loss_scale"].kind is inspect.Parameter.KEYWORD_ONLY and params["loss_scale"].default is None
        assert next(reversed(params.values())).kind is inspect.Parameter.VAR_KEYWORD
