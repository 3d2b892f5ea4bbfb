"""Clip surrogate, CISPO and reverse-KL losses: values and gradients worked out by hand."""

import doctest
import inspect
import math

import pytest
import torch

from crl_train.algorithms import (
    LOSSES,
    PolicyLoss,
    cispo_loss,
    clip_surrogate_loss,
    loss_scale_for,
    losses,
    reverse_kl_sampled_loss,
    reverse_kl_support_loss,
    reverse_kl_topk_loss,
    self_distill_nll_loss,
)

L = math.log


def _clip_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    lp = torch.tensor([[L(1.5), L(0.9)], [L(0.5), 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(2, 2, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    return lp, old, adv, mask


def test_clip_token_level_by_hand() -> None:
    # seq 0 (A=+1): ratios 1.5, 0.9 -> min(1.5, 1.2)=1.2, min(0.9, 0.9)=0.9 -> mean 1.05
    # seq 1 (A=-1): ratio 0.5 -> min(-0.5, -0.8) = -0.8 (one token)
    # loss = -(0.5 * 1.05 + 0.5 * -0.8) = -0.125 ; clipped tokens 1.5 and 0.5 -> 2/3
    lp, old, adv, mask = _clip_inputs()
    loss, m = clip_surrogate_loss(lp, old, adv, mask, ratio_level="token")
    assert loss.item() == pytest.approx(-0.125)
    assert m["clip_frac"] == pytest.approx(2 / 3)
    loss.backward()
    # only the unclipped token 0.9 carries gradient: -w * A * rho / n_tok = -0.5*1*0.9/2 = -0.225
    assert lp.grad is not None
    assert torch.allclose(lp.grad, torch.tensor([[0.0, -0.225], [0.0, 0.0]], dtype=torch.float64))


def test_clip_sequence_level_by_hand() -> None:
    # seq 0: rho = exp((ln 1.5 + ln 0.9)/2) = sqrt(1.35) = 1.161895 (inside [0.8, 1.2]) -> 1.161895
    # seq 1: rho = 0.5 -> -0.8 ; loss = -(0.5*1.161895 - 0.4) = -0.1809475
    lp, old, adv, mask = _clip_inputs()
    loss, m = clip_surrogate_loss(lp, old, adv, mask, ratio_level="sequence")
    assert loss.item() == pytest.approx(-(0.5 * math.sqrt(1.35) - 0.4))
    assert m["clip_frac"] == pytest.approx(0.5)
    loss.backward()
    # d/d lp[0,t] = -w * A * rho * (1/2) = -0.5 * 1.161895 * 0.5 = -0.2904738 ; seq 1 clipped -> 0
    g = -0.5 * math.sqrt(1.35) * 0.5
    assert lp.grad is not None
    assert torch.allclose(lp.grad, torch.tensor([[g, g], [0.0, 0.0]], dtype=torch.float64))


def test_clip_weights_scale_per_sequence() -> None:
    # weights [1, 0] keep only seq 0: token-level loss = -1.05
    lp, old, adv, mask = _clip_inputs()
    loss, _ = clip_surrogate_loss(lp, old, adv, mask, torch.tensor([1.0, 0.0], dtype=torch.float64))
    assert loss.item() == pytest.approx(-1.05)


def test_clip_masked_tokens_get_no_gradient_and_gradcheck() -> None:
    torch.manual_seed(0)
    lp = (torch.randn(3, 4, dtype=torch.float64) * 0.05).requires_grad_()
    old = torch.randn(3, 4, dtype=torch.float64) * 0.05
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.float64)
    adv = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    for level in ("token", "sequence"):
        assert torch.autograd.gradcheck(lambda x, lv=level: clip_surrogate_loss(x, old, adv, mask, ratio_level=lv)[0], (lp,))
    loss, _ = clip_surrogate_loss(lp, old, adv, mask)
    (g,) = torch.autograd.grad(loss, lp)
    assert torch.all(g[mask == 0] == 0)


def test_cispo_by_hand_value_and_gradient() -> None:
    # ratios: .5/.4 = 1.25 -> 1.1 ; .25/.25 = 1 -> 1 ; .8/.5 = 1.6 -> 1.1 ; 4th token masked
    # sum = 1.1*2*ln.5 + 1*2*ln.25 + 1.1*(-1)*ln.8 = -1.524924 - 2.772589 + 0.245458 = -4.052055
    # loss = -(-4.052055 / 3 tokens) = 1.350685
    lp = torch.tensor([[L(0.5), L(0.25)], [L(0.8), -3.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[L(0.4), L(0.25)], [L(0.5), 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    loss, m = cispo_loss(lp, old, adv, mask)
    want = -(1.1 * 2 * L(0.5) + 2 * L(0.25) - 1.1 * L(0.8)) / 3
    assert loss.item() == pytest.approx(want)
    assert loss.item() == pytest.approx(1.350685, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 3)
    assert m["num_tokens"] == 3.0
    loss.backward()
    # grad = -sg(w) * A / 3: clipped tokens still learn (the point of CISPO vs PPO)
    assert lp.grad is not None
    assert torch.allclose(lp.grad, torch.tensor([[-2.2 / 3, -2 / 3], [1.1 / 3, 0.0]], dtype=torch.float64))


def test_cispo_per_sequence_normalisation_by_hand() -> None:
    # the inputs of test_cispo_by_hand_value_and_gradient; each sample averaged over its own tokens:
    # sample 0: -(1.1*2*ln.5 + 1*2*ln.25) / 2 = 2.148757 ; sample 1: -(1.1*(-1)*ln.8) / 1 = -0.245458
    # loss = (2.148757 - 0.245458) / 2 = 0.951649 (Eq. 3 gives 1.350685: the long sample weighs more there)
    from crl_train.algorithms.losses import cispo_sequences_loss

    lp = torch.tensor([[L(0.5), L(0.25)], [L(0.8), -3.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[L(0.4), L(0.25)], [L(0.5), 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    loss, m = cispo_sequences_loss(lp, old, adv, mask)
    assert loss.item() == pytest.approx((-(1.1 * 2 * L(0.5) + 2 * L(0.25)) / 2 + 1.1 * L(0.8)) / 2)
    assert loss.item() == pytest.approx(0.951649, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 3) and m["num_tokens"] == 3.0
    loss.backward()
    # grad = -sg(w) * A / (|m_i| * B): sample 0's tokens -1.1*2/4, -2/4; sample 1's 1.1/2
    assert lp.grad is not None
    assert torch.allclose(lp.grad, torch.tensor([[-0.55, -0.5], [0.55, 0.0]], dtype=torch.float64))
    # micro-batches of one sample each, scaled by n_mb / B ("samples"), add up to the full batch's loss
    parts = [cispo_sequences_loss(lp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1])[0] * 0.5 for i in range(2)]
    assert sum(p.item() for p in parts) == pytest.approx(loss.item())


def test_cispo_asymmetric_clip() -> None:
    # eps_low=0.5, eps_high=0.1: ratio 0.6 stays 0.6 (>= 0.5); loss = -(0.6 * 1 * ln .3) / 1
    lp = torch.tensor([[L(0.3)]], dtype=torch.float64)
    old = torch.tensor([[L(0.5)]], dtype=torch.float64)
    loss, _ = cispo_loss(lp, old, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64), eps_low=0.5)
    assert loss.item() == pytest.approx(-0.6 * L(0.3))


def test_reverse_kl_topk_by_hand() -> None:
    # p_s = [.75, .25], p_t = [.5, .5]
    # top-1: .75 * (ln .75 - ln .5) = .75 * 0.405465 = 0.304099
    # top-2 (full): 0.304099 + .25 * (ln .25 - ln .5) = 0.304099 - 0.173287 = 0.130812
    s = torch.tensor([[[L(3.0), 0.0]]], dtype=torch.float64, requires_grad=True)
    t = torch.zeros(1, 1, 2, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 1)
    loss1, m = reverse_kl_topk_loss(s, t, mask, top_k=1)
    assert loss1.item() == pytest.approx(0.75 * L(1.5))
    assert m["topk_mass"] == pytest.approx(0.75)
    loss2, _ = reverse_kl_topk_loss(s, t, mask, top_k=2)
    assert loss2.item() == pytest.approx(0.75 * L(1.5) + 0.25 * L(0.5))
    loss2.backward()
    assert t.grad is None or torch.all(t.grad == 0)  # teacher is stop-gradient
    assert s.grad is not None and s.grad.abs().sum() > 0


def test_reverse_kl_gradcheck_and_mask() -> None:
    torch.manual_seed(1)
    s = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    t = torch.randn(2, 3, 5, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: reverse_kl_topk_loss(x, t, mask, top_k=5)[0], (s,))
    # identical distributions -> zero KL
    z, _ = reverse_kl_topk_loss(t.clone(), t, mask, top_k=5)
    assert z.item() == pytest.approx(0.0, abs=1e-12)


def test_reverse_kl_support_is_finite_when_a_masked_position_holds_minus_inf() -> None:
    # position 0: p_s = [.5, .25], p_t = [.25, .25] -> .5 ln 2 + .25 ln 1 = 0.346574
    # position 1 (masked out, padding): the teacher gives -inf; position 2 (masked out): so does the student
    inf = float("inf")
    s = torch.tensor([[[L(0.5), L(0.25)], [L(0.5), L(0.5)], [-inf, L(1.0)]]], dtype=torch.float64, requires_grad=True)
    t = torch.tensor([[[L(0.25), L(0.25)], [-inf, -inf], [L(0.5), -inf]]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    loss, m = reverse_kl_support_loss(None, None, None, mask, support_logprobs=s, teacher_support=t)
    assert loss.item() == pytest.approx(0.5 * L(2.0))
    assert m["edge_kl"] == pytest.approx(0.5 * L(2.0)) and m["topk_mass"] == pytest.approx(0.75)
    loss.backward()
    assert s.grad is not None and torch.isfinite(s.grad).all()
    # d/ds_v of p_v (s_v - t_v) is p_v (s_v - t_v + 1): .5 (ln 2 + 1) and .25 (0 + 1); nothing elsewhere
    assert s.grad[0, 0].tolist() == pytest.approx([0.5 * (L(2.0) + 1), 0.25])
    assert s.grad[0, 1:].abs().sum().item() == 0.0
    # an id the student gives no mass at an unmasked position adds nothing (0 · log 0 = 0)
    s0 = torch.tensor([[[L(1.0), -inf]]], dtype=torch.float64)
    t0 = torch.tensor([[[L(0.5), L(0.5)]]], dtype=torch.float64)
    loss0, _ = reverse_kl_support_loss(None, None, None, torch.ones(1, 1), support_logprobs=s0, teacher_support=t0)
    assert loss0.item() == pytest.approx(L(2.0))


def test_loss_registry_and_shape_errors() -> None:
    assert LOSSES.get(PolicyLoss.CISPO) is cispo_loss
    assert LOSSES.get("clip") is clip_surrogate_loss
    with pytest.raises(ValueError, match="advantages must be"):
        clip_surrogate_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="ratio_level"):
        clip_surrogate_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), ratio_level="word")  # type: ignore[arg-type]


def test_reverse_kl_sampled_by_hand() -> None:
    # Student log-probs of its own 3 tokens (third masked out), teacher's of the same tokens.
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[-1.5, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    unused = torch.zeros(1, 3), torch.zeros(1)  # old_logprobs and advantages: the shared signature
    loss, m = reverse_kl_sampled_loss(lp, *unused, mask, teacher=teacher, coef=2.0)
    # diff = lp - teacher on kept tokens = [0.5, -1.0]; estimate = (0.5 - 1.0) / 2 = -0.25
    assert m["edge_kl"] == pytest.approx(-0.25)
    # surrogate = coef * Σ diff·lp / 2 = 2 * (0.5·(-1) + (-1)·(-2)) / 2 = 1.5
    assert loss.item() == pytest.approx(1.5)
    loss.backward()
    # d/d lp_t = coef · sg(diff_t) / Σmask = [0.5, -1.0, 0] → [0.5, -1.0, 0.0]
    assert lp.grad is not None
    assert lp.grad.flatten().tolist() == pytest.approx([0.5, -1.0, 0.0])


def test_self_distill_nll_by_hand() -> None:
    lp = torch.tensor([[-0.2, -1.0], [-3.0, -0.6]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    loss, m = self_distill_nll_loss(lp, torch.zeros(2, 2), torch.zeros(2), mask, coef=0.5)
    # NLL = (0.2 + 1.0 + 0.6) / 3 = 0.6; loss = 0.5 · 0.6 = 0.3
    assert m["self_distill_nll"] == pytest.approx(0.6)
    assert loss.item() == pytest.approx(0.3)
    loss.backward()
    # d loss / d lp = −coef / 3 on kept tokens
    assert lp.grad is not None
    assert lp.grad.flatten().tolist() == pytest.approx([-1 / 6, -1 / 6, 0.0, -1 / 6])
    with pytest.raises(ValueError, match="share a"):
        self_distill_nll_loss(lp, lp, torch.zeros(2), torch.ones(3))


def test_reverse_kl_sampled_needs_the_teacher() -> None:
    lp, z = torch.zeros(1, 2), torch.zeros(1)
    with pytest.raises(ValueError, match=r"teacher=\[B, T\]"):
        reverse_kl_sampled_loss(lp, lp, z, torch.ones(1, 2))
    with pytest.raises(ValueError, match="share a"):
        reverse_kl_sampled_loss(lp, lp, z, torch.ones(1, 2), teacher=torch.zeros(1, 3))


def _convention_inputs() -> dict[str, torch.Tensor]:
    return {"weights": torch.tensor([0.5, 0.5], dtype=torch.float64), "teacher": torch.full((2, 2), -1.0, dtype=torch.float64),
            "group_ids": torch.tensor([0, 0]), "condition_ids": torch.tensor([0, 1]),
            # what the policy adds for a batch with extra["support_ids"]: the support's log-probs, with grad
            "support_ids": torch.zeros(2, 2, 2, dtype=torch.long),
            "support_logprobs": torch.full((2, 2, 2), -1.0, dtype=torch.float64, requires_grad=True),
            "teacher_support": torch.full((2, 2, 2), -2.0, dtype=torch.float64)}


@pytest.mark.parametrize("name", [n.value for n in LOSSES.names()])
def test_every_registered_loss_takes_the_policy_calling_convention(name: str) -> None:
    # what HFPolicy.train_step passes: 4 positionals + every batch tensor (extra, group/condition
    # ids) whether the loss uses it or not; the loss returns (scalar with grad, float metrics)
    fn = LOSSES.get(name)
    params = list(inspect.signature(fn).parameters.values())
    assert [p.name for p in params[:4]] == ["logprobs", "old_logprobs", "advantages", "mask"]
    assert params[-1].kind is inspect.Parameter.VAR_KEYWORD
    lp, old, adv, mask = _clip_inputs()
    loss, metrics = fn(lp, old, adv, mask, **_convention_inputs())
    assert loss.dim() == 0 and loss.requires_grad and math.isfinite(loss.item())
    assert metrics and all(isinstance(v, float) for v in metrics.values())
    # a misspelt hyper-parameter is not batch context: it raises instead of being ignored
    with pytest.raises(TypeError, match="'coeff'"):
        fn(lp, old, adv, mask, coeff=2.0, **_convention_inputs())
    assert loss_scale_for(name) in ("samples", "tokens", "none")


def test_registered_losses_and_their_scales() -> None:
    # the logits definition of the top-k reverse KL stays outside LOSSES; its support form is in it
    assert sorted(n.value for n in LOSSES.names()) == [
        "cispo", "cispo_sequences", "clip", "reverse_kl_sampled", "reverse_kl_topk", "self_distill_nll"]
    assert {n.value: loss_scale_for(n) for n in LOSSES.names()} == {
        "clip": "none", "cispo": "tokens", "cispo_sequences": "samples", "reverse_kl_sampled": "tokens",
        "reverse_kl_topk": "tokens", "self_distill_nll": "tokens"}
    assert LOSSES.get("reverse_kl_topk") is reverse_kl_support_loss
    assert reverse_kl_topk_loss not in [LOSSES.get(n) for n in LOSSES.names()]
    with pytest.raises(KeyError, match="accepted: clip, cispo"):
        loss_scale_for("reverse_kl_full")


def test_reverse_kl_support_by_hand() -> None:
    # support {a, b}: p_s = (.5, .25), p_t = (.25, .25); .5·ln 2 + .25·ln 1 = 0.346574, λ = 0.1
    s = torch.log(torch.tensor([[[0.5, 0.25]]], dtype=torch.float64)).requires_grad_()
    t = torch.log(torch.tensor([[[0.25, 0.25]]], dtype=torch.float64)).requires_grad_()
    loss, m = reverse_kl_support_loss(None, None, None, torch.ones(1, 1), support_logprobs=s, teacher_support=t,  # type: ignore[arg-type]
                                      coef=0.1, support_ids=torch.zeros(1, 1, 2, dtype=torch.long))
    assert loss.item() == pytest.approx(0.1 * 0.5 * L(2.0)) and m["edge_kl"] == pytest.approx(0.5 * L(2.0))
    assert m["topk_mass"] == pytest.approx(0.75)
    loss.backward()
    assert t.grad is None or torch.all(t.grad == 0)
    # d/d log p_s(v) of p·(log p − log q) = p·(log p − log q + 1), times λ
    assert s.grad is not None
    assert s.grad[0, 0].tolist() == pytest.approx([0.1 * 0.5 * (L(2.0) + 1), 0.1 * 0.25 * (0.0 + 1)])
    with pytest.raises(ValueError, match="needs support_logprobs and teacher_support"):
        reverse_kl_support_loss(None, None, None, torch.ones(1, 1), support_logprobs=s)  # type: ignore[arg-type]


def test_reverse_kl_support_form_equals_the_logits_definition() -> None:
    # with the support = the student's top-k ids, the registered form gives the same value and the
    # same gradient in the student's logits as EDGE's definition on [B, T, V] logits
    torch.manual_seed(3)
    s = torch.randn(2, 4, 7, dtype=torch.float64, requires_grad=True)
    t = torch.randn(2, 4, 7, dtype=torch.float64)
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    ref, ref_m = reverse_kl_topk_loss(s, t, mask, top_k=3)
    (g_ref,) = torch.autograd.grad(ref, s)
    ids = torch.log_softmax(s, -1).topk(3, -1).indices
    sup = torch.log_softmax(s, -1).gather(-1, ids)
    got, got_m = reverse_kl_support_loss(None, None, None, mask, support_logprobs=sup,  # type: ignore[arg-type]
                                         teacher_support=torch.log_softmax(t, -1).gather(-1, ids))
    (g_got,) = torch.autograd.grad(got, s)
    assert got.item() == pytest.approx(ref.item()) and got_m["topk_mass"] == pytest.approx(ref_m["topk_mass"])
    assert torch.allclose(g_got, g_ref)


def test_module_doctests() -> None:
    from crl_train.algorithms import registry

    for module in (losses, registry):
        result = doctest.testmod(module)
        assert result.failed == 0
