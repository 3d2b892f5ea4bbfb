"""What a method is: the :class:`Method` protocol, and :class:`MethodBase` with the shared defaults.

A method has two sides. The **actor side** is called by the trainer's loop at fixed points —
advantages, which episodes train, extra actor updates (EDGE's distillation, self-distillation)
and an extra reward for the entries (the actor-critic gate). The **service side** is a
:class:`~crl_train.service.ServiceOptions`: what the experience service does with the episodes
(distil or not, train the extractor or not, EDGE's utility and pruning). The trainer and the
builder only call these; they never look at a method's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from crl_gym.templates import GATE_TEMPLATE
from crl_train.algorithms import (
    ADVANTAGES,
    FREE,
    GATE_SCORES,
    GUIDED,
    AdvantageEstimator,
    PolicyLoss,
)
from crl_train.config import TrainConfig
from crl_train.config.names import MethodName
from crl_train.policy.base import Policy, TrainBatch
from crl_train.rollout.runner import Episode, swap_prompt
from crl_train.service import ServiceOptions, service_options

SELF_DISTILL_FIELDS: tuple[str, ...] = ("self_distill_samples", "self_distill_nll")
"""Metrics-row keys of ``algo.self_distill`` (guided methods that train the actor)."""


@dataclass
class Rollout:
    """One rollout step's episodes, with the tensors every method reads.

    Shapes: ``N`` episodes. ``reward[N]`` is 1.0 on success else 0.0 (the paper's R ∈ {0, 1});
    ``group[N]`` the task group, ``condition[N]`` GUIDED / FREE, ``valid[N]`` False for episodes
    that ended because the env raised (the agent's tokens were not at fault: they are never
    trained on and never enter a mean, a std or a gain).
    """

    episodes: list[Episode]
    reward: torch.Tensor
    group: torch.Tensor
    condition: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def of(cls, episodes: list[Episode]) -> Rollout:
        return cls(episodes,
                   torch.tensor([1.0 if e.success else 0.0 for e in episodes]),
                   torch.tensor([e.group for e in episodes]),
                   torch.tensor([GUIDED if e.condition == "guided" else FREE for e in episodes]),
                   torch.tensor([not e.failed_by_error for e in episodes], dtype=torch.bool))


@dataclass
class ActorUpdate:
    """One more actor ``train_step`` a method asks for, with a loss looked up by name in ``LOSSES``
    (micro-batch losses add up as that loss says: ``loss_scale_for``)."""

    batch: TrainBatch
    loss: PolicyLoss
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the loss (e.g. ``coef``)."""
    metrics: dict[str, str] = field(default_factory=dict)
    """Row key → key of the train step's metrics."""


@runtime_checkable
class Method(Protocol):
    """A training method (see the module docstring)."""

    @property
    def name(self) -> MethodName:
        ...

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

    def advantages(self, rollout: Rollout) -> torch.Tensor:
        """``[N]`` advantages of the RL update."""
        ...

    def train_mask(self, rollout: Rollout) -> torch.Tensor:
        """``[N]`` bool: the episodes the RL update trains on."""
        ...

    def extra_updates(self, rollout: Rollout, actor: Policy) -> tuple[list[ActorUpdate], dict[str, Any]]:
        """More actor updates after the RL one, and the metrics computed on the way."""
        ...

    def entry_bonus(self, rollout: Rollout, actor: Policy) -> dict[str, float]:
        """Extra reward per ``request_id`` for the entry that episode used (added to r(m))."""
        ...

    def metric_fields(self) -> tuple[str, ...]:
        """The metrics-row keys this method adds (declared in ``crl_train.run.outputs``)."""
        ...

    @property
    def service_metrics(self) -> dict[str, str]:
        """Row keys of :meth:`metric_fields` read from the service's ``stats()``: row key → stats key."""
        ...


class MethodBase:
    """Defaults shared by the methods: the registered advantage estimator, every valid episode
    trains, and the paper's optional components for guided methods — self-distillation
    (``algo.self_distill``) and the actor-critic gate (``algo.gate``)."""

    name: ClassVar[MethodName]
    guided: ClassVar[bool] = True
    trains_actor: ClassVar[bool] = True
    advantage: ClassVar[AdvantageEstimator] = AdvantageEstimator.SPLIT_SUBGROUP
    service_metrics: ClassVar[dict[str, str]] = {}

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.algo = cfg.algo

    # ---------------------------------------------------------------- service side
    def service_options(self) -> ServiceOptions:
        return service_options(self.cfg)

    # ---------------------------------------------------------------- actor side
    def advantage_kwargs(self) -> dict[str, Any]:
        return {"eps": self.algo.adv_eps, "unbiased": self.algo.std_unbiased}

    def advantages(self, rollout: Rollout) -> torch.Tensor:
        estimator = ADVANTAGES.get(self.advantage)
        condition = rollout.condition if self.guided else None
        adv: torch.Tensor = estimator(rollout.reward, rollout.group, condition, valid=rollout.valid,
                                      **self.advantage_kwargs())
        return adv

    def train_mask(self, rollout: Rollout) -> torch.Tensor:
        return rollout.valid.clone()

    def extra_updates(self, rollout: Rollout, actor: Policy) -> tuple[list[ActorUpdate], dict[str, Any]]:
        if not self._self_distill_on():
            return [], {}
        return self_distillation(rollout, actor, self.algo.self_distill_coef)

    def entry_bonus(self, rollout: Rollout, actor: Policy) -> dict[str, float]:
        if not (self.guided and self.algo.gate):
            return {}
        return gate_scores(rollout, actor)

    def metric_fields(self) -> tuple[str, ...]:
        return SELF_DISTILL_FIELDS if self._self_distill_on() else ()

    def _self_distill_on(self) -> bool:
        return bool(self.algo.self_distill and self.guided and self.trains_actor)


def self_distillation(rollout: Rollout, actor: Policy, coef: float) -> tuple[list[ActorUpdate], dict[str, Any]]:
    """Winning guided trajectories (success above the free mean of their group), experience and
    search_and_ask turns stripped, as an NLL update (the paper's appendix)."""
    eps = rollout.episodes
    seqs = []
    for e, ok in zip(eps, rollout.valid.tolist(), strict=True):
        if e.condition != "guided" or not ok or not e.success:
            continue
        free = [x for x, v in zip(eps, rollout.valid.tolist(), strict=True) if v and x.group == e.group and x.condition == "free"]
        free_mean = sum(1.0 if x.success else 0.0 for x in free) / max(1, len(free))
        prompt = next((x.prompt_ids for x in free if x.prompt_ids), None)
        if prompt is not None and 1.0 > free_mean:
            seqs.append(swap_prompt(e, prompt, drop_search_turns=True))
    if not seqs:
        return [], {"self_distill_samples": 0}
    batch = TrainBatch.from_sequences(seqs, [0.0] * len(seqs), actor.pad_token_id)
    update = ActorUpdate(batch, PolicyLoss.SELF_DISTILL_NLL, {"coef": coef}, {"self_distill_nll": "self_distill_nll"})
    return [update], {"self_distill_samples": len(seqs)}


def gate_scores(rollout: Rollout, actor: Policy) -> dict[str, float]:
    """Actor-critic gate: the actor rates each guided episode's entry accept / refine / reject."""
    guided = [e for e, ok in zip(rollout.episodes, rollout.valid.tolist(), strict=True)
              if ok and e.experience is not None and e.request is not None]
    if not guided:
        return {}
    prompts = [actor.apply_chat([{"role": "user", "content": GATE_TEMPLATE.format(
        task=e.task, experience=e.experience.text if e.experience is not None else "")}]) for e in guided]
    with torch.no_grad():
        gens = actor.generate(prompts, 8, allowed=[list(GATE_SCORES)] * len(guided))
    scores: dict[str, float] = {}
    for e, gen in zip(guided, gens, strict=True):
        verdict = gen.text.strip()
        e.info["gate"] = verdict
        assert e.request is not None
        scores[e.request.request_id] = GATE_SCORES.get(verdict, 0.0)
    return scores
