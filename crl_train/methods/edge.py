"""EDGE: experience admitted only where it helps, distilled into the actor, pruned where it does not.

The bank starts empty; new entries within ``algo.edge_dedup_similarity`` of one in the bank are
refused. Actor side: the marginal gain Δe = mean r(guided) − mean r(free) of each group gates its guided
("teacher") episodes: with Δe > threshold they join a pooled advantage and the RL update, and
the group's free ("student") episodes are distilled towards the same policy with the experience
in context (reverse KL on the student's own tokens, weight λ = ``algo.edge_lambda``). Service
side: each entry's EMA utility follows its groups' Δe, entries below η are pruned, and task
categories whose success rate in a step is below ξ make the extractor reflect on their failed and
successful episodes (up to ``algo.edge_reflection_entries`` new entries per step).
"""

from __future__ import annotations

from typing import Any

import torch

from crl_train.algorithms import AdvantageEstimator, PolicyLoss, edge_train_mask, marginal_gain
from crl_train.config.names import MethodName
from crl_train.methods.base import ActorUpdate, MethodBase, Rollout
from crl_train.policy.base import Policy, TrainBatch
from crl_train.rollout.runner import Episode, swap_prompt
from crl_train.service import EdgeReflection, EdgeUtility, ServiceOptions, service_options

EDGE_FIELDS: tuple[str, ...] = ("edge_gain_mean", "edge_gate_open", "edge_pruned", "edge_reflections",
                                "edge_reflected", "edge_refused", "edge_kl")
"""Metrics-row keys of ``edge`` (the service's, so far: entries pruned, reflections run and the entries they
added, new entries refused as near-duplicates)."""


class Edge(MethodBase):
    name = MethodName.EDGE
    advantage = AdvantageEstimator.EDGE_POOLED
    service_metrics = {"edge_pruned": "pruned", "edge_reflections": "reflections", "edge_reflected": "reflected",
                       "edge_refused": "refused"}

    def service_options(self) -> ServiceOptions:
        # EDGE's bank starts empty (every entry with utility 0) and grows from the actor's episodes
        a = self.algo
        return service_options(self.cfg, train=False, seed_bank=False, dedup_similarity=a.edge_dedup_similarity,
                               edge=EdgeUtility(momentum=a.edge_ema, prune_below=a.edge_prune),
                               reflection=EdgeReflection(below=a.edge_reflect_below, max_entries=a.edge_reflection_entries))

    def advantage_kwargs(self) -> dict[str, Any]:
        return {**super().advantage_kwargs(), "threshold": self.algo.edge_threshold}

    def train_mask(self, rollout: Rollout) -> torch.Tensor:
        return edge_train_mask(rollout.reward, rollout.group, rollout.condition, threshold=self.algo.edge_threshold,
                               valid=rollout.valid)

    def metric_fields(self) -> tuple[str, ...]:
        return EDGE_FIELDS + super().metric_fields()

    def extra_updates(self, rollout: Rollout, actor: Policy) -> tuple[list[ActorUpdate], dict[str, Any]]:
        updates, metrics = super().extra_updates(rollout, actor)
        gain = marginal_gain(rollout.reward, rollout.group, rollout.condition, valid=rollout.valid)
        threshold = self.algo.edge_threshold
        metrics.update({"edge_gain_mean": float(gain.nanmean()), "edge_gate_open": float((gain > threshold).float().mean())})
        groups = sorted(set(rollout.group.tolist()))
        open_groups = {g for g, v in zip(groups, gain.tolist(), strict=True) if v > threshold}
        pairs = distillation_pairs(rollout, open_groups)
        if pairs and self.trains_actor:
            updates.append(distillation_update(pairs, actor, self.algo.edge_lambda))
        return updates, metrics


def distillation_pairs(rollout: Rollout, open_groups: set[int]) -> list[tuple[Episode, list[int]]]:
    """(student, teacher prompt): each valid free episode of an open group, with the prompt of its
    group's first guided episode (the same first observation, with the experience)."""
    valid = rollout.valid.tolist()
    eps = [e for e, ok in zip(rollout.episodes, valid, strict=True) if ok and e.prompt_ids]
    pairs = []
    for g in sorted(open_groups):
        guided = next((e for e in eps if e.group == g and e.condition == "guided"), None)
        if guided is None:
            continue
        pairs += [(e, guided.prompt_ids) for e in eps if e.group == g and e.condition == "free"]
    return pairs


def distillation_update(pairs: list[tuple[Episode, list[int]]], actor: Policy, coef: float) -> ActorUpdate:
    """Reverse KL on the students' own tokens towards sg(the same policy with the experience in context)."""
    pad = actor.pad_token_id
    students = [e for e, _ in pairs]
    teachers = [swap_prompt(e, prompt) for e, prompt in pairs]
    sb = TrainBatch.from_sequences([e.sequence for e in students], [0.0] * len(students), pad)
    tb = TrainBatch.from_sequences(teachers, [0.0] * len(students), pad)
    with torch.no_grad():
        t_lp = actor.logprobs(tb)
    teacher = torch.zeros_like(sb.old_logprobs)
    for i, ((e, prompt), seq) in enumerate(zip(pairs, teachers, strict=True)):
        n = len(e.sequence) - len(e.prompt_ids)  # the student's tokens after its own prompt
        n = min(n, len(seq) - len(prompt))
        teacher[i, len(e.prompt_ids):len(e.prompt_ids) + n] = t_lp[i, len(prompt):len(prompt) + n]
    sb.extra["teacher"] = teacher
    return ActorUpdate(sb, PolicyLoss.REVERSE_KL_SAMPLED, {"coef": coef}, {"edge_kl": "edge_kl"})
