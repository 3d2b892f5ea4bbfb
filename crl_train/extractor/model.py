"""The experience extractor π_φ as the trainer uses it: distil, refine, merge, CISPO update.

Its own model and optimizer (the paper's lesson: never share parameters with the actor). Every
generation becomes an :class:`~crl_gym.protocol.ExtractorSample` (prompt, response, token ids,
per-token log-probs, extractor version), stored with the entry it created so CISPO can train on it
when the entry is later credited.

**Constrained answers (tiny preset).** A random-initialised model cannot write JSON, so with
``constrained=True`` the extractor answers by choosing, through the same token-trie decoding the
actor uses, one line among candidate ops built from the episode: ``RETURN``, ``ADD: …`` /
``UPDATE: …`` advice about the actions the episode took. CISPO then learns *which* advice to
write. Real extractors (``constrained=False``) write free text parsed by ``parse_ops``.

**Thinking (``think_tokens``).** The paper's extractor is a *thinking* model: most of its tokens
are reasoning, and only the short ops after it reach the bank. With ``think_tokens=N`` the
constrained extractor samples N free tokens (any token but EOS) before it chooses its op line
(:class:`~crl_train.policy.trie.ThinkThenChoose`): the reasoning costs what a thinking model's
would and is trained on by CISPO, while entries keep their realistic length. Distillation only:
refinement answers while the actor waits for it, and merges are free text.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from crl_gym.experience.ops import parse_ops
from crl_gym.experience.prompts import (
    build_distillation_prompt,
    build_refinement_prompt,
    distillation_update_ids,
    extract_refined_advice,
)
from crl_gym.protocol import (
    DistillationRequest,
    ExperienceOp,
    ExperienceRef,
    ExtractorSample,
    Step,
    Trajectory,
)
from crl_train.algorithms import batch_advantages, cispo_loss, training_count_weights
from crl_train.config import AlgoConfig
from crl_train.policy.base import Generation, TokenSequence, TrainBatch
from crl_train.policy.trie import ActionTrie, ThinkThenChoose

log = logging.getLogger(__name__)


def sample_key(sample: ExtractorSample) -> str:
    h = hashlib.sha1()
    h.update(",".join(map(str, sample.prompt_token_ids)).encode())
    h.update(b"|")
    h.update(",".join(map(str, sample.token_ids)).encode())
    return h.hexdigest()


def candidate_ops(request: DistillationRequest, max_candidates: int = 6) -> list[str]:
    """Well-formed op lines for a constrained extractor (see the module docstring)."""
    actions: list[str] = []
    for step in request.trajectory.steps:
        a = str(step.action).strip()
        if step.kind == "env" and a and a not in actions and len(a) <= 60:
            actions.append(a)
    verb = "UPDATE" if request.experience is not None else "ADD"
    out = ["RETURN: nothing new"]
    first = actions[0] if actions else None
    if first:
        out.append(f"{verb}: Start with '{first}'.")
    for a in actions[: max_candidates]:
        if request.success:
            out.append(f"{verb}: Moving '{a}' helped reach the goal.")
        else:
            out.append(f"{verb}: Avoid repeating '{a}'; explore other directions.")
    out.append(f"{verb}: Look for the goal on the map and walk straight to it.")
    return list(dict.fromkeys(out))[: max_candidates + 2]


def example_op_lines(actions: Sequence[str] = ("north", "east")) -> list[str]:
    """Every phrasing :func:`candidate_ops` writes, for ``actions`` (tokenizer training texts)."""
    steps = [Step("", a, 0.0) for a in actions]
    lines: list[str] = []
    for success in (True, False):
        for exp in (None, ExperienceRef(id=0, text="")):
            req = DistillationRequest(task="", trajectory=Trajectory(steps=steps), outcome=float(success),
                                      success=success, experience=exp, condition="free")
            lines += candidate_ops(req)
    return list(dict.fromkeys(lines))


@dataclass
class BufferItem:
    """One rewarded sample of B_φ."""

    sample: ExtractorSample
    reward: float
    entry_id: int | None
    step: int

    def to_dict(self) -> dict[str, Any]:
        return {"sample": self.sample.to_dict(), "reward": self.reward, "entry_id": self.entry_id, "step": self.step}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BufferItem:
        sample = ExtractorSample.from_dict(d["sample"])
        assert sample is not None
        return cls(sample, float(d["reward"]), d.get("entry_id"), int(d.get("step", 0)))


class Extractor:
    """π_φ: a Policy plus the prompts, the op parser and the CISPO update."""

    def __init__(
        self,
        policy: Any,
        *,
        max_new_tokens: int = 96,
        max_context_tokens: int = 4096,
        max_prompt_chars: int = 6000,
        constrained: bool = False,
        think_tokens: int = 0,
        eps_low: float = AlgoConfig.cispo_eps_low,
        eps_high: float = AlgoConfig.cispo_eps_high,
        cooldown: int = AlgoConfig.cooldown,
        alpha: float = AlgoConfig.count_alpha,
    ) -> None:
        self.policy = policy
        self.max_new_tokens = max_new_tokens
        self.max_context_tokens = max_context_tokens
        self.max_prompt_chars = max_prompt_chars
        self.constrained = constrained
        if think_tokens < 0 or (think_tokens and not constrained):
            raise ValueError(f"Extractor: think_tokens={think_tokens} needs constrained=True and must be >= 0 "
                             "(a free-text model reasons on its own)")
        self.think_tokens = think_tokens
        self._free_ids: tuple[int, ...] | None = None
        self.eps_low, self.eps_high = eps_low, eps_high
        self.cooldown, self.alpha = cooldown, alpha
        self.version = 0
        self.lock = threading.RLock()
        """Held while generating or training: π_φ is shared by the background track and refinement."""
        self.constraints: dict[str, list[tuple[int, ...] | None]] = {}
        """Per-token allowed ids of constrained samples (the ExtractorSample has no field for them)."""

    # ------------------------------------------------------------------ generation
    def _prompt_ids(self, prompt: str, new_tokens: int) -> list[int]:
        ids = list(self.policy.apply_chat([{"role": "user", "content": prompt}]))
        budget = self.max_context_tokens - new_tokens
        return ids[-budget:] if len(ids) > budget else ids  # keep the end: the question is last

    def generate(self, prompts: Sequence[str], allowed: Sequence[Any | None] | None = None,
                 think_tokens: int = 0) -> list[ExtractorSample]:
        """One sample per prompt; ``allowed`` as in ``Policy.generate``; ``think_tokens`` extend the budget."""
        new_tokens = self.max_new_tokens + think_tokens
        ids = [self._prompt_ids(p, new_tokens) for p in prompts]
        with self.lock, torch.no_grad():
            gens: list[Generation] = self.policy.generate(ids, new_tokens, allowed=allowed)
        out = []
        for p, pid, g in zip(prompts, ids, gens, strict=True):
            # a constrained answer cut by max_new_tokens is an incomplete op line: make it unparsable
            text = "" if allowed is not None and g.finish_reason == "length" else g.text
            s = ExtractorSample(prompt=p, response=text, logprobs=list(g.logprobs), token_ids=list(g.token_ids),
                                prompt_token_ids=pid, extractor_version=self.version)
            if g.allowed is not None and any(a is not None for a in g.allowed):
                self.constraints[sample_key(s)] = list(g.allowed)
            out.append(s)
        return out

    def distill(self, requests: Sequence[DistillationRequest]) -> list[tuple[ExtractorSample, list[ExperienceOp]]]:
        """One batched generation over ``requests``; each answer parsed into ops (never raises)."""
        prompts = [build_distillation_prompt(r, max_chars=self.max_prompt_chars) for r in requests]
        allowed = [self._choices(candidate_ops(r)) for r in requests] if self.constrained else None
        samples = self.generate(prompts, allowed, self.think_tokens)
        out = []
        for r, s in zip(requests, samples, strict=True):
            ops = parse_ops(s.response, allowed_update_ids=distillation_update_ids(r))
            out.append((s, ops))
        return out

    def _choices(self, lines: list[str]) -> list[str] | ThinkThenChoose:
        """The candidate lines, behind ``think_tokens`` free tokens when the extractor thinks."""
        if not self.think_tokens:
            return lines
        tok = self.policy.tokenizer
        eos = int(self.policy.eos_token_ids[0])
        if self._free_ids is None:
            special = set(tok.all_special_ids) | {int(e) for e in self.policy.eos_token_ids}
            self._free_ids = tuple(i for i in range(len(tok)) if i not in special)
        return ThinkThenChoose(ActionTrie.from_actions(lines, tok, eos), self.think_tokens, self._free_ids)

    def refine(self, query: str, entry: ExperienceRef, context: str) -> tuple[str, ExtractorSample | None]:
        """The manager's ``refiner``: rewrite ``entry`` for the actor's query."""
        prompt = build_refinement_prompt(query, entry, context, max_chars=self.max_prompt_chars)
        allowed = [[entry.text, f"{entry.text} Then try a direction you have not tried yet."]] if self.constrained else None
        (s,) = self.generate([prompt], allowed)
        text = s.response.strip() if self.constrained else extract_refined_advice(s.response, entry.text)
        return text or entry.text, s

    def merge_generate(self, prompts: list[str]) -> list[ExtractorSample]:
        """``generate`` callback of ``merge_bank`` (free text; the tiny model usually fails it, which is counted)."""
        return self.generate(prompts, None)

    # ------------------------------------------------------------------ CISPO
    def _sequence(self, s: ExtractorSample) -> TokenSequence:
        seq = TokenSequence()
        seq.append_context(s.prompt_token_ids)
        seq.append_generation(Generation(prompt_ids=s.prompt_token_ids, token_ids=s.token_ids, logprobs=s.logprobs,
                                         text=s.response, allowed=self.constraints.get(sample_key(s))))
        return seq

    def train(self, items: Sequence[BufferItem], counts: Sequence[int], lasts: Sequence[int], step: int) -> dict[str, float]:
        """CISPO step (model work only): Â = w(m)·(r̄ − mean r̄), w from the entries' training counts.

        ``counts[i]`` / ``lasts[i]``: ``train_count`` / ``last_trained_step`` of item i's entry
        (0 / −1 for refinements and entries no longer in the bank). Every item needs token ids.
        """
        if not items:
            return {"skipped": 1.0}
        rbar = torch.tensor([it.reward for it in items], dtype=torch.float32)
        w = training_count_weights(torch.tensor(list(counts)), torch.tensor(list(lasts)), step,
                                   cooldown=self.cooldown, alpha=self.alpha)
        adv = batch_advantages(rbar, w)
        seqs = [self._sequence(it.sample) for it in items]
        batch = TrainBatch.from_sequences(seqs, adv, self.policy.pad_token_id)
        with self.lock:
            metrics = self.policy.train_step(batch, cispo_loss, eps_low=self.eps_low, eps_high=self.eps_high)
            self.version += 1
        metrics.update({"reward_mean": float(rbar.mean()), "weight_mean": float(w.mean()), "samples": float(len(items))})
        return metrics

    def update(self, items: Sequence[BufferItem], bank: Any, step: int) -> dict[str, float]:
        """CISPO step over ``items``; records the training counts in ``bank`` (see :func:`cispo_update`)."""
        return cispo_update(self.train, items, bank, step)

    # ------------------------------------------------------------------ the worker interface
    # (the same methods as crl_train.extractor.worker.ExtractorWorker, so the track takes either)
    alive = True
    """An in-process extractor cannot die without the trainer."""

    def count_tokens(self, text: str) -> int:
        tok = getattr(self.policy, "tokenizer", None)
        return len(tok.encode(text, add_special_tokens=False)) if tok is not None else len(text) // 4

    def save(self, directory: str | Path) -> None:
        with self.lock:
            self.policy.save(directory)

    def load(self, directory: str | Path) -> None:
        with self.lock:
            self.policy.load(directory)

    def get_state(self) -> dict[str, Any]:
        """Version and per-sample constraints (JSON-ready) for a checkpoint.

        Each distinct allowed set is written once in ``allowed_sets`` and the samples refer to it by
        index: a thinking sample's reasoning positions all allow the same few hundred ids.
        """
        with self.lock:
            index: dict[tuple[int, ...], int] = {}
            refs = {k: [None if a is None else index.setdefault(tuple(a), len(index)) for a in v]
                    for k, v in self.constraints.items()}
            return {"version": self.version, "allowed_sets": [list(a) for a in index], "constraints": refs}

    def set_state(self, d: dict[str, Any]) -> None:
        """Inverse of :meth:`get_state` (also reads the older form with the sets written inline)."""
        with self.lock:
            sets = [tuple(int(i) for i in a) for a in d.get("allowed_sets", [])]

            def one(a: Any) -> tuple[int, ...] | None:
                if a is None:
                    return None
                if not isinstance(a, int):
                    return tuple(a)
                if not 0 <= a < len(sets):
                    raise ValueError(f"extractor state: a constraint refers to allowed set {a}, "
                                     f"but the state holds {len(sets)} sets (corrupt checkpoint?)")
                return sets[a]

            constraints = {k: [one(a) for a in v] for k, v in d.get("constraints", {}).items()}
            self.version, self.constraints = int(d.get("version", 0)), constraints  # nothing changes on a bad state

    def close(self) -> None:
        """Nothing to release in process (the worker's ``close`` stops its child)."""


def entry_counts(items: Sequence[BufferItem], bank: Any) -> tuple[list[int], list[int]]:
    """``train_count`` and ``last_trained_step`` of each item's entry (0 / −1 when it has none)."""
    counts, lasts = [], []
    for it in items:
        e = bank.get(it.entry_id) if it.entry_id is not None else None
        counts.append(e.train_count if e is not None else 0)
        lasts.append(e.last_trained_step if e is not None else -1)
    return counts, lasts


def cispo_update(train: Callable[[Sequence[BufferItem], list[int], list[int], int], dict[str, float]],
                 items: Sequence[BufferItem], bank: Any, step: int) -> dict[str, float]:
    """Bank side of an extractor update: read the counts, ``train`` (in process or in the worker),
    then ``bank.record_training`` for every credited entry (the authors' code forgot this)."""
    items = [it for it in items if it.sample.token_ids]
    if not items:
        return {"skipped": 1.0}
    counts, lasts = entry_counts(items, bank)
    metrics = train(items, counts, lasts, step)
    ids = sorted({it.entry_id for it in items if it.entry_id is not None})
    if ids:
        bank.record_training(ids, step)
    return metrics
