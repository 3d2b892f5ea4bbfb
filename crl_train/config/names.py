"""The names of the methods and of every other choice a config makes: each list stated once.

The config validates its fields against these (``Literal`` annotations, checked generically by
:func:`crl_train.config.io.check_choices`); the consumers import the same names.
"""

from enum import StrEnum
from typing import Literal, get_args


class MethodName(StrEnum):
    GRPO = "grpo"
    """Plain GRPO: no experience (the paper's baseline)."""
    COMPLEMENTARY = "complementary"
    """Complementary RL: split-subgroup GRPO for the actor, CISPO for the extractor."""
    STATIC_ONLINE = "static_online"
    """The bank grows online, but the extractor is never trained."""
    EXP_ONLY = "exp_only"
    """Frozen actor; only the extractor learns."""
    OFFLINE_EXP = "offline_exp"
    """A bank built once before training, then frozen."""
    EDGE = "edge"
    """EDGE: gain-gated teacher rollouts, pooled advantages, reverse-KL distillation,
    utility pruning."""


class ModelKind(StrEnum):
    """What ``actor.model`` / ``extractor.model`` names: one of the built-in kinds, or a model
    to load."""

    TINY = "tiny"
    """A random-init small Qwen2 with a tokenizer trained on the env texts."""
    ORACLE = "oracle"
    """Extractor only: no model, each successful episode's actions become one entry
    (``crl_train.extractor.oracle``)."""
    READER = "reader"
    """Actor only: no model, it plays the actions its experience names
    (``crl_train.policy.reader``)."""
    LOADED = "loaded"
    """Any other name: a packaged model, a ``.gguf`` file, an HF id or a local path (never
    written in a config)."""


def model_kind(model: str) -> ModelKind:
    """The kind of the model a config names (:attr:`ModelKind.LOADED` for every name that is not
    a kind's).

    >>> model_kind("tiny"), model_kind("Qwen/Qwen3-4B")
    (<ModelKind.TINY: 'tiny'>, <ModelKind.LOADED: 'loaded'>)
    """
    try:
        kind = ModelKind(model)
    except ValueError:
        return ModelKind.LOADED
    return ModelKind.LOADED if kind is ModelKind.LOADED else kind


CispoNormalisation = Literal["tokens", "sequences"]
"""CISPO's normaliser: Σ_i |m_i| over the batch (Eq. 3, ``tokens``), or each sample's own token
count, then the mean over samples (``sequences``)."""
EntryReward = Literal["direct", "relative"]
"""r(m) of a guided episode: ±1 by its success, or that minus its group's free-subgroup mean ±1."""
PerplexityTransform = Literal["relative", "tanh", "sigmoid", "asymmetric", "log"]
"""The five normalisations f of the perplexity-reduction bonus (the paper's appendix B.2)."""
PerplexityChoice = Literal["off", PerplexityTransform]
"""The perplexity bonus's setting: ``off`` or one of :data:`PerplexityTransform`."""
KLEstimator = Literal["topk", "sampled"]
"""EDGE's reverse KL: over the student's top-k tokens, or its sampled-token estimate."""

PERPLEXITY_TRANSFORMS: tuple[str, ...] = get_args(PerplexityTransform)
"""The values of :data:`PerplexityTransform`."""
