"""Decorator registries keyed by ``str`` Enums (verl ``core_algos`` style), each with the type of
what it holds: :class:`AdvantageFn` in ``ADVANTAGES``; :class:`PolicyLossFn` in ``LOSSES``, each
loss registered together with its :data:`LossScale` and its :class:`LossParams` (adding a loss is
its function, its parameters' dataclass and one decorator).

>>> from crl_train.algorithms.registry import ADVANTAGES, AdvantageEstimator
>>> sorted(e.value for e in ADVANTAGES.names())
['edge_pooled', 'grpo', 'split_subgroup']
>>> from crl_train.algorithms.registry import LOSSES
>>> sorted(e.value for e in LOSSES.names())
['cispo', 'cispo_sequences', 'clip', 'reverse_kl_sampled', 'reverse_kl_topk', 'self_distill_nll']
>>> LOSSES.scale("cispo")
'tokens'
>>> LOSSES.params_type("clip")(clip_eps=0.1).kwargs()
{'clip_eps': 0.1, 'ratio_level': 'token'}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from enum import Enum, StrEnum
from typing import Any, Generic, Literal, Protocol, TypeVar, get_args

import torch

K = TypeVar("K", bound=Enum)
F = TypeVar("F", bound=Callable[..., Any])

LossScale = Literal["samples", "tokens", "none"]
"""How ``train_step`` weights each micro-batch loss so the accumulated gradient is the full-batch
one: ``samples`` (n_mb / B: the loss is a mean over sequences), ``tokens`` (mask tokens in the
micro-batch / in the batch: the loss is a mean over the mask's tokens) or ``none`` (the loss is a
sum whose weights the caller normalised over the full batch). ``OptimConfig.loss_scale`` is a
policy's default; ``train_step(..., loss_scale=...)`` overrides it for one call."""


@dataclass(frozen=True)
class Keywords:
    """Hyper-parameters passed to a registered function as keyword arguments, one per field."""

    def kwargs(self) -> dict[str, Any]:
        """The fields as the function's keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class LossParams(Keywords):
    """A loss's hyper-parameters: the keyword arguments it takes besides the batch's tensors. Each
    loss registers a frozen subclass whose fields are those keywords (this base: a loss
    without any)."""


class PolicyLossFn(Protocol):
    """``loss_fn(logprobs [B,T], old_logprobs [B,T], advantages [B] or [B,T], mask [B,T], **kw)
    -> (scalar loss, metrics)`` (the calling convention of :mod:`crl_train.algorithms.losses`)."""

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        /,
        *args: Any,
        **kw: Any,
    ) -> tuple[torch.Tensor, Mapping[str, float]]: ...


class AdvantageFn(Protocol):
    """``estimator(rewards [N], group_index [N], condition [N] | None, *, valid, eps, unbiased)
    -> Â [N]``."""

    def __call__(
        self,
        rewards: torch.Tensor,
        group_index: torch.Tensor,
        condition: torch.Tensor | None = None,
        /,
        *,
        valid: torch.Tensor | None = None,
        eps: float = ...,
        unbiased: bool = ...,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class AdvantageParams(Keywords):
    """The keywords every estimator takes besides the batch's tensors; an estimator with more
    (EDGE's gate ``threshold``) has a subclass that adds them.

    >>> AdvantageParams(eps=1e-4).kwargs()
    {'eps': 0.0001, 'unbiased': False}
    """

    eps: float = 1e-6
    """Added to the std."""
    unbiased: bool = False
    """Bessel-corrected std instead of the population std."""


class AdvantageEstimator(StrEnum):
    """How trajectory rewards become advantages."""

    GRPO = "grpo"
    """One group of K: Â = (r − mean) / (std + ε)."""
    SPLIT_SUBGROUP = "split_subgroup"
    """Complementary RL Eq. 5: normalise inside each (group, condition) subgroup."""
    EDGE_POOLED = "edge_pooled"
    """EDGE: pooled over teacher + student when the gain gate is open, else student-only GRPO."""


class PolicyLoss(StrEnum):
    """Losses over per-token log-probs, all called as
    ``loss_fn(logprobs, old_logprobs, advantages, mask, **kw) -> (loss, metrics)``
    (see :mod:`crl_train.algorithms.losses`)."""

    CLIP = "clip"
    """PPO/GRPO clipped surrogate (actor)."""
    CISPO = "cispo"
    """Clipped IS-weight policy optimisation (extractor, Eq. 3)."""
    CISPO_SEQUENCES = "cispo_sequences"
    """CISPO with each sample's tokens averaged first, then the samples (an option; Eq. 3
    is ``cispo``)."""
    REVERSE_KL_SAMPLED = "reverse_kl_sampled"
    """EDGE reverse-KL distillation, sampled-token estimator (needs only per-token log-probs)."""
    REVERSE_KL_TOPK = "reverse_kl_topk"
    """EDGE reverse-KL distillation over the student's top-k tokens (log-probs of a
    per-position support)."""
    SELF_DISTILL_NLL = "self_distill_nll"
    """Next-token NLL on winning guided trajectories with the experience stripped."""


class Registry(Generic[K, F]):
    """A name → function table whose keys are members of one ``str`` Enum."""

    def __init__(self, keys: type[K], what: str) -> None:
        self._keys = keys
        self._what = what
        self._table: dict[K, F] = {}

    def register(self, name: K) -> Callable[[F], F]:
        """Decorator: ``@REG.register(Key.X)`` adds the function under ``Key.X``."""

        def deco(fn: F) -> F:
            if name in self._table:
                raise ValueError(f"{self._what} {name.value!r} registered twice")
            self._table[name] = fn
            return fn

        return deco

    def get(self, name: K | str) -> F:
        """The function registered under ``name`` (an Enum member or its string value)."""
        try:
            key = self._keys(name)
        except ValueError:
            accepted = ", ".join(k.value for k in self._keys)
            raise KeyError(f"unknown {self._what} {name!r}; accepted: {accepted}") from None
        if key not in self._table:
            raise KeyError(f"{self._what} {key.value!r} is declared but not registered")
        return self._table[key]

    def names(self) -> list[K]:
        return list(self._table)


class LossRegistry(Registry[PolicyLoss, PolicyLossFn]):
    """The losses, each registered with the :data:`LossScale` a train step must use for it and the
    :class:`LossParams` subclass of its hyper-parameters."""

    def __init__(self) -> None:
        super().__init__(PolicyLoss, "policy loss")
        self._scales: dict[PolicyLoss, LossScale] = {}
        self._params: dict[PolicyLoss, type[LossParams]] = {}

    def register(
        self,
        name: PolicyLoss,
        *,
        scale: LossScale | None = None,
        params: type[LossParams] = LossParams,
    ) -> Callable[[PolicyLossFn], PolicyLossFn]:
        """Decorator: ``@LOSSES.register(PolicyLoss.X, scale="tokens", params=XParams)`` adds the
        loss, its scale and the dataclass of its hyper-parameters."""
        if scale is None or scale not in get_args(LossScale):
            raise ValueError(
                f"policy loss {name.value!r} is registered with its loss scale "
                f"('samples', 'tokens' or 'none'), got {scale!r}"
            )
        add = super().register(name)
        checked: LossScale = scale

        if not (isinstance(params, type) and issubclass(params, LossParams)):
            raise TypeError(
                f"policy loss {name.value!r}: params must be a LossParams subclass, got {params!r}"
            )

        def deco(fn: PolicyLossFn) -> PolicyLossFn:
            add(fn)
            self._scales[name] = checked
            self._params[name] = params
            return fn

        return deco

    def scale(self, name: PolicyLoss | str) -> LossScale:
        """The loss scale registered with ``name`` (``KeyError`` naming the accepted losses for
        an unknown one)."""
        self.get(name)
        return self._scales[PolicyLoss(name)]

    def params_type(self, name: PolicyLoss | str) -> type[LossParams]:
        """The :class:`LossParams` subclass registered with ``name``."""
        self.get(name)
        return self._params[PolicyLoss(name)]

    def check_params(self, name: PolicyLoss | str, params: LossParams) -> None:
        """``TypeError`` unless ``params`` is an instance of the class registered with ``name``."""
        want = self.params_type(name)
        if type(params) is not want:
            raise TypeError(
                f"policy loss {PolicyLoss(name).value!r} takes {want.__name__}, got "
                f"{type(params).__name__}"
            )


ADVANTAGES: Registry[AdvantageEstimator, AdvantageFn] = Registry(
    AdvantageEstimator, "advantage estimator"
)
LOSSES = LossRegistry()
