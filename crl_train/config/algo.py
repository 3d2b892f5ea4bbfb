"""The ``algo`` section: the objectives of both models and the optional components' settings
(``algo.gate``, ``algo.perplexity``, ``algo.edge``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from crl_train.config.io import ConfigError, check_choices, renamed_attribute
from crl_train.config.names import CispoNormalisation, EntryReward, KLEstimator, PerplexityChoice


def _at_least(obj: object, prefix: str, low: float, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < low:
            raise ConfigError(f"{prefix}.{name} must be >= {low:g}, got {getattr(obj, name)}")


@dataclass(frozen=True)
class GateConfig:
    """Actor-critic gate (appendix B.1; off by default, as in the paper)."""

    enabled: bool = False
    """Before each guided episode the actor judges its entry, knowing the task and its own success
    rate: accept (used as is, s_c = 1), refine (the actor rewrites it, 0.5) or reject (the episode
    runs without it, 0); r̃(m) = s_c + r(m)."""
    warmup_steps: int = 2
    """T_warm: rollout steps that establish the actor's success rate per task before the gate
    judges."""
    rewrite_tokens: int = 48
    """Tokens of the actor's rewrite of an entry it refines."""

    def __post_init__(self) -> None:
        _at_least(self, "algo.gate", 0, "warmup_steps", "rewrite_tokens")


@dataclass(frozen=True)
class PerplexityConfig:
    """Perplexity-reduction bonus of the extractor (appendix B.2; off by default: the paper found no
    consistent gain): b = w·f(ΔH(m)) added to r(m), ΔH(m) = the actor's entropy on the task without
    the entry minus with it (sampled-token estimate from the rollout)."""

    transform: PerplexityChoice = "off"
    """f: one of the paper's five transforms (``crl_train.algorithms.perplexity_bonus``), or
    ``off``."""
    weight: float = 0.1
    """w of the bonus."""
    temperature: float = 1.0
    """τ of the ``sigmoid`` transform."""
    clip: float = 1.0
    """Upper clip of ``relative`` / ``asymmetric`` (and lower clip of ``relative``)."""
    clip_negative: float = 0.1
    """Lower clip (magnitude) of ``asymmetric``: a small penalty for entries that raise the entropy.
    """

    def __post_init__(self) -> None:
        check_choices(self, "algo.perplexity")
        _at_least(self, "algo.perplexity", 0, "weight", "clip", "clip_negative")
        if not self.temperature > 0:
            raise ConfigError(f"algo.perplexity.temperature must be > 0, got {self.temperature}")


@dataclass(frozen=True)
class EdgeConfig:
    """EDGE (method ``edge``): the gain gate, the entries' utility and pruning, reflection, the
    near-duplicate refusal and the reverse-KL distillation term."""

    threshold: float = 0.0
    """The gate opens when Δe > this."""
    ema: float = 0.9
    """β: EMA momentum of entry utility."""
    prune: float = -0.2
    """η: entries whose EMA utility falls below it are pruned."""
    reflect_below: float = 0.5
    """ξ: a task category (``info["task_category"]``, else the env id) whose success rate in a step
    is below it makes the extractor reflect on its failed and successful episodes."""
    reflection_entries: int = 3
    """Most new entries the reflections of one step add (the EDGE summary: up to three)."""
    dedup_similarity: float | None = 0.95
    """A new entry whose embedding has cosine similarity ≥ this to one in the bank is refused
    (counted in ``refused``); null switches the refusal off. Other methods:
    ``manager.dedup_similarity``."""
    kl_weight: float = 0.1
    """λ, weight of the reverse-KL distillation term, added to the RL loss of the same update
    (the EDGE summary reports that λ = 1 lets distillation dominate the RL signal)."""
    kl_estimator: KLEstimator = "topk"
    """The reverse KL over the student's top-k tokens per position (``topk``, EDGE's) or its
    sampled-token estimate (``sampled``: one teacher log-prob per token, cheaper on a large
    vocabulary)."""
    top_k: int = 20
    """k of the ``topk`` reverse KL."""

    def __post_init__(self) -> None:
        check_choices(self, "algo.edge")
        _at_least(self, "algo.edge", 0, "kl_weight", "reflection_entries")
        _at_least(self, "algo.edge", 1, "top_k")
        if self.dedup_similarity is not None and not -1.0 <= self.dedup_similarity <= 1.0:
            raise ConfigError(
                "algo.edge.dedup_similarity must be in [-1, 1] or null, got "
                f"{self.dedup_similarity}"
            )
        if not 0.0 <= self.reflect_below <= 1.0:
            raise ConfigError(
                f"algo.edge.reflect_below must be in [0, 1], got {self.reflect_below}"
            )
        if not 0 <= self.ema <= 1:
            raise ConfigError(f"algo.edge.ema must be in [0, 1], got {self.ema}")


@dataclass(frozen=True)
class AlgoConfig:
    """Objectives of both models (paper defaults); the optional components' settings in their own
    sections."""

    ratio_level: Literal["token", "sequence"] = "sequence"
    """Actor IS ratio: per token, or per trajectory length-normalised (Eq. 5)."""
    clip_eps: float = 0.2
    """Actor clip ε (paper: 0.2)."""
    adv_eps: float = 1e-6
    """ε in Â = (r − mean_c)/(std_c + ε)."""
    std_unbiased: bool = False
    """Use the unbiased std in advantages (default: population std, see ``advantages.py``)."""
    cispo_eps_low: float = 0.1
    """CISPO lower clip of the IS weight (paper: 0.1)."""
    cispo_eps_high: float = 0.1
    """CISPO upper clip of the IS weight (paper: 0.1)."""
    cispo_normalisation: CispoNormalisation = "tokens"
    """CISPO's normaliser: ``tokens`` divides by Σ_i |m_i| over the batch (the paper's Eq. 3);
    ``sequences`` averages each sample over its own tokens, then the samples (an option: long
    answers no longer take a larger share of the push, e.g. toward short Returns when most
    advantages are negative)."""
    buffer_size: int = 64
    """|B_φ| that triggers a CISPO update of the extractor (paper: 64)."""
    return_reward: float | None = None
    """The reward of an answer that only Returns ("nothing new"), put into B_φ when it is distilled;
    ``null`` (the paper's rule): a Return is never credited, since no episode is guided by it. An
    option: without it an extractor that stops adding gets no sample that could raise an add again.
    0 is the expected ±1 of an unguided coin-flip episode (docs/algorithms.md §6)."""
    cooldown: int = 2
    """δ: an entry trained fewer than δ extractor steps ago gets weight 0 (not given by the paper).
    With δ = 1 the rule never fires (t − t_last < 1 never holds); 0 and 1 both disable it."""
    count_alpha: float = 0.5
    """α: weight (1 + c_train)^(−α) (not given by the paper)."""
    merge_every: int = 5
    """Run the chunked Merge every this many actor steps (paper: 5; 0 disables)."""
    merge_token_budget: int = 6000
    """Tokens per Merge window prompt."""
    entry_reward: EntryReward = "direct"
    """r(m): ``direct`` ±1 by success (the paper's choice) or ``relative`` (minus the free
    subgroup's mean ±1; the variant the paper found worse, appendix B.2)."""
    self_distill: bool = False
    """Self-distillation of winning guided trajectories with the experience stripped (appendix)."""
    self_distill_coef: float = 0.1
    """Weight of the self-distillation NLL term, added to the RL loss of the same update."""
    gate: GateConfig = field(default_factory=GateConfig)
    """The actor-critic gate (``algo.gate.enabled``)."""
    perplexity: PerplexityConfig = field(default_factory=PerplexityConfig)
    """The perplexity-reduction bonus of r(m) (``algo.perplexity.transform``)."""
    edge: EdgeConfig = field(default_factory=EdgeConfig)
    """EDGE's settings (read by method ``edge`` only)."""

    RENAMED: ClassVar[dict[str, str]] = {
        "gate": "gate.enabled",
        "gate_warmup_steps": "gate.warmup_steps",
        "gate_rewrite_tokens": "gate.rewrite_tokens",
        "perplexity_bonus": "perplexity.transform",
        "perplexity_weight": "perplexity.weight",
        "perplexity_temperature": "perplexity.temperature",
        "perplexity_clip": "perplexity.clip",
        "perplexity_clip_negative": "perplexity.clip_negative",
        "edge_threshold": "edge.threshold",
        "edge_ema": "edge.ema",
        "edge_prune": "edge.prune",
        "edge_reflect_below": "edge.reflect_below",
        "edge_reflection_entries": "edge.reflection_entries",
        "edge_dedup_similarity": "edge.dedup_similarity",
        "edge_lambda": "edge.kl_weight",
        "edge_kl_estimator": "edge.kl_estimator",
        "edge_top_k": "edge.top_k",
    }
    """Keys of the flat layout before the sections (``algo.edge_lambda``) → their place now: still
    read from YAML, ``--set`` and attributes, with a deprecation warning (``crl_train.config.io``).
    """

    def __post_init__(self) -> None:
        check_choices(self, "algo")
        _at_least(
            self,
            "algo",
            0,
            "clip_eps",
            "cispo_eps_low",
            "cispo_eps_high",
            "count_alpha",
            "adv_eps",
            "self_distill_coef",
            "cooldown",
            "merge_every",
            "merge_token_budget",
        )
        _at_least(self, "algo", 1, "buffer_size")
        if self.return_reward is not None and not math.isfinite(self.return_reward):
            raise ConfigError(
                f"algo.return_reward must be a finite number or null, got {self.return_reward}"
            )

    if (
        not TYPE_CHECKING
    ):  # old attribute names read at run time; the project's own code uses the sections

        def __getattr__(self, name: str) -> Any:
            return renamed_attribute(self, name)
