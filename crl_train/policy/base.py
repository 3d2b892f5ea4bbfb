"""The policy contract: what the trainer calls on an LLM backend, and the data it exchanges.

Conventions every backend follows (the trainer and the losses rely on them):

* **Alignment.** Every per-token tensor of a :class:`TrainBatch` is ``[B, T]`` and aligned with
  ``input_ids``: ``logprobs[b, t] = log p(input_ids[b, t] | input_ids[b, :t])``; position 0 (no
  prediction) and padding hold 0. Training batches are right-padded.
* **Which distribution.** Log-probs are of the *temperature-scaled* distribution
  ``log_softmax(masked_logits / temperature)`` — the one tokens are sampled from — where
  ``masked_logits`` has every token outside the allowed set of a constrained position set to
  ``-inf``. Top-p truncation is a sampler detail and is *not* part of the log-prob (so a ratio
  stays finite for any sampled token). ``Policy.logprobs`` recomputes exactly this, with the
  policy's own temperature and the batch's stored constraints, so the generation log-probs equal
  the recomputed ones for unchanged weights in float32; in 16 bits the two forwards round apart,
  and ``Policy.sampled_logprobs_exact`` says π_old must be recomputed.
* **Constraints** travel with the tokens: :attr:`Generation.allowed` holds, per response token,
  the sorted token ids that were allowed there (``None`` when unconstrained), and
  :class:`TokenSequence` turns them into ``{position: allowed ids}`` for training.

>>> seq = TokenSequence()
>>> seq.append_context([5, 6, 7])                    # prompt: not trained
>>> seq.append_generation(Generation(prompt_ids=[5, 6, 7], token_ids=[8, 2],
...                                  logprobs=[-0.5, -0.1], text="go"))
>>> seq.append_context([9])                           # observation: not trained
>>> seq.input_ids, seq.loss_mask, seq.old_logprobs
([5, 6, 7, 8, 2, 9], [0, 0, 0, 1, 1, 0], [0.0, 0.0, 0.0, -0.5, -0.1, 0.0])
>>> batch = TrainBatch.from_sequences([seq], advantages=[1.0], pad_token_id=0)
>>> tuple(batch.input_ids.shape), batch.num_tokens
((1, 6), 2)
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, TypeAlias, get_args, runtime_checkable

import torch

from crl_train.algorithms.registry import LOSSES, LossParams, PolicyLoss, PolicyLossFn
from crl_train.algorithms.registry import LossScale as LossScale

if TYPE_CHECKING:  # typing only: importing this module loads neither transformers nor llguidance
    from transformers import PreTrainedTokenizerBase

    from .chat import ChatFormatter
    from .grammar import JsonGrammar
    from .trie import ActionTrie, ThinkThenChoose

FinishReason = Literal["stop", "length"]

LossFn: TypeAlias = PolicyLossFn
"""``loss_fn(logprobs [B,T], old_logprobs [B,T], advantages [B] or [B,T], mask [B,T], **kw)
-> (scalar loss, metrics)`` (``crl_train.algorithms.registry.PolicyLossFn``); ``kw`` holds the
batch's ``group_ids`` / ``condition_ids`` when set, every tensor of ``TrainBatch.extra`` and the
caller's own keyword arguments. Every loss in ``crl_train.algorithms.LOSSES`` follows it."""

LOSS_SCALE_NAMES: tuple[LossScale, ...] = get_args(LossScale)

AllowedRow: TypeAlias = "ActionTrie | ThinkThenChoose | JsonGrammar | Sequence[str] | None"
"""What one prompt of ``Policy.generate(allowed=[...])`` may be restricted to: None (free text), a
token trie of actions, N free tokens then an action, a JSON grammar (the extractor's answers) or
the admissible action strings."""

SUPPORT_IDS = "support_ids"
"""``TrainBatch.extra`` key of a ``[B, T, k]`` long tensor: k token ids per position. A train step
then also hands the loss ``support_logprobs`` ``[B, T, k]``, the log-probs (with grad) of those ids
at each position under the tempered distribution without constraints (EDGE's top-k reverse KL);
aligned like ``logprobs``: position t is the distribution that predicts token t."""


@dataclass(frozen=True)
class SamplingConfig:
    """How a policy samples. The same ``temperature`` is used to recompute log-probs."""

    temperature: float = 1.0
    """Softmax temperature; must be > 0 (greedy decoding is ``greedy=True``, not 0)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; not part of the recorded log-probs."""
    greedy: bool = False
    """Take the arg-max token (log-probs are still those of the tempered distribution)."""
    stop: tuple[str, ...] = ()
    """Extra stop strings (e.g. ``"</action>"``); the text is cut after the first one."""
    seed: int | None = None
    """Seed of the policy's own sampling generator, created on first use and advanced by every
    call: a run is reproducible and successive calls still differ (None: the global torch RNG)."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"SamplingConfig.temperature must be > 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.stop, str):  # a bare string would be split into characters
            raise TypeError("SamplingConfig.stop must be a tuple of strings, not a str")


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer and micro-batching of ``train_step`` (paper: AdamW, lr 1e-6, no KL)."""

    lr: float = 1e-6
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Max global grad norm (0 disables clipping)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward; gradients accumulate over a batch's micro-batches."""
    loss_scale: LossScale = "samples"
    """Default weighting of a micro-batch loss so the accumulated gradient equals the full-batch
    one: ``samples`` (n_mb / B: the loss is a mean over sequences), ``tokens`` (mask tokens in the
    micro-batch / in the batch: a token-mean loss such as CISPO's) or ``none`` (the loss is a sum
    whose weights were normalised over the full batch by the caller). A ``train_step`` whose loss
    is scaled otherwise passes its own ``loss_scale`` (see :data:`LossScale`)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"OptimConfig.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"OptimConfig.weight_decay must be >= 0, got {self.weight_decay}")
        if self.grad_clip < 0:
            raise ValueError(f"OptimConfig.grad_clip must be >= 0, got {self.grad_clip}")
        if self.micro_batch_size < 1:
            raise ValueError(
                f"OptimConfig.micro_batch_size must be >= 1, got {self.micro_batch_size}"
            )
        if self.loss_scale not in LOSS_SCALE_NAMES:
            raise ValueError(
                "OptimConfig.loss_scale must be one of 'samples', 'tokens', 'none', got "
                f"{self.loss_scale!r}"
            )


@dataclass
class Generation:
    """One sampled response."""

    prompt_ids: list[int]
    """Token ids of the prompt (no padding)."""
    token_ids: list[int]
    """Sampled response ids, including the final EOS when ``finish_reason == "stop"`` by EOS."""
    logprobs: list[float]
    """Per response token, log-prob under the tempered (and constrained) distribution."""
    text: str
    """Decoded response without special tokens, cut at a stop string when one matched."""
    finish_reason: FinishReason = "stop"
    """``stop`` (EOS, stop string or completed constrained action) or ``length``."""
    allowed: list[tuple[int, ...] | None] | None = None
    """Per response token, the token ids that were allowed (None: unconstrained)."""

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"Generation.logprobs has {len(self.logprobs)} entries for "
                f"{len(self.token_ids)} tokens"
            )
        if self.allowed is not None and len(self.allowed) != len(self.token_ids):
            raise ValueError(
                f"Generation.allowed has {len(self.allowed)} entries for "
                f"{len(self.token_ids)} tokens"
            )


@dataclass
class TokenSequence:
    """A multi-turn token sequence under construction: context (masked) and
    generations (trained)."""

    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    old_logprobs: list[float] = field(default_factory=list)
    constraints: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Position -> allowed token ids, for constrained positions only."""

    def __len__(self) -> int:
        return len(self.input_ids)

    def append_context(self, ids: Sequence[int]) -> None:
        """Tokens the policy did not generate (prompt, observation, experience): never trained."""
        self.input_ids.extend(int(i) for i in ids)
        self.loss_mask.extend([0] * len(ids))
        self.old_logprobs.extend([0.0] * len(ids))

    def append_generation(self, gen: Generation) -> None:
        """The policy's own tokens, with the log-probs and constraints they were sampled under."""
        start = len(self.input_ids)
        self.input_ids.extend(gen.token_ids)
        self.loss_mask.extend([1] * len(gen.token_ids))
        self.old_logprobs.extend(float(x) for x in gen.logprobs)
        if gen.allowed is not None:
            for offset, allowed in enumerate(gen.allowed):
                if allowed is not None:
                    self.constraints[start + offset] = tuple(allowed)

    def truncated_left(self, keep: int) -> TokenSequence:
        """The last ``keep`` tokens (a context-length policy for long episodes)."""
        cut = max(0, len(self.input_ids) - keep)
        return TokenSequence(
            input_ids=self.input_ids[cut:],
            loss_mask=self.loss_mask[cut:],
            old_logprobs=self.old_logprobs[cut:],
            constraints={p - cut: a for p, a in self.constraints.items() if p >= cut},
        )


@dataclass
class TrainBatch:
    """A right-padded batch for ``Policy.logprobs`` / ``Policy.train_step``. Shapes in brackets."""

    input_ids: torch.Tensor
    """[B, T] long."""
    attention_mask: torch.Tensor
    """[B, T] long, 1 on real tokens."""
    loss_mask: torch.Tensor
    """[B, T] float, 1 on the agent's own tokens (the only ones trained)."""
    old_logprobs: torch.Tensor
    """[B, T] float, log-probs at sampling time (aligned as the module docstring says)."""
    advantages: torch.Tensor
    """[B] (one per sequence) or [B, T] (per token) float."""
    group_ids: torch.Tensor | None = None
    """[B] long: rollout group (task) of each sequence."""
    condition_ids: torch.Tensor | None = None
    """[B] long: 0 = guided, 1 = free (split-subgroup losses)."""
    constraints: list[dict[int, tuple[int, ...]]] | None = None
    """Per sequence, position -> allowed token ids; applied when log-probs are recomputed."""
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    """More per-sequence tensors (first dim B) passed to the loss by name, e.g. sample weights."""

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(
                f"TrainBatch.input_ids must be [B, T], got shape {tuple(self.input_ids.shape)}"
            )
        shape = tuple(self.input_ids.shape)
        for name in ("attention_mask", "loss_mask", "old_logprobs"):
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"TrainBatch.{name} has shape {got}, expected {shape}")
        if tuple(self.advantages.shape) not in (shape[:1], shape):
            raise ValueError(
                f"TrainBatch.advantages has shape {tuple(self.advantages.shape)}, expected "
                f"{shape[:1]} or {shape}"
            )
        for name in ("group_ids", "condition_ids"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape[:1]:
                raise ValueError(
                    f"TrainBatch.{name} has shape {tuple(value.shape)}, expected {shape[:1]}"
                )
        for name, value in self.extra.items():
            if value.shape[0] != shape[0]:
                raise ValueError(
                    f"TrainBatch.extra[{name!r}] has first dim {value.shape[0]}, "
                    f"expected {shape[0]}"
                )
        if self.constraints is not None and len(self.constraints) != shape[0]:
            raise ValueError(
                f"TrainBatch.constraints has {len(self.constraints)} entries for "
                f"{shape[0]} sequences"
            )

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Number of trained (loss-mask) tokens."""
        return int(self.loss_mask.sum().item())

    @classmethod
    def from_sequences(
        cls,
        sequences: Sequence[TokenSequence],
        advantages: Sequence[float] | torch.Tensor,
        pad_token_id: int,
        *,
        group_ids: Sequence[int] | None = None,
        condition_ids: Sequence[int] | None = None,
        extra: Mapping[str, Sequence[float] | torch.Tensor] | None = None,
    ) -> TrainBatch:
        """Right-pad ``sequences`` into tensors; ``advantages`` is one value per sequence."""
        if not sequences:
            raise ValueError("TrainBatch.from_sequences needs at least one sequence")
        if any(len(s) == 0 for s in sequences):
            raise ValueError("TrainBatch.from_sequences got an empty sequence")
        b, t = len(sequences), max(len(s) for s in sequences)
        input_ids = torch.full((b, t), pad_token_id, dtype=torch.long)
        attention = torch.zeros((b, t), dtype=torch.long)
        loss_mask = torch.zeros((b, t), dtype=torch.float32)
        old = torch.zeros((b, t), dtype=torch.float32)
        for i, s in enumerate(sequences):
            n = len(s)
            input_ids[i, :n] = torch.tensor(s.input_ids, dtype=torch.long)
            attention[i, :n] = 1
            loss_mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
            old[i, :n] = torch.tensor(s.old_logprobs, dtype=torch.float32)
        # Position 0 has no prediction: never train it even if a caller marked it.
        loss_mask[:, 0] = 0.0
        adv = torch.as_tensor(advantages, dtype=torch.float32)
        constraints = [dict(s.constraints) for s in sequences]
        return cls(
            input_ids=input_ids,
            attention_mask=attention,
            loss_mask=loss_mask,
            old_logprobs=old,
            advantages=adv,
            group_ids=None if group_ids is None else torch.as_tensor(group_ids, dtype=torch.long),
            condition_ids=None
            if condition_ids is None
            else torch.as_tensor(condition_ids, dtype=torch.long),
            constraints=constraints if any(constraints) else None,
            extra={k: torch.as_tensor(v) for k, v in (extra or {}).items()},
        )

    def trimmed(self) -> TrainBatch:
        """The same rows without the trailing columns no row attends to.

        A batch is padded to its longest sequence; a micro-batch of shorter ones needs only its own
        longest (attention costs grow with the square of the width). Per-token tensors — ``[B, T]``
        advantages and ``extra`` entries whose second dim is T — are cut alike.
        """
        width = self.input_ids.shape[1]
        used = self.attention_mask.any(0).nonzero()
        keep = int(used.max()) + 1 if used.numel() else width
        if keep >= width:
            return self

        def cut(x: torch.Tensor) -> torch.Tensor:
            return x[:, :keep] if x.dim() >= 2 and x.shape[1] == width else x

        return TrainBatch(
            input_ids=self.input_ids[:, :keep],
            attention_mask=self.attention_mask[:, :keep],
            loss_mask=self.loss_mask[:, :keep],
            old_logprobs=self.old_logprobs[:, :keep],
            advantages=cut(self.advantages),
            group_ids=self.group_ids,
            condition_ids=self.condition_ids,
            constraints=self.constraints,
            extra={k: cut(v) for k, v in self.extra.items()},
        )

    def select(self, index: slice | torch.Tensor) -> TrainBatch:
        """Rows ``index`` of every per-sequence field (micro-batching)."""
        rows = list(range(self.batch_size))[index] if isinstance(index, slice) else index.tolist()
        idx = torch.as_tensor(rows, dtype=torch.long)

        def pick(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.index_select(0, idx)

        return TrainBatch(
            input_ids=self.input_ids.index_select(0, idx),
            attention_mask=self.attention_mask.index_select(0, idx),
            loss_mask=self.loss_mask.index_select(0, idx),
            old_logprobs=self.old_logprobs.index_select(0, idx),
            advantages=self.advantages.index_select(0, idx),
            group_ids=pick(self.group_ids),
            condition_ids=pick(self.condition_ids),
            constraints=None if self.constraints is None else [self.constraints[r] for r in rows],
            extra={k: v.index_select(0, idx) for k, v in self.extra.items()},
        )


@dataclass
class LossTerm:
    """One term of an objective: ``loss_fn`` over ``batch``, micro-batch losses weighted by
    ``loss_scale``. :meth:`Policy.train_objective` adds the gradients of its terms and takes one
    optimizer step, so each term's gradient is its own full-batch one however it is split."""

    batch: TrainBatch
    loss_fn: LossFn
    loss_scale: LossScale | None = None
    """``None``: the policy's ``OptimConfig.loss_scale``."""
    kwargs: Mapping[str, object] = field(default_factory=dict)
    """The loss's own keyword arguments (``clip_eps``, ``coef`` …: a
    ``LossParams``'s ``kwargs()``)."""
    name: str | None = None
    """Reported as ``loss_<name>`` in the step's metrics (None: not reported on its own)."""

    @classmethod
    def registered(
        cls, batch: TrainBatch, loss: PolicyLoss, params: LossParams, name: str | None = None
    ) -> LossTerm:
        """The term of the loss registered as ``loss`` in ``LOSSES``, with its registered scale and
        ``params`` (``TypeError`` when they are not of the class registered with it)."""
        LOSSES.check_params(loss, params)
        return cls(batch, LOSSES.get(loss), LOSSES.scale(loss), params.kwargs(), name=name)


@runtime_checkable
class Generator(Protocol):
    """A fast generation engine behind a trained policy (``HFPolicy.attach_generator``): it samples,
    the policy trains and pushes its weights into it after every update.

    Implementations: :class:`crl_train.policy.vllm_engine.VLLMGenerator`.
    """

    @property
    def logprobs_exact(self) -> bool:
        """Whether returned log-probs follow this module's convention; when False the trainer
        recomputes π_old with the trained policy before an update."""
        ...

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        allowed: Sequence[AllowedRow] | None = None,
        *,
        sampling: SamplingConfig | None = None,
    ) -> list[Generation]:
        """As :meth:`Policy.generate`; ``allowed`` rows are None or a ``JsonGrammar`` (when
        :class:`StructuredGenerator`)."""
        ...

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load the trainer's weights; returns how many tensors were sent."""
        ...


@runtime_checkable
class StructuredGenerator(Generator, Protocol):
    """A generator that may also serve JSON-grammar rows (the extractor's structured answers)."""

    structured_outputs: bool
    """JSON-grammar requests are served (an engine may lack the feature at run time)."""
    reasoning_parser: str | None
    """The engine's reasoning parser: a grammar row of a thinking model starts
    after ``</think>``."""


@runtime_checkable
class Policy(Protocol):
    """An LLM that samples with log-probs and trains on masked tokens: every member the rollout,
    the trainer, the methods and the extractor use.

    Implementations: :class:`crl_train.policy.hf.HFPolicy` (training and generation; its
    unconstrained requests go to an attached :class:`Generator` such as
    :class:`~crl_train.policy.vllm_engine.VLLMGenerator` when one is attached).
    """

    name: str
    """Human-readable model name (the tiny preset says it is random-init)."""
    sampling: SamplingConfig
    """Default sampling; its temperature is the one log-probs are computed under."""
    pad_token_id: int
    """Id that pads a :class:`TrainBatch` (never trained on)."""
    eos_token_ids: list[int]
    """Ids that end a response, the tokenizer's EOS first (it ends constrained actions)."""
    tokenizer: PreTrainedTokenizerBase
    """The model's tokenizer (token counts, the vocabulary, the chat template)."""
    chat: ChatFormatter
    """The chat template: prompt ids and the ids that append a user turn."""
    prefix_cache: bool
    """Keep each ``cache_keys`` entry's keys/values between :meth:`generate` calls."""
    generator: Generator | None
    """The attached fast generator, or None (everything runs on this policy)."""

    @property
    def sampled_logprobs_exact(self) -> bool:
        """Whether :meth:`generate`'s log-probs are, bit for bit up to float rounding, the ones
        training computes for the same weights. When False (16-bit compute, an inexact generator),
        π_old must be recomputed with :meth:`logprobs` before an update
        (:func:`recompute_old_logprobs`)."""
        ...

    def apply_chat(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of ``messages`` rendered with the model's chat template."""
        ...

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        allowed: Sequence[AllowedRow] | None = None,
        *,
        sampling: SamplingConfig | None = None,
        cache_keys: Sequence[Hashable] | None = None,
    ) -> list[Generation]:
        """One response per prompt (token ids). ``allowed[i]`` restricts prompt ``i``
        (:data:`AllowedRow`). With ``prefix_cache`` on, ``cache_keys[i]`` names prompt i's
        conversation so a later prompt that extends it encodes only its new tokens (ignored when
        off): see :meth:`crl_train.policy.hf.HFPolicy.generate`."""
        ...

    def release_cache(self, keys: Iterable[Hashable] | None = None) -> None:
        """Drop the kept keys/values of ``keys`` (all when None)."""
        ...

    def replay_allowed(
        self, grammar: JsonGrammar, token_ids: Sequence[int]
    ) -> list[tuple[int, ...] | None]:
        """Per-token allowed ids of ``token_ids`` sampled under ``grammar`` (training a
        structured sample)."""
        ...

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, T] log-probs of ``batch.input_ids`` under the current weights (no grad), computed as
        a training step computes them; positions before the batch's first trained token (its
        ``loss_mask``) may hold 0."""
        ...

    def support_logprobs(
        self, batch: TrainBatch, *, k: int | None = None, ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [B, T, k], logprobs [B, T, k])`` under the current weights (no grad), aligned like
        :meth:`logprobs`: ``ids`` given, their log-probs; else the policy's own top-``k`` ids at
        each position. Tempered distribution without constraints; 0 at position 0 and on padding."""
        ...

    def train_step(
        self,
        batch: TrainBatch,
        loss_fn: LossFn,
        *,
        loss_scale: LossScale | None = None,
        **loss_kw: object,
    ) -> dict[str, float]:
        """Forward, loss, backward, grad clip, one optimizer step; returns metrics.

        ``loss_fn`` is called per micro-batch as :data:`LossFn` says, with ``loss_kw``; each
        micro-batch loss is weighted by ``loss_scale`` (``None``: ``OptimConfig.loss_scale``), so a
        loss gets the same gradient however the batch is split (a token-mean loss passes
        ``"tokens"``). The same as :meth:`train_objective` with one term."""
        ...

    def train_objective(self, terms: Sequence[LossTerm]) -> dict[str, float]:
        """One optimizer step on the sum of ``terms`` (e.g. EDGE's RL loss + λ · reverse KL):
        gradients accumulate term by term and micro-batch by micro-batch, then one clip and one
        step. Metrics: every term's loss metrics, ``loss`` (the sum) and ``loss_<name>`` per
        named term."""
        ...

    def save(self, directory: str | Path) -> None:
        """Model, tokenizer, optimizer state and step counter."""
        ...

    def load(self, directory: str | Path) -> None:
        """Restore what :meth:`save` wrote."""
        ...


def recompute_old_logprobs(policy: Policy, batch: TrainBatch) -> bool:
    """Set ``batch.old_logprobs`` to ``policy.logprobs(batch)`` on its trained tokens when the
    policy's sampled log-probs are not the training forward's (``Policy.sampled_logprobs_exact``),
    so the first epoch's ratio is 1; returns whether it did. Call it under the weights that sampled
    the batch."""
    if policy.sampled_logprobs_exact:
        return False
    with torch.no_grad():
        batch.old_logprobs = policy.logprobs(batch).detach() * batch.loss_mask.to(
            batch.old_logprobs.dtype
        )
    return True
