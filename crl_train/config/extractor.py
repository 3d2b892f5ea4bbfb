"""What π_φ's :class:`~crl_train.extractor.Extractor` needs beyond its model:
:class:`ExtractorSettings`.

The one source of the extractor's defaults: the Extractor reads nothing else (``Extractor(policy,
settings)``), the worker's :class:`~crl_train.extractor.ExtractorSpec` carries it across the
process boundary, and the service build derives it from a run's config
(:meth:`ExtractorSettings.from_config`). Each default is the config field's it mirrors, so a
config, a spec and an Extractor built by hand agree.

>>> s = ExtractorSettings.for_model(ModelConfig(model="tiny", max_new_tokens=8))
>>> s.max_new_tokens, s.max_entry_chars, s.structured
(8, 64, True)
>>> ExtractorSettings(max_ops=0)
Traceback (most recent call last):
...
ValueError: ExtractorSettings: max_ops must be >= 1, got 0
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, get_args

from crl_gym.experience.ops import DEFAULT_MAX_LEN
from crl_gym.experience.schemas import MAX_ACTION_SLOT
from crl_train.config.algo import AlgoConfig
from crl_train.config.experience import ExperienceConfig
from crl_train.config.model import ModelConfig
from crl_train.config.names import CispoNormalisation, ModelKind

if TYPE_CHECKING:
    from crl_train.config.run import TrainConfig

TINY_ENTRY_CHARS = 64
"""Longest entry the tiny preset's extractor writes: its text is random, and short entries keep the
actor's guided prompts (and the merge windows) small."""
EXTRACTOR_MAX_NEW_TOKENS = 96
"""The extractor's answer budget by default (``extractor.max_new_tokens``; the actor's is 64)."""


@dataclass(frozen=True)
class ExtractorSettings:
    """The Extractor's budgets, answer form and CISPO hyper-parameters (each from a config key)."""

    max_new_tokens: int = EXTRACTOR_MAX_NEW_TOKENS
    """Token budget of an answer (``extractor.max_new_tokens``; a structured one gets at least its
    schema's longest answer; ``think_tokens`` come on top)."""
    max_context_tokens: int = ModelConfig.max_context_tokens
    """Prompt + answer (``extractor.max_context_tokens``); a prompt keeps its end."""
    max_prompt_chars: int = ExperienceConfig.max_prompt_chars
    """Characters of the distillation / refinement prompt (``experience.max_prompt_chars``)."""
    structured: bool = ModelConfig.structured
    """Generate every answer under its task's schema (``extractor.structured``)."""
    constrained: bool = ModelConfig.constrained
    """The model cannot write an answer on its own (the tiny preset); needs ``structured``."""
    think_tokens: int = ModelConfig.think_tokens
    """Free reasoning tokens before a structured distillation answer
    (``extractor.think_tokens``)."""
    max_entry_chars: int = DEFAULT_MAX_LEN
    """Longest entry text (and refined advice) a schema allows (``experience.max_entry_chars``;
    :data:`TINY_ENTRY_CHARS` for the tiny extractor when the config leaves it null)."""
    max_ops: int = ExperienceConfig.max_ops
    """Most operations in one distillation answer (``experience.max_ops``)."""
    action_slot: int = ExperienceConfig.action_slot
    """N > 0: a distillation answer chooses up to N of its episode's admissible actions before each
    entry's text (``experience.action_slot``); 0 = off."""
    thinking: bool | None = None
    """Whether the model reasons before answering (``</think>``); None = detect it."""
    eps_low: float = AlgoConfig.cispo_eps_low
    """CISPO's lower clip of the IS weight (``algo.cispo_eps_low``)."""
    eps_high: float = AlgoConfig.cispo_eps_high
    """CISPO's upper clip of the IS weight (``algo.cispo_eps_high``)."""
    cooldown: int = AlgoConfig.cooldown
    """δ of the training-count weight (``algo.cooldown``)."""
    alpha: float = AlgoConfig.count_alpha
    """α of the training-count weight (``algo.count_alpha``)."""
    normalisation: CispoNormalisation = AlgoConfig.cispo_normalisation
    """CISPO's normaliser, ``tokens`` (Eq. 3) or ``sequences`` (``algo.cispo_normalisation``)."""

    def __post_init__(self) -> None:
        def bad(text: str) -> ValueError:
            return ValueError(f"ExtractorSettings: {text}")

        if self.constrained and not self.structured:
            raise bad(
                "constrained=True (a model that cannot write an answer on its own) needs "
                "structured=True: its answers are generated under their schemas"
            )
        if self.think_tokens < 0 or (self.think_tokens and not self.structured):
            raise bad(
                f"think_tokens={self.think_tokens} needs structured=True and must be >= 0 "
                "(the free tokens precede a structured answer; a free-text model reasons on "
                "its own)"
            )
        for name in (
            "max_new_tokens",
            "max_context_tokens",
            "max_prompt_chars",
            "max_entry_chars",
            "max_ops",
        ):
            if getattr(self, name) < 1:
                raise bad(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.action_slot <= MAX_ACTION_SLOT:
            raise bad(f"action_slot must be in [0, {MAX_ACTION_SLOT}], got {self.action_slot}")
        if self.normalisation not in get_args(CispoNormalisation):
            raise bad(
                f"normalisation must be one of {get_args(CispoNormalisation)}, "
                f"got {self.normalisation!r}"
            )

    @classmethod
    def for_model(cls, model: ModelConfig) -> ExtractorSettings:
        """The defaults for ``model``: its budgets and answer form; short entries for ``tiny``."""
        return cls(
            max_new_tokens=model.max_new_tokens,
            max_context_tokens=model.max_context_tokens,
            structured=model.structured,
            constrained=model.constrained,
            think_tokens=model.think_tokens,
            max_entry_chars=TINY_ENTRY_CHARS if model.kind is ModelKind.TINY else DEFAULT_MAX_LEN,
        )

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> ExtractorSettings:
        """The settings of a run: ``cfg.extractor``, the experience and CISPO keys."""
        exp, algo = cfg.experience, cfg.algo
        base = cls.for_model(cfg.extractor)
        return replace(
            base,
            max_prompt_chars=exp.max_prompt_chars,
            max_ops=exp.max_ops,
            action_slot=exp.action_slot,
            max_entry_chars=base.max_entry_chars
            if exp.max_entry_chars is None
            else exp.max_entry_chars,
            eps_low=algo.cispo_eps_low,
            eps_high=algo.cispo_eps_high,
            cooldown=algo.cooldown,
            alpha=algo.count_alpha,
            normalisation=algo.cispo_normalisation,
        )


__all__ = ["EXTRACTOR_MAX_NEW_TOKENS", "TINY_ENTRY_CHARS", "ExtractorSettings"]
