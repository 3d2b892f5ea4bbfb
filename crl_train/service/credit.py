"""What ending a rollout step credits: the entries that guided its episodes, and EDGE's utilities.

Every input comes from the step's :class:`~crl_gym.protocol.DistillationRequest` s: the entry an
episode used, its condition, its success, its env and seed (the rollout group), and the extractor
samples of its ``search_and_ask`` refinements. Episodes that ended because the env raised send no
request, so they never enter a reward, a mean or a gain.

>>> from crl_gym.protocol import DistillationRequest, ExperienceRef, Trajectory
>>> from crl_gym.experience.service import ClosedStep
>>> def req(entry, ok, cond="guided"):
...     ref = ExperienceRef(entry, "x") if entry is not None else None
...     return DistillationRequest(task="t", trajectory=Trajectory(), outcome=float(ok), success=ok,
...                                experience=ref, condition=cond, env_id="e", seed=0)
>>> step = ClosedStep(3, [req(7, True), req(7, False), req(9, True), req(None, False, "free")])
>>> [(c.entry_id, c.reward) for c in step_credits(step)]
[(7, 0.0), (9, 1.0)]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from crl_gym.experience.service import ClosedStep
from crl_gym.protocol import GUIDED_CONDITION, DistillationRequest, ExtractorSample, guiding_entries
from crl_train.algorithms import FREE, GUIDED, ema_utility, marginal_gain
from crl_train.algorithms.extractor_rewards import entry_rewards, episode_rewards, free_baselines
from crl_train.service.track import Credit, Reflection


def judged_entry(request: DistillationRequest) -> int | None:
    """The entry a guided episode is credited to: the one it saw, or the one the actor-critic gate
    judged (a rejected entry guided nothing, yet its r̃(m) = s_c + r(m) still counts)."""
    if request.condition != GUIDED_CONDITION:
        return None
    if request.experience is not None:
        return request.experience.id
    gate = request.meta.get("gate") if request.meta else None
    return int(gate["entry"]) if isinstance(gate, dict) and gate.get("entry") is not None else None


def credited_entries(request: DistillationRequest) -> list[int]:
    """Every entry a guided episode is credited to, each once: :func:`judged_entry`, then the
    entries of its turns (per-turn retrieval) that it does not already hold. An entry shown at many
    turns of one episode is one episode of its r̄(m), not one per turn."""
    if request.condition != GUIDED_CONDITION:
        return []
    first = judged_entry(request)
    out = [] if first is None else [first]
    for g in request.turn_experience:
        if g.entry.id not in out:
            out.append(g.entry.id)
    return out


def gate_score(request: DistillationRequest) -> float:
    """s_c of the gate's verdict on the episode's entry (0 without a verdict)."""
    gate = request.meta.get("gate") if request.meta else None
    score = gate.get("score") if isinstance(gate, dict) else None
    return float(score) if score is not None else 0.0


def step_credits(closed: ClosedStep, *, relative: bool = False) -> list[Credit]:
    """r̄(m) of every entry that guided an episode of the step, plus one credit per refinement.

    Both come from :func:`~crl_train.algorithms.extractor_rewards.episode_rewards`: r(m, τ) = ±1 by
    the episode's success (``relative``: minus the mean ±1 of its group's free subgroup, the variant
    the paper found worse), plus the gate's s_c and ``closed.bonus[request_id]`` for the entries; a
    refinement gets its episode's ±1 alone.
    """
    credits: list[Credit] = []
    # one row per (episode, entry it was guided by): the gate judged the episode's own entry only
    rows = [(r, i, i == judged_entry(r)) for r in closed.requests for i in credited_entries(r)]
    guided = [r for r, _, _ in rows]
    if guided:
        baseline = None
        if relative:
            everyone = closed.requests
            keys = {k: i for i, k in enumerate(dict.fromkeys((r.env_id, r.seed) for r in everyone))}
            base = free_baselines(
                torch.tensor([bool(r.success) for r in everyone]),
                torch.tensor([keys[(r.env_id, r.seed)] for r in everyone]),
                torch.tensor(
                    [GUIDED if r.condition == GUIDED_CONDITION else FREE for r in everyone]
                ),
            )
            by_id = {id(r): float(v) for r, v in zip(everyone, base.tolist(), strict=True)}
            baseline = torch.tensor([by_id[id(r)] for r in guided])
        ids, rbar = entry_rewards(
            torch.tensor([i for _, i, _ in rows]),
            torch.tensor([bool(r.success) for r in guided]),
            torch.tensor(
                [gate_score(r) if judged else 0.0 for r, _, judged in rows], dtype=torch.float64
            ),
            baseline=baseline,
            bonus=torch.tensor(
                [float(closed.bonus.get(r.request_id, 0.0)) for r in guided], dtype=torch.float64
            ),
        )
        credits += [
            Credit(closed.step, float(v), entry_id=int(i))
            for i, v in zip(ids.tolist(), rbar.tolist(), strict=True)
        ]
    refined = [
        (r, sample)
        for r in closed.requests
        for call in r.trajectory.search_calls
        if call.refined
        and call.provenance
        and (sample := ExtractorSample.from_dict(call.provenance)) is not None
    ]
    if refined:
        rewards = episode_rewards(torch.tensor([bool(r.success) for r, _ in refined]))
        credits += [
            Credit(closed.step, float(v), sample=sample)
            for (_, sample), v in zip(refined, rewards.tolist(), strict=True)
        ]
    return credits


@dataclass(frozen=True)
class UtilityUpdate:
    """EDGE: the new EMA utility of one entry, and whether it fell below η."""

    entry_id: int
    utility: float
    prune: bool


def group_gains(requests: list[DistillationRequest]) -> dict[tuple[str, int | None], float]:
    """Δe = mean r(guided) − mean r(free) per rollout group (env id, seed), r = 1 on success.

    A group without episodes of both conditions (every guided or every free one ended by an env
    error, which sends no request) has no gain and is left out.
    """
    conds: dict[tuple[str, int | None], set[str]] = {}
    for q in requests:
        conds.setdefault((q.env_id, q.seed), set()).add(q.condition)
    keys = sorted(
        (k for k, c in conds.items() if len(c) == 2),
        key=lambda k: (k[0], -1 if k[1] is None else k[1]),
    )
    if not keys:
        return {}
    index = {k: i for i, k in enumerate(keys)}
    requests = [q for q in requests if (q.env_id, q.seed) in index]
    r = torch.tensor([1.0 if q.success else 0.0 for q in requests])
    g = torch.tensor([index[(q.env_id, q.seed)] for q in requests])
    cond = torch.tensor([GUIDED if q.condition == GUIDED_CONDITION else FREE for q in requests])
    gain = marginal_gain(r, g, cond)
    return {k: float(v) for k, v in zip(keys, gain.tolist(), strict=True)}


def utility_updates(
    closed: ClosedStep, utility_of: dict[int, float], *, momentum: float, prune_below: float
) -> list[UtilityUpdate]:
    """U ← β·U + (1 − β)·Δe for each entry that guided a group of the step, with that group's gain
    (an entry that guided two groups gets both updates, in group order).

    ``utility_of`` gives each entry's current utility; entries not in it (deleted meanwhile)
    are skipped.
    """
    current = dict(utility_of)
    touched: list[int] = []
    for key, gain in group_gains(closed.requests).items():
        used = dict.fromkeys(
            e.id
            for r in closed.requests
            if (r.env_id, r.seed) == key and r.condition == GUIDED_CONDITION
            for e in guiding_entries(r)
        )
        for entry_id in used:
            if entry_id in current:
                current[entry_id] = float(
                    ema_utility(torch.tensor(current[entry_id]), torch.tensor(gain), momentum)
                )
                touched.append(entry_id)
    return [UtilityUpdate(i, current[i], current[i] < prune_below) for i in dict.fromkeys(touched)]


def task_category(request: DistillationRequest) -> str:
    """The request's task category: the env's ``info["task_category"]`` (e.g. ALFWorld's task type),
    recorded by the wrapper, else its env id."""
    category = request.meta.get("task_category") if request.meta else None
    return str(category) if category else request.env_id


def reflections(closed: ClosedStep, below: float) -> list[Reflection]:
    """EDGE: one reflection per task category of the step whose success rate is below ξ = ``below``
    (and that failed at least once), worst first."""
    by_category: dict[str, list[DistillationRequest]] = {}
    for r in closed.requests:
        by_category.setdefault(task_category(r), []).append(r)
    jobs = []
    for category, reqs in by_category.items():
        wins = [r for r in reqs if r.success]
        if len(wins) / len(reqs) < below and len(wins) < len(reqs):
            jobs.append(
                (
                    len(wins) / len(reqs),
                    Reflection(closed.step, category, [r for r in reqs if not r.success], wins),
                )
            )
    return [job for _, job in sorted(jobs, key=lambda x: (x[0], x[1].category))]
