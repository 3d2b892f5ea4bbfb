"""The experience extractor π_φ as the trainer uses it: distil, refine, merge, CISPO update.

Its own model and optimizer (the paper's lesson: never share parameters with the actor). Every
generation becomes an :class:`~crl_gym.protocol.ExtractorSample` (prompt, response, token ids,
per-token log-probs, extractor version), stored with the entry it created so CISPO can train on it
when the entry is later credited.

**Structured answers (``structured=True``, the default).** Each task's answer is generated under
its JSON Schema (:mod:`crl_gym.experience.schemas`): distillation ops, the ``search_and_ask``
refinement, and each Merge window's decision (its labels only). The ``hf`` backend applies the
grammar token by token with llguidance (``crl_train.policy.grammar``); a ``vllm`` generator gets the
same schema as a structured-output request. Strings are bounded, so a valid answer has a known
longest length; a structured call's token budget is at least that long, so no answer is cut, and
every answer at any model size — a random-initialised tiny one included — is valid JSON of its
schema. What CISPO learns is then the text itself, not a choice among canned sentences. A
thinking model reasons freely first (``</think>`` detected from its tokenizer and chat template);
only the answer after its reasoning is constrained. ``structured=False`` leaves the answers free
(an API model's way), read by the tolerant ``parse_ops``.

**Exact CISPO ratios.** A grammar sample keeps its grammar (``JsonGrammar``, a schema and its
reasoning rule), not its masks: when it is trained on, the masks are recomputed by replaying the
grammar over its tokens (llguidance is deterministic), so the recomputed log-probs are those it
was sampled with. A checkpoint writes each distinct grammar once.

**Thinking (``think_tokens``).** The paper's extractor is a *thinking* model: most of its tokens
are reasoning, and only the short ops after it reach the bank. With ``think_tokens=N`` the tiny
extractor samples N free tokens (any token but EOS) before its structured answer: the reasoning
costs what a thinking model's would and is trained on by CISPO, while entries keep their
realistic length. Distillation only: refinement answers while the actor waits for it, and a merge
is one long answer already.

**The action slot (``action_slot=N``).** Each distillation answer's add / update first chooses 1 … N
of its episode's admissible actions (``schemas.ops_schema``'s slot; the prompt names the field),
and its entry reads ``Play a, then b. <text>``. A request whose trajectory lists no admissible
actions gets the schema and prompt without a slot (counted in ``slotless_requests``, logged once).
Distillation only: refinement, merge and EDGE's reflection are unchanged.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

import torch

from crl_gym.experience.ops import parse_ops, parse_structured_ops
from crl_gym.experience.prompts import (
    build_distillation_prompt,
    build_refinement_prompt,
    build_reflection_prompt,
    distillation_slot_actions,
    distillation_update_ids,
    extract_refined_advice,
)
from crl_gym.experience.schemas import (
    max_answer_chars,
    merge_schema,
    ops_schema,
    refinement_schema,
)
from crl_gym.json_types import GrammarSpec, JSONDict, SampleDict
from crl_gym.protocol import (
    AddOp,
    DistillationRequest,
    ExperienceOp,
    ExperienceRef,
    ExtractorSample,
    ReturnOp,
)
from crl_train.algorithms import (
    LOSSES,
    CispoParams,
    PolicyLoss,
    batch_advantages,
    loss_scale_for,
    training_count_weights,
)
from crl_train.config import ExtractorSettings
from crl_train.policy.base import AllowedRow, Generation, Policy, TokenSequence, TrainBatch
from crl_train.policy.grammar import JsonGrammar

if TYPE_CHECKING:
    from crl_gym.experience.bank import ExperienceBank

log = logging.getLogger(__name__)

GRAMMAR_KEY = "grammar:"
"""Prefix of a grammar's entry in a checkpoint's ``constraints`` (sample keys are bare sha1 hex)."""
MIN_PROMPT_TOKENS = 64
"""A structured call never leaves its prompt fewer tokens than this (a huge schema is
capped instead)."""


def sample_key(sample: ExtractorSample) -> str:
    h = hashlib.sha1()
    h.update(",".join(map(str, sample.prompt_token_ids)).encode())
    h.update(b"|")
    h.update(",".join(map(str, sample.token_ids)).encode())
    return h.hexdigest()


def grammar_key(grammar: JsonGrammar) -> str:
    """A grammar's name in a checkpoint (the hash of its schema and reasoning rule)."""
    h = hashlib.sha1(grammar.schema.encode())
    h.update(f"|{grammar.think_tokens}|{grammar.reasoning_end}".encode())
    return GRAMMAR_KEY + h.hexdigest()


def reasoning_end_token(policy: Policy) -> int | None:
    """The ``</think>`` token id when ``policy`` is a thinking model, else None.

    A thinking model has ``</think>`` as one token and a chat template that thinks: it opens
    ``<think>`` in the generation prompt (Qwen3-*-Thinking-2507), or it reads ``enable_thinking``
    and the policy does not turn it off (Qwen3 hybrids think by default).
    """
    tok = policy.tokenizer
    tid = tok.get_vocab().get("</think>")
    if tid is None:
        return None
    kwargs = dict(policy.chat.chat_kwargs)
    if kwargs.get("enable_thinking") is False:
        return None
    try:
        prompt = str(tok.decode(policy.apply_chat([{"role": "user", "content": "?"}])))
    except Exception:  # noqa: BLE001 - a template that cannot render is no thinking template
        return None
    template = str(tok.chat_template or "")
    thinks = (
        prompt.rstrip().endswith("<think>")
        or kwargs.get("enable_thinking") is True
        or "enable_thinking" in template
    )
    return int(tid) if thinks else None


class BufferItemDict(TypedDict):
    """:meth:`BufferItem.to_dict` (a track's ``buffer`` in a service checkpoint)."""

    sample: SampleDict
    reward: float
    entry_id: int | None
    step: NotRequired[int]
    """Missing from a checkpoint written before the buffer kept steps (read as 0)."""


@dataclass
class BufferItem:
    """One rewarded sample of B_φ."""

    sample: ExtractorSample
    reward: float
    entry_id: int | None
    step: int

    def to_dict(self) -> BufferItemDict:
        return {
            "sample": self.sample.to_dict(),
            "reward": self.reward,
            "entry_id": self.entry_id,
            "step": self.step,
        }

    @classmethod
    def from_dict(cls, d: BufferItemDict) -> BufferItem:
        sample = ExtractorSample.from_dict(d["sample"])
        assert sample is not None
        return cls(sample, float(d["reward"]), d.get("entry_id"), int(d.get("step", 0)))


class Extractor:
    """π_φ: a Policy plus the prompts, the answer schemas, the op parser and the CISPO update.

    Args:
        policy: the extractor's model (its ``generate`` takes ``JsonGrammar`` rows).
        settings: its budgets, answer form and CISPO hyper-parameters
            (:class:`~crl_train.config.ExtractorSettings`, the one source of their defaults;
            ``ExtractorSettings.from_config(cfg)`` for a run's).
        **legacy: the settings' fields as keyword arguments (``max_new_tokens=24``), the form
            before :class:`~crl_train.config.ExtractorSettings`: still read, over ``settings``,
            with a ``DeprecationWarning``.
    """

    def __init__(
        self, policy: Policy, settings: ExtractorSettings | None = None, **legacy: object
    ) -> None:
        settings = settings if settings is not None else ExtractorSettings()
        if legacy:
            warnings.warn(
                "Extractor(policy, max_new_tokens=..., ...) is deprecated: pass "
                "Extractor(policy, ExtractorSettings(max_new_tokens=..., ...))",
                DeprecationWarning,
                stacklevel=2,
            )
            settings = replace(settings, **legacy)  # type: ignore[arg-type]  # checked there
        self.settings = settings
        """What the extractor was built with (the attributes below are read from it)."""
        self.policy = policy
        self.max_new_tokens = settings.max_new_tokens
        self.max_context_tokens = settings.max_context_tokens
        self.max_prompt_chars = settings.max_prompt_chars
        self.max_ops = settings.max_ops
        self.action_slot = settings.action_slot
        self.slotless_requests = 0
        """Distillation requests with the slot on whose trajectory listed no admissible actions
        (no slot)."""
        self.structured = settings.structured
        self.constrained = settings.constrained
        self.think_tokens = settings.think_tokens
        self.max_entry_chars = settings.max_entry_chars
        self.reasoning_end: int | None = None
        """``</think>`` of a thinking model: its reasoning is free, the answer after it
        is constrained."""
        if settings.structured and settings.thinking is not False and not settings.think_tokens:
            self.reasoning_end = reasoning_end_token(policy)
            if settings.thinking and self.reasoning_end is None:
                raise ValueError("Extractor: thinking=True but the tokenizer has no </think> token")
        self.eps_low, self.eps_high = settings.eps_low, settings.eps_high
        self.cooldown, self.alpha = settings.cooldown, settings.alpha
        self.loss = (
            PolicyLoss.CISPO if settings.normalisation == "tokens" else PolicyLoss.CISPO_SEQUENCES
        )
        """Eq. 3's loss, or its per-sample normalisation (``algo.cispo_normalisation``)."""
        self.version = 0
        self.lock = threading.RLock()
        """Held while generating or training: π_φ is shared by the background track
        and refinement."""
        self.constraints: dict[str, list[tuple[int, ...] | None]] = {}
        """Per-token allowed ids of samples constrained by action lists (the ExtractorSample has
        no field for them)."""
        self.grammars: dict[str, JsonGrammar] = {}
        """The grammar each structured sample was drawn under (its masks are replayed
        for training)."""
        self._grammar_pool: dict[JsonGrammar, JsonGrammar] = {}
        self._warned_budget = False
        self.unreplayable = 0
        """Samples left out of CISPO updates because their tokens do not replay under their grammar
        (another tokenizer or grammar than they were drawn with)."""

    # ------------------------------------------------------------------ generation
    def _prompt_ids(self, prompt: str, new_tokens: int) -> list[int]:
        ids = list(self.policy.apply_chat([{"role": "user", "content": prompt}]))
        budget = max(1, self.max_context_tokens - new_tokens)
        return ids[-budget:] if len(ids) > budget else ids  # keep the end: the question is last

    def _grammar(self, schema: dict[str, Any], think_tokens: int = 0) -> JsonGrammar:
        """The grammar of ``schema`` for this model (its reasoning rule included), one object per
        distinct one."""
        g = JsonGrammar.from_schema(
            schema,
            think_tokens=think_tokens,
            reasoning_end=None if think_tokens else self.reasoning_end,
        )
        return self._grammar_pool.setdefault(g, g)

    def _budget(self, grammar: JsonGrammar) -> int:
        """Tokens for an answer under ``grammar``: at least its longest valid answer and EOS (a
        token is at least one character, so no answer is cut), plus its ``think_tokens``."""
        need = max(self.max_new_tokens, max_answer_chars(grammar.schema_dict()) + 1)
        cap = self.max_context_tokens - MIN_PROMPT_TOKENS - grammar.think_tokens
        if need > cap:
            if not self._warned_budget:
                self._warned_budget = True
                log.warning(
                    "a structured answer may need %d tokens but the context leaves %d: a long one "
                    "may be cut (raise extractor.max_context_tokens, or shrink the merge windows)",
                    need,
                    cap,
                )
            need = max(1, cap)
        return need + grammar.think_tokens

    def generate(
        self,
        prompts: Sequence[str],
        allowed: Sequence[AllowedRow] | None = None,
        think_tokens: int = 0,
        new_tokens: int | None = None,
    ) -> list[ExtractorSample]:
        """One sample per prompt; ``allowed`` as in ``Policy.generate`` (action lists or
        ``JsonGrammar``); ``think_tokens`` extend the budget ``new_tokens`` (default
        ``max_new_tokens``)."""
        new = (self.max_new_tokens if new_tokens is None else new_tokens) + think_tokens
        ids = [self._prompt_ids(p, new) for p in prompts]
        with (
            self.lock,
            torch.no_grad(),
        ):  # held to the end: π_old below is of the weights that sampled
            gens: list[Generation] = self.policy.generate(ids, new, allowed=allowed)
            out = []
            rows = list(allowed) if allowed is not None else [None] * len(prompts)
            for p, pid, g, a in zip(prompts, ids, gens, rows, strict=True):
                # a constrained answer cut by the budget is incomplete: make it unparsable (it
                # is counted)
                text = "" if a is not None and g.finish_reason == "length" else g.text
                spec = (
                    GrammarSpec(
                        schema=a.schema, think_tokens=a.think_tokens, reasoning_end=a.reasoning_end
                    )
                    if isinstance(a, JsonGrammar)
                    else None
                )  # the sample carries its grammar: it replays anywhere
                s = ExtractorSample(
                    prompt=p,
                    response=text,
                    logprobs=list(g.logprobs),
                    token_ids=list(g.token_ids),
                    prompt_token_ids=pid,
                    extractor_version=self.version,
                    grammar=spec,
                )
                if isinstance(a, JsonGrammar):
                    self.grammars[sample_key(s)] = self._grammar_pool.setdefault(a, a)
                elif g.allowed is not None and any(x is not None for x in g.allowed):
                    self.constraints[sample_key(s)] = list(g.allowed)
                out.append(s)
            if self.trainable and not self.policy.sampled_logprobs_exact:
                self._recompute_logprobs(out)
        return out

    def _recompute_logprobs(self, samples: list[ExtractorSample]) -> None:
        """Each sample's π_old through the training forward (``Policy.sampled_logprobs_exact``):
        CISPO's ratio is taken against the weights that sampled, so it is recomputed now, not at
        the update. The update's micro-batches may group the samples otherwise than here, which in
        bf16 still moves a log-prob by rounding."""
        kept = [s for s in samples if s.token_ids]
        if not kept:
            return
        batch = TrainBatch.from_sequences(
            [self._sequence(s) for s in kept], [0.0] * len(kept), self.policy.pad_token_id
        )
        lp = self.policy.logprobs(batch)
        for i, s in enumerate(kept):
            start = len(s.prompt_token_ids)
            s.logprobs = lp[i, start : start + len(s.token_ids)].tolist()

    def _structured(
        self, prompts: Sequence[str], grammars: Sequence[JsonGrammar]
    ) -> list[ExtractorSample]:
        """One batched generation under per-prompt grammars, with the largest budget any of
        them needs."""
        budget = max(self._budget(g) for g in grammars)
        return self.generate(prompts, list(grammars), new_tokens=budget)

    def distill(
        self, requests: Sequence[DistillationRequest]
    ) -> list[tuple[ExtractorSample, list[ExperienceOp]]]:
        """One batched generation over ``requests``; each answer parsed into ops (never raises)."""
        slots = [self._slot_actions(r) for r in requests]
        prompts = [
            build_distillation_prompt(
                r,
                max_chars=self.max_prompt_chars,
                max_ops=self.max_ops,
                max_entry_chars=self.max_entry_chars,
                action_slot=self.action_slot if a else 0,
            )
            for r, a in zip(requests, slots, strict=True)
        ]
        targets = [distillation_update_ids(r) for r in requests]
        if not self.structured:
            samples = self.generate(prompts, None)
            return [
                (s, parse_ops(s.response, allowed_update_ids=t))
                for s, t in zip(samples, targets, strict=True)
            ]
        grammars = [
            self._grammar(
                ops_schema(
                    t,
                    max_ops=self.max_ops,
                    max_text=self.max_entry_chars,
                    slot_actions=a,
                    slot_size=self.action_slot if a else 0,
                ),
                self.think_tokens,
            )
            for t, a in zip(targets, slots, strict=True)
        ]
        samples = self._structured(prompts, grammars)
        return [
            (
                s,
                parse_structured_ops(
                    s.response,
                    allowed_update_ids=t,
                    max_len=self.max_entry_chars,
                    max_ops=self.max_ops,
                ),
            )
            for s, t in zip(samples, targets, strict=True)
        ]

    def _slot_actions(self, request: DistillationRequest) -> tuple[str, ...]:
        """The slot's actions for ``request`` (none when the slot is off or its env lists none)."""
        if not self.action_slot:
            return ()
        actions = distillation_slot_actions(request)
        if not actions:
            if self.slotless_requests == 0:
                log.info(
                    "action slot: a distillation request lists no admissible actions; it is "
                    "distilled without a slot (counted in Extractor.slotless_requests)"
                )
            self.slotless_requests += 1
        return actions

    def refine(
        self, query: str, entry: ExperienceRef, context: str
    ) -> tuple[str, ExtractorSample | None]:
        """The manager's ``refiner``: rewrite ``entry`` for the actor's query (entry m itself when
        the answer holds no advice)."""
        prompt = build_refinement_prompt(query, entry, context, max_chars=self.max_prompt_chars)
        if self.structured:
            (s,) = self._structured(
                [prompt], [self._grammar(refinement_schema(self.max_entry_chars))]
            )
        else:
            (s,) = self.generate([prompt], None)
        return extract_refined_advice(s.response, entry.text, max_chars=self.max_entry_chars), s

    def reflect(
        self,
        category: str,
        failures: Sequence[DistillationRequest],
        successes: Sequence[DistillationRequest],
        max_entries: int = 3,
    ) -> tuple[ExtractorSample, list[ExperienceOp]]:
        """EDGE's reflection on a low-success category: up to ``max_entries`` new entries (Adds
        only; a Return when the episodes teach nothing), from its failed and successful episodes."""
        prompt = build_reflection_prompt(
            category,
            failures,
            successes,
            max_entries=max_entries,
            max_chars=self.max_prompt_chars,
            max_entry_chars=self.max_entry_chars,
        )
        if self.structured:
            grammar = self._grammar(
                ops_schema((), max_ops=max_entries, max_text=self.max_entry_chars),
                self.think_tokens,
            )
            (s,) = self._structured([prompt], [grammar])
            ops = parse_structured_ops(
                s.response,
                allowed_update_ids=frozenset(),
                max_len=self.max_entry_chars,
                max_ops=max_entries,
            )
        else:
            (s,) = self.generate([prompt], None)
            ops = parse_ops(s.response, allowed_update_ids=frozenset())
        adds: list[ExperienceOp] = []
        returns: list[ExperienceOp] = []
        for op in ops:
            (adds if isinstance(op, AddOp) else returns if isinstance(op, ReturnOp) else []).append(
                op
            )
        return s, adds[:max_entries] or returns[:1]

    def merge_generate(self, prompts: list[str]) -> list[ExtractorSample]:
        """``generate`` callback of ``merge_bank``: a window's prompt (a ``MergePrompt``) carries
        its labels, and its answer is generated under that window's schema; a bare prompt is
        free text."""
        labels = [getattr(p, "labels", None) for p in prompts]
        if not self.structured or any(not x for x in labels):
            return self.generate(prompts, None)
        grammars = [self._grammar(merge_schema(x, self.max_entry_chars)) for x in labels if x]
        return self._structured(prompts, grammars)

    # ------------------------------------------------------------------ CISPO
    def allowed_of(self, s: ExtractorSample) -> list[tuple[int, ...] | None] | None:
        """The per-token allowed sets ``s`` was sampled under: stored ones, or its
        grammar replayed."""
        key = sample_key(s)
        stored = self.constraints.get(key)
        if stored is not None:
            return stored
        grammar = self.grammars.get(key)
        if (
            s.grammar is not None
        ):  # its own (a bank entry's provenance after a restart, a resumed B_φ)
            grammar = JsonGrammar(
                s.grammar["schema"],
                int(s.grammar.get("think_tokens", 0)),
                s.grammar.get("reasoning_end"),
            )
        if grammar is None or not s.token_ids:
            return None
        replayed: list[tuple[int, ...] | None] = self.policy.replay_allowed(grammar, s.token_ids)
        return replayed

    def _sequence(self, s: ExtractorSample) -> TokenSequence:
        seq = TokenSequence()
        seq.append_context(s.prompt_token_ids)
        seq.append_generation(
            Generation(
                prompt_ids=s.prompt_token_ids,
                token_ids=s.token_ids,
                logprobs=s.logprobs,
                text=s.response,
                allowed=self.allowed_of(s),
            )
        )
        return seq

    def train(
        self, items: Sequence[BufferItem], counts: Sequence[int], lasts: Sequence[int], step: int
    ) -> dict[str, float]:
        """CISPO step (model work only): Â = w(m)·(r̄ − mean r̄), w from the entries' training counts.

        ``counts[i]`` / ``lasts[i]``: ``train_count`` / ``last_trained_step`` of item i's entry
        (0 / −1 for refinements and entries no longer in the bank). Every item needs token ids.
        """
        if not items:
            return {"skipped": 1.0}
        rbar = torch.tensor([it.reward for it in items], dtype=torch.float32)
        w = training_count_weights(
            torch.tensor(list(counts)),
            torch.tensor(list(lasts)),
            step,
            cooldown=self.cooldown,
            alpha=self.alpha,
        )
        adv = batch_advantages(rbar, w)
        seqs: list[TokenSequence] = []
        keep: list[int] = []
        with self.lock:  # replaying grammars reads the policy's engine, shared with generation
            for i, it in enumerate(items):
                try:
                    seqs.append(self._sequence(it.sample))
                    keep.append(i)
                except (
                    ValueError
                ) as exc:  # not drawn under this tokenizer and grammar: its ratio would be wrong
                    self.unreplayable += 1
                    log.warning(
                        "CISPO: a sample (extractor version %d) does not replay under its grammar "
                        "and is left out of the update (%d so far): %s",
                        it.sample.extractor_version,
                        self.unreplayable,
                        exc,
                    )
        dropped = float(len(items) - len(keep))
        if not keep:
            return {"skipped": 1.0, "unreplayable": dropped}
        batch = TrainBatch.from_sequences(seqs, adv[keep], self.policy.pad_token_id)
        with self.lock:
            params = CispoParams(eps_low=self.eps_low, eps_high=self.eps_high)
            LOSSES.check_params(self.loss, params)
            metrics = self.policy.train_step(
                batch,
                LOSSES.get(self.loss),
                loss_scale=loss_scale_for(self.loss),
                **params.kwargs(),
            )
            self.version += 1
        metrics.update(
            {
                "reward_mean": float(rbar.mean()),
                "weight_mean": float(w.mean()),
                "samples": float(len(keep)),
                "unreplayable": dropped,
            }
        )
        return metrics

    def update(
        self, items: Sequence[BufferItem], bank: ExperienceBank, step: int
    ) -> dict[str, float]:
        """CISPO step over ``items``; records the training counts in ``bank`` (see
        :func:`cispo_update`)."""
        return cispo_update(self.train, items, bank, step)

    # ------------------------------------------------------------------ the worker interface
    # (the same methods as crl_train.extractor.worker.ExtractorWorker, so the track takes either)
    alive = True
    """An in-process extractor cannot die without the trainer."""
    trainable = True
    """π_φ has weights: the service runs CISPO on it (the oracle's is False)."""

    def count_tokens(self, text: str) -> int:
        return len(self.policy.tokenizer.encode(text, add_special_tokens=False))

    def save(self, directory: str | Path) -> None:
        with self.lock:
            self.policy.save(directory)

    def load(self, directory: str | Path) -> None:
        with self.lock:
            self.policy.load(directory)

    def get_state(self) -> JSONDict:
        """Version and per-sample constraints (JSON-ready) for a checkpoint.

        Each distinct allowed set is written once in ``allowed_sets`` and the samples refer to it by
        index: a thinking sample's reasoning positions all allow the same few hundred ids. A grammar
        sample refers to its grammar, written once under ``constraints["grammar:<hash>"]``.
        """
        with self.lock:
            index: dict[tuple[int, ...], int] = {}
            refs: dict[str, Any] = {
                k: [None if a is None else index.setdefault(tuple(a), len(index)) for a in v]
                for k, v in self.constraints.items()
            }
            for k, g in self.grammars.items():
                gk = grammar_key(g)
                refs.setdefault(
                    gk,
                    {
                        "schema": g.schema,
                        "think_tokens": g.think_tokens,
                        "reasoning_end": g.reasoning_end,
                    },
                )
                refs[k] = gk
            return {
                "version": self.version,
                "allowed_sets": [list(a) for a in index],
                "constraints": refs,
            }

    def set_state(self, d: dict[str, Any]) -> None:
        """Inverse of :meth:`get_state` (also reads the older form with the sets written inline)."""
        with self.lock:
            sets = [tuple(int(i) for i in a) for a in d.get("allowed_sets", [])]

            def one(a: int | list[int] | None) -> tuple[int, ...] | None:
                if a is None:
                    return None
                if not isinstance(a, int):
                    return tuple(a)
                if not 0 <= a < len(sets):
                    raise ValueError(
                        f"extractor state: a constraint refers to allowed set {a}, "
                        f"but the state holds {len(sets)} sets (corrupt checkpoint?)"
                    )
                return sets[a]

            raw = d.get("constraints", {})
            specs = {
                k: JsonGrammar(
                    str(v["schema"]), int(v.get("think_tokens", 0)), v.get("reasoning_end")
                )
                for k, v in raw.items()
                if k.startswith(GRAMMAR_KEY)
            }
            grammars: dict[str, JsonGrammar] = {}
            constraints: dict[str, list[tuple[int, ...] | None]] = {}
            for k, v in raw.items():
                if k.startswith(GRAMMAR_KEY):
                    continue
                if isinstance(v, str):
                    if v not in specs:
                        raise ValueError(
                            f"extractor state: a sample refers to grammar {v!r}, which the state "
                            "does not hold (corrupt checkpoint?)"
                        )
                    grammars[k] = specs[v]
                else:
                    constraints[k] = [one(a) for a in v]
            # nothing changes on a bad state
            self.version, self.constraints, self.grammars = (
                int(d.get("version", 0)),
                constraints,
                grammars,
            )
            self._grammar_pool = {g: g for g in grammars.values()}

    def close(self) -> None:
        """Nothing to release in process (the worker's ``close`` stops its child)."""


def entry_counts(items: Sequence[BufferItem], bank: ExperienceBank) -> tuple[list[int], list[int]]:
    """``train_count`` and ``last_trained_step`` of each item's entry (0 / −1 when it has none)."""
    counts, lasts = [], []
    for it in items:
        e = bank.get(it.entry_id) if it.entry_id is not None else None
        counts.append(e.train_count if e is not None else 0)
        lasts.append(e.last_trained_step if e is not None else -1)
    return counts, lasts


def cispo_update(
    train: Callable[[Sequence[BufferItem], list[int], list[int], int], dict[str, float]],
    items: Sequence[BufferItem],
    bank: ExperienceBank,
    step: int,
) -> dict[str, float]:
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
