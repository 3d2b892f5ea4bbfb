"""EDGE: experience admitted only where it helps, distilled into the actor, pruned where it
does not.

The bank starts empty; new entries within ``algo.edge.dedup_similarity`` of one in the bank are
refused. Actor side: the marginal gain Δe = mean r(guided) − mean r(free) of each group gates its
guided ("teacher") episodes: with Δe > threshold they join a pooled advantage and the RL update, and
the group's free ("student") episodes are distilled towards the same policy with the experience
in context: the reverse KL on the student's own tokens over its top-k (``algo.edge.top_k``; or the
sampled-token estimator, ``algo.edge.kl_estimator: sampled``), weight λ = ``algo.edge.kl_weight``,
added to the RL loss of the same update (EDGE's joint objective). Service
side: each entry's EMA utility follows its groups' Δe, entries below η are pruned, and task
categories whose success rate in a step is below ξ make the extractor reflect on their failed and
successful episodes (up to ``algo.edge.reflection_entries`` new entries per step). Every setting is
in the ``algo.edge`` section (:class:`~crl_train.config.EdgeConfig`).
"""

from __future__ import annotations

import torch

from crl_gym.json_types import JSONDict
from crl_gym.protocol import FREE_CONDITION, GUIDED_CONDITION
from crl_train.algorithms import (
    AdvantageEstimator,
    CoefParams,
    EdgeAdvantageParams,
    PolicyLoss,
    edge_train_mask,
    marginal_gain,
)
from crl_train.config import ConfigError, TrainConfig
from crl_train.config.names import MethodName
from crl_train.methods.base import ActorTerm, MethodBase, Rollout
from crl_train.policy.base import SUPPORT_IDS, Policy, TrainBatch
from crl_train.policy.factory import trains
from crl_train.rollout.contract import Outcomes
from crl_train.rollout.runner import Episode, swap_prompt
from crl_train.service import EdgeReflection, EdgeUtility, ServiceOptions, service_options

EDGE_FIELDS: tuple[str, ...] = (
    "edge_gain_mean",
    "edge_gate_open",
    "edge_pruned",
    "edge_reflections",
    "edge_reflected",
    "edge_refused",
    "edge_kl",
    "edge_topk_mass",
)
"""Metrics-row keys of ``edge``: the gain gate, the service's (entries pruned, reflections run and
the entries they added, new entries refused as near-duplicates) and the distillation term's KL."""


class Edge(MethodBase):
    name = MethodName.EDGE
    advantage = AdvantageEstimator.EDGE_POOLED
    service_metrics = {
        "edge_pruned": "pruned",
        "edge_reflections": "reflections",
        "edge_reflected": "reflected",
        "edge_refused": "refused",
    }
    declared_fields = (*EDGE_FIELDS, *MethodBase.declared_fields)

    @classmethod
    def check_config(cls, cfg: TrainConfig) -> None:
        if not trains(cfg.actor):  # the distillation needs the actor's distribution
            raise ConfigError(
                f"actor.model: {cfg.actor.model!r} is a script without weights; method: edge needs "
                "a model actor"
            )

    def service_options(self) -> ServiceOptions:
        # EDGE's bank starts empty (every entry with utility 0) and grows from the actor's episodes
        e = self.algo.edge
        return service_options(
            self.cfg,
            train=False,
            seed_bank=False,
            dedup_similarity=e.dedup_similarity,
            edge=EdgeUtility(momentum=e.ema, prune_below=e.prune),
            reflection=EdgeReflection(below=e.reflect_below, max_entries=e.reflection_entries),
        )

    def advantage_params(self) -> EdgeAdvantageParams:
        return EdgeAdvantageParams(
            **super().advantage_params().kwargs(), threshold=self.algo.edge.threshold
        )

    def train_mask(self, outcomes: Outcomes) -> torch.Tensor:
        return edge_train_mask(
            outcomes.reward,
            outcomes.group,
            outcomes.condition,
            threshold=self.algo.edge.threshold,
            valid=outcomes.valid,
        )

    def metric_fields(self) -> tuple[str, ...]:
        return EDGE_FIELDS + super().metric_fields()

    def extra_terms(self, rollout: Rollout, actor: Policy) -> tuple[list[ActorTerm], JSONDict]:
        terms, metrics = super().extra_terms(rollout, actor)
        gain = marginal_gain(rollout.reward, rollout.group, rollout.condition, valid=rollout.valid)
        threshold = self.algo.edge.threshold
        metrics.update(
            {
                "edge_gain_mean": float(gain.nanmean()),
                "edge_gate_open": float((gain > threshold).float().mean()),
            }
        )
        groups = sorted(set(rollout.group.tolist()))
        open_groups = {g for g, v in zip(groups, gain.tolist(), strict=True) if v > threshold}
        pairs = distillation_pairs(rollout, open_groups)
        if pairs and self.trains_actor:
            e = self.algo.edge
            top_k = e.top_k if e.kl_estimator == "topk" else None
            terms.append(distillation_term(pairs, actor, e.kl_weight, top_k=top_k))
        return terms, metrics


def distillation_pairs(rollout: Rollout, open_groups: set[int]) -> list[tuple[Episode, list[int]]]:
    """(student, teacher prompt): each valid free episode of an open group, with the prompt of its
    group's first guided episode (the same first observation, with the experience)."""
    valid = rollout.valid.tolist()
    eps = [e for e, ok in zip(rollout.episodes, valid, strict=True) if ok and e.prompt_ids]
    pairs = []
    for g in sorted(open_groups):
        guided = next((e for e in eps if e.group == g and e.condition == GUIDED_CONDITION), None)
        if guided is None:
            continue
        pairs += [
            (e, guided.prompt_ids) for e in eps if e.group == g and e.condition == FREE_CONDITION
        ]
    return pairs


def distillation_term(
    pairs: list[tuple[Episode, list[int]]], actor: Policy, coef: float, *, top_k: int | None = 20
) -> ActorTerm:
    """λ · KL(π(·|student) ‖ sg π(·|teacher prompt)) on the students' own tokens, under the
    current weights.

    ``top_k``: over the student's k most likely tokens at each position (EDGE; the teacher's
    log-probs of the same ids travel as ``teacher_support``); ``None``: the sampled-token estimator
    (one teacher log-prob per token, ``teacher``). The teacher is the same sequence behind the
    guided prompt, so a student position p maps to p − len(student prompt) + len(teacher prompt).
    """
    pad = actor.pad_token_id
    students = [e for e, _ in pairs]
    teachers = [swap_prompt(e, prompt) for e, prompt in pairs]
    sb = TrainBatch.from_sequences([e.sequence for e in students], [0.0] * len(students), pad)
    tb = TrainBatch.from_sequences(teachers, [0.0] * len(students), pad)
    spans = []  # (student start, teacher start, tokens) of each pair's tokens after its prompt
    for (e, prompt), seq in zip(pairs, teachers, strict=True):
        spans.append(
            (
                len(e.prompt_ids),
                len(prompt),
                min(len(e.sequence) - len(e.prompt_ids), len(seq) - len(prompt)),
            )
        )
    if top_k is None:
        with torch.no_grad():
            t_lp = actor.logprobs(tb)
        teacher = torch.zeros_like(sb.old_logprobs)
        for i, (s0, t0, n) in enumerate(spans):
            teacher[i, s0 : s0 + n] = t_lp[i, t0 : t0 + n]
        sb.extra["teacher"] = teacher
        return ActorTerm(
            sb, PolicyLoss.REVERSE_KL_SAMPLED, CoefParams(coef), {"edge_kl": "edge_kl"}
        )
    ids, _ = actor.support_logprobs(
        sb, k=top_k
    )  # the student's top-k: the weights the term is trained under
    t_ids = torch.zeros((tb.batch_size, tb.input_ids.shape[1], ids.shape[-1]), dtype=torch.long)
    for i, (s0, t0, n) in enumerate(spans):
        t_ids[i, t0 : t0 + n] = ids[i, s0 : s0 + n]
    _, t_lp3 = actor.support_logprobs(tb, ids=t_ids)
    teacher_support = torch.zeros(ids.shape, dtype=torch.float32)
    for i, (s0, t0, n) in enumerate(spans):
        teacher_support[i, s0 : s0 + n] = t_lp3[i, t0 : t0 + n]
    sb.extra[SUPPORT_IDS] = ids
    sb.extra["teacher_support"] = teacher_support
    return ActorTerm(
        sb,
        PolicyLoss.REVERSE_KL_TOPK,
        CoefParams(coef),
        {"edge_kl": "edge_kl", "edge_topk_mass": "topk_mass"},
    )
