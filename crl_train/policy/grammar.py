"""Grammar-constrained decoding for the ``hf`` backend: JSON Schema answers through llguidance.

Why llguidance: it is the small Rust engine (one wheel, no dependency beyond the standard
library) behind vLLM's ``guidance`` structured-output backend and Hugging Face's own guidance
integration, it compiles a JSON Schema in about a millisecond and computes a token mask in tens of
microseconds on CPU, and because vLLM uses it too, a schema constrains a model the same way in
both backends (same tokenizer wrapper, same grammar text, hence the same masks — which is what
lets CISPO recompute log-probs of a vLLM sample exactly; see :meth:`GrammarEngine.replay`).

A :class:`JsonGrammar` is what a caller passes per prompt (``Policy.generate(allowed=[...])``):
the schema (JSON text, property order kept — it is the generation order), plus how the answer is
preceded: ``think_tokens`` free tokens (any non-special token, never EOS: the tiny preset's stand-in
for reasoning) or, for a real thinking model, free reasoning up to and including the
``reasoning_end`` token (``</think>``). Only the answer after the reasoning is constrained.

:class:`GrammarEngine` wraps one tokenizer (built once per policy) and starts a
:class:`GrammarState` per row; ``generate_batch`` asks each state for its allowed set, masks the
logits with it, samples, and advances the state. The allowed sets are the ones the policy records
(``Generation.allowed``), interned: one tuple (and one boolean mask) per distinct set.

>>> from crl_train.policy.tiny import train_tiny_tokenizer
>>> tok = train_tiny_tokenizer(['{"advice":"go"}'], vocab_size=300)
>>> engine = GrammarEngine(tok, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
>>> g = JsonGrammar.from_schema({"enum": ["yes", "no"]})
>>> state = engine.start(g)
>>> ids = tok.encode('"no"', add_special_tokens=False) + [tok.eos_token_id]
>>> for t in ids:
...     assert t in state.allowed()[0]
...     state.advance(t)
>>> state.accepting, state.action_of(ids)
(True, '"no"')
>>> engine.replay(g, ids) == [engine.start(g).allowed()[0], *engine.replay(g, ids)[1:]]
True
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from crl_gym.json_types import JSONDict

if TYPE_CHECKING:
    import llguidance
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

MAX_INTERNED = 4096
"""Distinct allowed sets kept per engine (a real vocabulary's sets are large; the cache is
cleared past this)."""


@dataclass(frozen=True)
class JsonGrammar:
    """An answer constrained to ``schema`` (a JSON Schema as JSON text), after its reasoning."""

    schema: str
    """The JSON Schema, as JSON text (hashable and picklable; key order is the generation order)."""
    think_tokens: int = 0
    """Free tokens before the answer (tiny preset): any non-special token, never EOS."""
    reasoning_end: int | None = None
    """Token id that ends a thinking model's free reasoning (``</think>``); None: the answer
    starts at once."""

    def __post_init__(self) -> None:
        if self.think_tokens < 0:
            raise ValueError(f"JsonGrammar: think_tokens must be >= 0, got {self.think_tokens}")
        if self.think_tokens and self.reasoning_end is not None:
            raise ValueError(
                "JsonGrammar: think_tokens and reasoning_end are two kinds of reasoning; give one"
            )

    @classmethod
    def from_schema(
        cls, schema: Mapping[str, Any], *, think_tokens: int = 0, reasoning_end: int | None = None
    ) -> JsonGrammar:
        return cls(json.dumps(schema, separators=(",", ":")), think_tokens, reasoning_end)

    def schema_dict(self) -> JSONDict:
        out: dict[str, Any] = json.loads(self.schema)
        return out

    @property
    def reasons(self) -> bool:
        """True when free tokens come before the constrained answer."""
        return bool(self.think_tokens) or self.reasoning_end is not None


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError as exc:  # pragma: no cover - a declared dependency of the train extra
        raise ImportError(
            "structured generation needs llguidance: pip install 'complementary-rl[train]'"
        ) from exc
    return llguidance


@dataclass
class _Interned:
    ids: tuple[int, ...]
    mask: torch.Tensor


class GrammarEngine:
    """llguidance's view of one tokenizer, the grammars compiled for it, and the interned masks.

    Args:
        tokenizer: a fast HF tokenizer.
        vocab_size: width of the model's logits (masks are this long; ids past the tokenizer are
            never allowed).
        eos_token_id: the EOS that ends an answer (the tokenizer's; vLLM's guidance backend uses
            the same).
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, *, vocab_size: int, eos_token_id: int
    ) -> None:
        llg = _llguidance()
        self._llg = llg
        self.vocab_size = int(vocab_size)
        self.eos_token_id = int(eos_token_id)
        t0 = time.perf_counter()
        self.ll_tokenizer = llg.hf.from_tokenizer(
            tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_id
        )
        self.tokenizer_s = time.perf_counter() - t0
        """Seconds spent wrapping the tokenizer (once per engine)."""
        self.tokenizer = tokenizer
        special = {int(i) for i in getattr(tokenizer, "all_special_ids", [])} | {self.eos_token_id}
        n = min(len(tokenizer), self.vocab_size)
        self.free_ids: tuple[int, ...] = tuple(i for i in range(n) if i not in special)
        """Token ids a ``think_tokens`` reasoning position allows (every non-special one)."""
        self._free = self._intern_ids(self.free_ids)
        self._grammars: dict[str, str] = {}
        self._sets: dict[bytes, _Interned] = {}
        self.compile_s = 0.0
        """Seconds spent compiling schemas (each schema is compiled once)."""
        self.compiled = 0

    # ---------------------------------------------------------------- grammars
    def grammar_text(self, grammar: JsonGrammar) -> str:
        """llguidance's grammar for ``grammar.schema`` (compiled and checked once per schema)."""
        text = self._grammars.get(grammar.schema)
        if text is None:
            t0 = time.perf_counter()
            text = self._llg.LLMatcher.grammar_from_json_schema(grammar.schema)
            err = self._llg.LLMatcher.validate_grammar(text, self.ll_tokenizer)
            self.compile_s += time.perf_counter() - t0
            if err and not err.startswith("WARNING"):
                raise ValueError(f"JSON schema does not compile to a grammar: {err}")
            if len(self._grammars) > 1024:
                self._grammars.clear()
            self._grammars[grammar.schema] = text
            self.compiled += 1
        return text

    def start(self, grammar: JsonGrammar) -> GrammarState:
        """A fresh state for one row of a generation."""
        text = self.grammar_text(grammar)
        t0 = time.perf_counter()
        matcher = self._llg.LLMatcher(self.ll_tokenizer, text, log_level=0)
        self.compile_s += time.perf_counter() - t0
        if matcher.is_error():
            raise ValueError(f"grammar matcher failed to start: {matcher.get_error()}")
        return GrammarState(self, grammar, matcher)

    def replay(
        self, grammar: JsonGrammar, token_ids: Sequence[int]
    ) -> list[tuple[int, ...] | None]:
        """The allowed set of every position of ``token_ids`` sampled under ``grammar`` (None where
        the reasoning was free): the masks of sampling time, recomputed (llguidance is
        deterministic), so training applies exactly the constraint the tokens were drawn under.

        Raises ValueError when a token was not allowed where it stands (it was not drawn under
        this grammar).
        """
        state = self.start(grammar)
        out: list[tuple[int, ...] | None] = []
        for pos, tok in enumerate(token_ids):
            a = state.allowed()
            if a is not None and not (0 <= int(tok) < self.vocab_size and bool(a[1][int(tok)])):
                raise ValueError(
                    f"replay: token {int(tok)} at position {pos} is not allowed by its grammar"
                )
            out.append(None if a is None else a[0])
            if (
                pos < len(token_ids) - 1
            ):  # the last token (EOS, or where the budget ended) changes nothing after it
                state.advance(int(tok))
        return out

    # ---------------------------------------------------------------- masks
    def _intern_ids(self, ids: Sequence[int]) -> _Interned:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[list(ids)] = True
        return _Interned(tuple(int(i) for i in ids), mask)

    def _interned(self, bitmask: np.ndarray) -> _Interned:
        key = bitmask.tobytes()
        hit = self._sets.get(key)
        if hit is None:
            bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[
                : self.vocab_size
            ].astype(bool)
            ids = np.flatnonzero(bits)
            if (
                ids.size == 0
            ):  # llguidance gives EOS at least (when stopped or in error): never an empty set
                raise ValueError("grammar: the mask allows no token")
            hit = _Interned(tuple(ids.tolist()), torch.from_numpy(bits))
            if len(self._sets) >= MAX_INTERNED:
                self._sets.clear()
            self._sets[key] = hit
        return hit


@dataclass
class GrammarState:
    """One row's progress: its reasoning, then llguidance's matcher over the answer."""

    engine: GrammarEngine
    grammar: JsonGrammar
    matcher: llguidance.LLMatcher
    position: int = 0
    reasoned: bool = False
    """A ``reasoning_end`` row: True once the reasoning-end token was sampled."""
    _bitmask: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._bitmask = np.full(((self.engine.vocab_size + 31) // 32,), -1, dtype=np.int32)
        if not self.grammar.think_tokens and self.grammar.reasoning_end is None:
            self.reasoned = True

    @property
    def eos_token_id(self) -> int:
        return self.engine.eos_token_id

    @property
    def in_answer(self) -> bool:
        """True once the reasoning is over and the grammar applies."""
        if self.grammar.think_tokens:
            return self.position >= self.grammar.think_tokens
        return self.reasoned

    @property
    def accepting(self) -> bool:
        """True when the answer so far is complete (EOS may follow)."""
        return self.in_answer and bool(self.matcher.is_accepting())

    def allowed(self) -> tuple[tuple[int, ...], torch.Tensor] | None:
        """The allowed ids (sorted tuple) and boolean mask [V] of the next token; None = free."""
        if not self.in_answer:
            if self.grammar.think_tokens:
                return self.engine._free.ids, self.engine._free.mask
            return None
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        hit = self.engine._interned(self._bitmask)
        return hit.ids, hit.mask

    def advance(self, token: int) -> None:
        """Consume a sampled token; raises when the grammar did not allow it."""
        answering = self.in_answer
        self.position += 1
        if not answering:
            if self.grammar.reasoning_end is not None and token == self.grammar.reasoning_end:
                self.reasoned = True
            return
        if not self.matcher.consume_token(int(token)):
            raise ValueError(
                f"token {int(token)} is not allowed by the grammar: {self.matcher.get_error()}"
            )

    def action_of(self, ids: Sequence[int]) -> str | None:
        """The answer's text once complete (a ``think_tokens`` row: without its reasoning);
        None before."""
        if not self.accepting:
            return None
        body = [int(i) for i in ids]
        if body and body[-1] == self.eos_token_id:
            body = body[:-1]
        if self.grammar.think_tokens:
            body = body[self.grammar.think_tokens :]
        return str(self.engine.tokenizer.decode(body, skip_special_tokens=True))


__all__ = ["GrammarEngine", "GrammarState", "JsonGrammar"]
