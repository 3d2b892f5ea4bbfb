"""The actor-critic gate (paper appendix B.1): the actor judges each retrieved entry before
its episode.

After ``warmup_steps`` rollout steps have given the actor a success rate per task, every guided
episode's entry is shown to the actor with the task and that rate, and the actor answers:

* ``accept`` — the episode uses the entry as is; critic score s_c = 1;
* ``refine`` — the actor rewrites the entry and the episode uses the rewrite; s_c = 0.5;
* ``reject`` — the episode runs without it; s_c = 0.

The verdict travels in the episode's request (``meta["gate"]``: verdict, entry id, s_c), so the
experience service adds s_c to r(m) (r̃(m) = s_c + r(m)) for any trainer. During the warm-up the
entries are used as is and carry no score. The actor waits for its verdicts before the episode
starts: that latency is measured per episode (``info["gate_s"]``; the paper reports search time
going from 0.04 s to 1.21 s).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from crl_gym.json_types import JSONDict
from crl_gym.protocol import ExperienceRef
from crl_gym.templates import GATE_REFINE_TEMPLATE, GATE_TEMPLATE
from crl_train.algorithms import GATE_SCORES
from crl_train.policy.base import Policy

WARMUP = "warmup"
"""The verdict of an episode judged during the warm-up (no critic: the entry is used as is)."""
VERDICTS: tuple[str, ...] = (*GATE_SCORES, WARMUP)


@dataclass(frozen=True)
class Verdict:
    """What the gate decided for one guided episode."""

    verdict: str
    """accept, refine, reject, or warmup."""
    shown: ExperienceRef | None
    """What the episode sees: the entry, its rewrite, or nothing."""
    entry_id: int
    """The entry that was judged (credited with s_c + r whatever the verdict)."""
    score: float | None
    """s_c, or None during the warm-up."""

    def meta(self) -> JSONDict:
        """The request's ``meta["gate"]``."""
        return {"verdict": self.verdict, "entry": self.entry_id, "score": self.score}


class ActorCriticGate:
    """See the module docstring. ``observe`` is called with every finished rollout step."""

    def __init__(self, actor: Policy, *, warmup_steps: int = 2, rewrite_tokens: int = 48) -> None:
        self.actor = actor
        self.warmup_steps = warmup_steps
        self.rewrite_tokens = rewrite_tokens
        self.steps_observed = 0
        self._outcomes: dict[str, list[float]] = defaultdict(list)

    def success_rate(self, task: str) -> float | None:
        xs = self._outcomes.get(task)
        return sum(xs) / len(xs) if xs else None

    def observe(self, tasks: Sequence[str], successes: Sequence[bool]) -> None:
        """One rollout step's outcomes (every episode, guided or free, counts towards r̄_θ(task))."""
        for task, ok in zip(tasks, successes, strict=True):
            self._outcomes[task].append(1.0 if ok else 0.0)
        self.steps_observed += 1

    def judge(
        self, tasks: Sequence[str], entries: Sequence[ExperienceRef]
    ) -> tuple[list[Verdict], float]:
        """One verdict per (task, entry), and the seconds the actor took for all of them."""
        if self.steps_observed < self.warmup_steps:
            return [Verdict(WARMUP, e, e.id, None) for e in entries], 0.0
        t0 = time.perf_counter()
        prompts = [
            self._chat(
                GATE_TEMPLATE.format(task=t, success_rate=self._rate_text(t), experience=e.text)
            )
            for t, e in zip(tasks, entries, strict=True)
        ]
        with torch.no_grad():
            answers = self.actor.generate(prompts, 8, allowed=[list(GATE_SCORES)] * len(prompts))
        verdicts = [a.text.strip() if a.text.strip() in GATE_SCORES else "reject" for a in answers]
        refine = [i for i, v in enumerate(verdicts) if v == "refine"]
        rewrites: dict[int, str] = {}
        if refine:
            asks = [
                self._chat(GATE_REFINE_TEMPLATE.format(task=tasks[i], experience=entries[i].text))
                for i in refine
            ]
            with torch.no_grad():
                gens = self.actor.generate(asks, self.rewrite_tokens)
            rewrites = {i: g.text.strip() for i, g in zip(refine, gens, strict=True)}
        out = []
        for i, (e, v) in enumerate(zip(entries, verdicts, strict=True)):
            shown: ExperienceRef | None = e
            if v == "reject":
                shown = None
            elif v == "refine" and rewrites.get(i):
                shown = ExperienceRef(id=e.id, text=rewrites[i], version=e.version)
            out.append(Verdict(v, shown, e.id, GATE_SCORES[v]))
        return out, time.perf_counter() - t0

    def _rate_text(self, task: str) -> str:
        rate = self.success_rate(task)
        return "unknown" if rate is None else f"{rate:.2f}"

    def _chat(self, text: str) -> list[int]:
        return list(self.actor.apply_chat([{"role": "user", "content": text}]))
