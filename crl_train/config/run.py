"""The ``train`` section (:class:`RunConfig`) and the whole run (:class:`TrainConfig`, every
section)."""

from __future__ import annotations

from dataclasses import dataclass, field

from crl_gym.experience.config import ManagerConfig
from crl_train.config.algo import AlgoConfig
from crl_train.config.env import EnvConfig
from crl_train.config.experience import ExperienceConfig
from crl_train.config.extractor import EXTRACTOR_MAX_NEW_TOKENS
from crl_train.config.io import ConfigError, enum_member
from crl_train.config.model import ModelConfig
from crl_train.config.names import MethodName, ModelKind


@dataclass(frozen=True)
class RunConfig:
    """How long to train and what to write."""

    steps: int = 40
    """Actor steps (rollout → advantages → update)."""
    checkpoint_every: int = 10
    """Write a checkpoint (both models, bank, buffers, counters) every this many steps (and at the
    end)."""
    log_every: int = 1
    """Write a metrics.jsonl row every this many steps."""
    eval_episodes: int = 8
    """Held-out episodes per condition evaluated at the end of training (0 disables)."""
    max_track_failures: int = 5
    """The run fails, naming the cause, once the extractor's background track has failed this many
    times: passes that raised (``track_errors``), CISPO batches dropped because the extractor's
    worker is gone (``skipped_updates``) and samples left out of CISPO because they do not replay
    under their grammar (``unreplayable``), together, since the run (or its resume) started. Each
    failure is shown in the progress bar, logged and listed in the run's summary whatever the limit;
    0 never fails the run."""

    def __post_init__(self) -> None:
        if self.max_track_failures < 0:
            raise ConfigError(
                f"train.max_track_failures must be >= 0, got {self.max_track_failures}"
            )
        if self.steps < 1:
            raise ConfigError(f"train.steps must be >= 1, got {self.steps}")
        for name in ("checkpoint_every", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_episodes < 0:
            raise ConfigError(f"train.eval_episodes must be >= 0, got {self.eval_episodes}")


@dataclass(frozen=True)
class TrainConfig:
    """The whole run."""

    method: MethodName = MethodName.COMPLEMENTARY
    """One of grpo, complementary, static_online, exp_only, offline_exp, edge
    (``crl_train.methods``; each checks the settings it needs when it is made)."""
    seed: int = 0
    """Seed of torch and the samplers."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Environments and rollout grouping."""
    actor: ModelConfig = field(default_factory=lambda: ModelConfig(constrained=True))
    """The policy actor π_θ."""
    extractor: ModelConfig = field(
        default_factory=lambda: ModelConfig(max_new_tokens=EXTRACTOR_MAX_NEW_TOKENS)
    )
    """The experience extractor π_φ (separate parameters, as the paper requires)."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Losses and their hyper-parameters."""
    experience: ExperienceConfig = field(default_factory=ExperienceConfig)
    """Experience layer."""
    manager: ManagerConfig = field(default_factory=ManagerConfig)
    """ExperienceManager knobs (batching, diversification, queue)."""
    train: RunConfig = field(default_factory=RunConfig)
    """Run length and outputs."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", enum_member(MethodName, self.method, "method"))
        if self.actor.kind is ModelKind.ORACLE:
            raise ConfigError(
                "actor.model: 'oracle' is an extractor, not an actor (use it as extractor.model)"
            )
        if self.extractor.kind is ModelKind.READER:
            raise ConfigError(
                "extractor.model: 'reader' is an actor, not an extractor (use it as actor.model)"
            )
        if self.actor.kind is ModelKind.READER:
            # the reader has no distribution to distil, judge with or measure the entropy of
            needs = [
                what
                for what, on in (
                    ("algo.self_distill", self.algo.self_distill),
                    ("algo.gate.enabled", self.algo.gate.enabled),
                    ("algo.perplexity.transform", self.algo.perplexity.transform != "off"),
                )
                if on
            ]
            if needs:
                raise ConfigError(
                    "actor.model: 'reader' is a script without weights; "
                    f"{', '.join(needs)} needs a "
                    "model actor"
                )
        if self.actor.think_tokens:
            raise ConfigError(
                f"actor.think_tokens must be 0 (got {self.actor.think_tokens}): only the "
                "extractor's "
                "constrained answers take reasoning tokens"
            )
        if self.extractor.constrained and not self.extractor.structured:
            raise ConfigError(
                "extractor.constrained=true (a model that cannot write an answer on its own) needs "
                "extractor.structured=true: its answers are generated under their schemas"
            )
