"""What a method is: the :class:`Method` protocol, and :class:`MethodBase` with the shared defaults.

A method has two sides. The **actor side** is called by the trainer's loop at fixed points —
advantages, which episodes train, extra terms of the actor's objective (EDGE's distillation,
self-distillation; added to the RL loss of the same update) and an extra reward for the entries (the
actor-critic gate). The **service side** is a :class:`~crl_train.service.ServiceOptions`: what the
experience service does with the episodes (distil or not, train the extractor or not, EDGE's utility
and pruning). The trainer and the builder only call these; they never look at a method's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

import torch

from crl_gym.json_types import JSONDict
from crl_gym.protocol import FREE_CONDITION, GUIDED_CONDITION
from crl_train.algorithms import (
    ADVANTAGES,
    LOSSES,
    AdvantageEstimator,
    AdvantageParams,
    CoefParams,
    LossParams,
    PolicyLoss,
    perplexity_bonus,
)
from crl_train.config import TrainConfig
from crl_train.config.names import MethodName, PerplexityTransform
from crl_train.methods.gate import VERDICTS, ActorCriticGate
from crl_train.policy.base import Policy, TrainBatch
from crl_train.rollout.contract import Outcomes, Rollout
from crl_train.rollout.runner import EntryGate, Episode, swap_prompt
from crl_train.service import ServiceOptions, service_options

SELF_DISTILL_FIELDS: tuple[str, ...] = ("self_distill_samples", "self_distill_nll")
"""Metrics-row keys of ``algo.self_distill`` (guided methods that train the actor)."""
GATE_FIELDS: tuple[str, ...] = (
    "gate_judged",
    "gate_accept",
    "gate_refine",
    "gate_reject",
    "gate_warmup",
    "gate_latency_s",
)
"""Metrics-row keys of ``algo.gate``: episodes judged, share of each verdict, seconds of the gate
per episode."""


@dataclass
class ActorTerm:
    """One more term of the actor's objective, added to the RL loss of the same optimizer step
    (EDGE's joint objective), with a loss looked up by name in ``LOSSES`` (micro-batch losses add up
    as that loss says: ``loss_scale_for``) and its hyper-parameters, of the class registered
    with it."""

    batch: TrainBatch
    loss: PolicyLoss
    params: LossParams
    """The loss's hyper-parameters (e.g. ``CoefParams(coef)``); ``TypeError`` for another loss's."""
    metrics: dict[str, str] = field(default_factory=dict)
    """Row key → key of the train step's metrics."""

    def __post_init__(self) -> None:
        LOSSES.check_params(self.loss, self.params)


@runtime_checkable
class Method(Protocol):
    """A training method (see the module docstring)."""

    @property
    def name(self) -> MethodName: ...

    @property
    def guided(self) -> bool:
        """Half of each rollout group sees a retrieved entry (the other half runs free)."""
        ...

    @property
    def trains_actor(self) -> bool:
        """The actor is updated (False: a frozen actor, ``exp_only``)."""
        ...

    def service_options(self) -> ServiceOptions:
        """The extractor side: what the experience service does with this method's episodes."""
        ...

    def advantages(self, outcomes: Outcomes) -> torch.Tensor:
        """``[N]`` advantages of the RL update."""
        ...

    def train_mask(self, outcomes: Outcomes) -> torch.Tensor:
        """``[N]`` bool: the episodes the RL update trains on."""
        ...

    def extra_terms(self, rollout: Rollout, actor: Policy) -> tuple[list[ActorTerm], JSONDict]:
        """More terms of the actor's objective (computed under the weights about to be updated, and
        added to the RL loss of the same step), and the metrics computed on the way."""
        ...

    def entry_bonus(self, rollout: Rollout, actor: Policy) -> dict[str, float]:
        """Extra reward per ``request_id`` for the entry that episode used (added to r(m))."""
        ...

    def entry_gate(self, actor: Policy) -> EntryGate | None:
        """What judges each guided episode's entry before it starts (the actor-critic gate),
        or None."""
        ...

    def metric_fields(self) -> tuple[str, ...]:
        """The metrics-row keys this method adds with this config (a subset of its class's
        ``declared_fields``)."""
        ...

    @property
    def service_metrics(self) -> dict[str, str]:
        """Row keys of :meth:`metric_fields` read from the service's ``stats()``: row key →
        stats key."""
        ...


class MethodBase:
    """Defaults shared by the methods: the registered advantage estimator, every valid episode
    trains, and the paper's optional components for guided methods — self-distillation
    (``algo.self_distill``), the actor-critic gate (``algo.gate``) and the perplexity bonus
    (``algo.perplexity``)."""

    name: ClassVar[MethodName]
    guided: ClassVar[bool] = True
    trains_actor: ClassVar[bool] = True
    advantage: ClassVar[AdvantageEstimator] = AdvantageEstimator.SPLIT_SUBGROUP
    service_metrics: ClassVar[dict[str, str]] = {}
    declared_fields: ClassVar[tuple[str, ...]] = (*GATE_FIELDS, *SELF_DISTILL_FIELDS)
    """Every metrics-row key this method may add (the declaration the run's outputs collect from
    :data:`~crl_train.methods.METHODS`); :meth:`metric_fields` picks those of one config."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.check_config(cfg)
        self.cfg = cfg
        self.algo = cfg.algo

    @classmethod
    def check_config(cls, cfg: TrainConfig) -> None:
        """Raise :class:`~crl_train.config.ConfigError` when ``cfg`` lacks what this method needs
        (the config itself checks only what holds for every method)."""
        del cfg

    # ---------------------------------------------------------------- service side
    def service_options(self) -> ServiceOptions:
        return service_options(self.cfg)

    # ---------------------------------------------------------------- actor side
    def advantage_params(self) -> AdvantageParams:
        return AdvantageParams(eps=self.algo.adv_eps, unbiased=self.algo.std_unbiased)

    def advantages(self, outcomes: Outcomes) -> torch.Tensor:
        estimator = ADVANTAGES.get(self.advantage)
        condition = outcomes.condition if self.guided else None
        adv: torch.Tensor = estimator(
            outcomes.reward,
            outcomes.group,
            condition,
            valid=outcomes.valid,
            **self.advantage_params().kwargs(),
        )
        return adv

    def train_mask(self, outcomes: Outcomes) -> torch.Tensor:
        return outcomes.valid.clone()

    def extra_terms(self, rollout: Rollout, actor: Policy) -> tuple[list[ActorTerm], JSONDict]:
        metrics = gate_metrics(rollout) if self._gate_on() else {}
        if not self._self_distill_on():
            return [], metrics
        updates, sd = self_distillation(rollout, actor, self.algo.self_distill_coef)
        return updates, {**metrics, **sd}

    def entry_bonus(self, rollout: Rollout, actor: Policy) -> dict[str, float]:
        p = self.algo.perplexity
        if not self.guided or p.transform == "off":
            return {}
        return perplexity_bonuses(
            rollout,
            transform=p.transform,
            weight=p.weight,
            temperature=p.temperature,
            clip=p.clip,
            clip_negative=p.clip_negative,
        )

    def entry_gate(self, actor: Policy) -> EntryGate | None:
        if not self._gate_on():
            return None
        gate = self.algo.gate
        return ActorCriticGate(
            actor, warmup_steps=gate.warmup_steps, rewrite_tokens=gate.rewrite_tokens
        )

    def metric_fields(self) -> tuple[str, ...]:
        return (GATE_FIELDS if self._gate_on() else ()) + (
            SELF_DISTILL_FIELDS if self._self_distill_on() else ()
        )

    def _gate_on(self) -> bool:
        return bool(self.algo.gate.enabled and self.guided)

    def _self_distill_on(self) -> bool:
        return bool(self.algo.self_distill and self.guided and self.trains_actor)


def self_distillation(
    rollout: Rollout, actor: Policy, coef: float
) -> tuple[list[ActorTerm], JSONDict]:
    """Winning guided trajectories (success above the free mean of their group), experience and
    search_and_ask turns stripped, as an NLL term (the paper's appendix)."""
    eps = rollout.episodes
    seqs = []
    for e, ok in zip(eps, rollout.valid.tolist(), strict=True):
        if e.condition != GUIDED_CONDITION or not ok or not e.success:
            continue
        free = [
            x
            for x, v in zip(eps, rollout.valid.tolist(), strict=True)
            if v and x.group == e.group and x.condition == FREE_CONDITION
        ]
        free_mean = sum(1.0 if x.success else 0.0 for x in free) / max(1, len(free))
        prompt = next((x.prompt_ids for x in free if x.prompt_ids), None)
        if prompt is not None and 1.0 > free_mean:
            seqs.append(swap_prompt(e, prompt, drop_search_turns=True))
    if not seqs:
        return [], {"self_distill_samples": 0}
    batch = TrainBatch.from_sequences(seqs, [0.0] * len(seqs), actor.pad_token_id)
    term = ActorTerm(
        batch,
        PolicyLoss.SELF_DISTILL_NLL,
        CoefParams(coef),
        {"self_distill_nll": "self_distill_nll"},
    )
    return [term], {"self_distill_samples": len(seqs)}


def gate_metrics(rollout: Rollout) -> JSONDict:
    """Share of each verdict among the judged guided episodes, and the gate's seconds
    per episode."""
    judged = [e for e in rollout.episodes if "gate" in e.info]
    if not judged:
        return {"gate_judged": 0}
    out: JSONDict = {
        f"gate_{v}": sum(e.info["gate"] == v for e in judged) / len(judged) for v in VERDICTS
    }
    out["gate_judged"] = len(judged)
    out["gate_latency_s"] = sum(float(e.info.get("gate_s", 0.0)) for e in judged) / len(judged)
    return out


def perplexity_bonuses(
    rollout: Rollout,
    *,
    transform: PerplexityTransform,
    weight: float,
    temperature: float,
    clip: float,
    clip_negative: float,
) -> dict[str, float]:
    """b = w·f(ΔH(m)) per guided request. The actor's entropy is estimated from its own sampled
    tokens (mean per-token −log π of what it generated): H(π_θ | q) over the group's free episodes,
    H(π_θ | q, m) over the guided episode, so ΔH(m) = H_free − H_guided needs no extra
    forward pass."""

    def nll(e: Episode) -> float | None:
        seq = e.sequence
        lps = [lp for lp, m in zip(seq.old_logprobs, seq.loss_mask, strict=True) if m]
        return -sum(lps) / len(lps) if lps else None

    valid = rollout.valid.tolist()
    free_h: dict[int, list[float]] = {}
    for e, ok in zip(rollout.episodes, valid, strict=True):
        if ok and e.condition == FREE_CONDITION and (h := nll(e)) is not None:
            free_h.setdefault(e.group, []).append(h)
    ids, delta, h_without = [], [], []
    for e, ok in zip(rollout.episodes, valid, strict=True):
        h = (
            nll(e)
            if ok
            and e.condition == GUIDED_CONDITION
            and e.experience is not None
            and e.request is not None
            else None
        )
        if h is None or e.group not in free_h or e.request is None:
            continue
        base = sum(free_h[e.group]) / len(free_h[e.group])
        ids.append(e.request.request_id)
        delta.append(base - h)
        h_without.append(base)
    if not ids:
        return {}
    b = perplexity_bonus(
        torch.tensor(delta),
        torch.tensor(h_without),
        transform=transform,
        weight=weight,
        temperature=temperature,
        clip=clip,
        clip_negative=clip_negative,
    )
    return dict(zip(ids, b.tolist(), strict=True))
