"""Build one training run from a config: the actor, the experience service, the envs and the runner.

What differs between methods comes from the method (``method.guided``,
``method.service_options()``); nothing here looks at a method's name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from crl_gym.clients import LocalClient
from crl_gym.experience.bank import ExperienceBank
from crl_gym.json_types import JSONDict
from crl_gym.templates import SEARCH_ACTION, SYSTEM_CONSTRAINED, SYSTEM_REACT
from crl_train.config import ExperienceConfig, ModelConfig, TrainConfig
from crl_train.config.names import ModelKind
from crl_train.methods import Method
from crl_train.policy import rng_state
from crl_train.policy.affinity import CpuSplit, available_cpus, pin_process, split_cpus
from crl_train.policy.base import Policy
from crl_train.policy.factory import GeneratorFactory, build_policy
from crl_train.rollout.envs import RawEnvFactory, raw_env_factory, seed_texts, tokenizer_texts
from crl_train.rollout.runner import RolloutRunner
from crl_train.run.unsent import unsent_path
from crl_train.service import ExperienceService, ServiceOptions, start_service

if TYPE_CHECKING:
    import gymnasium as gym

log = logging.getLogger(__name__)

ACTOR_TEXTS = (SYSTEM_CONSTRAINED, SYSTEM_REACT, SEARCH_ACTION)
"""The actor's own prompt texts, for the tiny tokenizer's corpus."""


@dataclass
class Run:
    """The parts of one run. ``close`` releases them (the extractor's process, the bank,
    the cores)."""

    actor: Policy
    service: ExperienceService
    client: LocalClient
    runner: RolloutRunner
    cpu_split: CpuSplit | None = None
    """Cores of the actor and the extractor (``experience.pin_cpus`` / ``actor_cpus`` /
    ``extractor_cpus``)."""
    cpus_before: tuple[int, ...] | None = None
    """This process's cores before it was pinned to the actor's (restored by :meth:`close`)."""

    @property
    def bank(self) -> ExperienceBank:
        """The run's experience bank (what the trainer trims on a resume, logs the new entries of
        and exports)."""
        return self.service.manager.bank

    def save(self, target: Path, previous: Path | None = None) -> JSONDict:
        """The service's, the runner's and the generators' part of a checkpoint: ``extractor/`` and
        ``bank/`` written into ``target`` (:meth:`ExperienceService.save`), the rest returned for
        its ``state.json``. ``previous``: the last checkpoint's directory."""
        return {
            "service": self.service.save(target, previous),
            "runner": {
                "errors": self.runner.errors,
                "context_truncations": self.runner.context_truncations,
                "malformed_tool_calls": self.runner.malformed_tool_calls,
            },
            "rng": rng_state.capture(),
        }

    def load_state(
        self, state: dict[str, Any], *, step: int, directory: Path | None = None
    ) -> None:
        """Inverse of :meth:`save` for the checkpoint of ``step`` in ``directory`` (its steps are
        ended): the state applied, then the bank and the queue rolled back to the checkpoint's
        copies (a checkpoint written before they were kept has none: the bank stays as it
        is, logged)."""
        self.service.load_state({"last_ended": step, **state.get("service", {})})
        for k, v in state.get("runner", {}).items():
            if k in ("errors", "context_truncations", "malformed_tool_calls"):
                setattr(self.runner, k, int(v))
            else:
                log.warning("checkpoint counter runner.%s is unknown here; ignored", k)
        if "rng" in state:
            rng_state.restore(state["rng"])
        if directory is None:
            return
        if (directory / "bank").is_dir():
            self.service.restore(directory / "bank")
        else:
            log.warning(
                "%s has no bank/ (an older checkpoint): the bank is resumed as it is, with what "
                "was written after step %d",
                directory,
                step,
            )

    def close(self) -> None:
        try:
            self.runner.close()
        finally:  # the extractor's process and the bank are released whatever failed above
            self.service.close()
            pin_process(self.cpus_before)  # the caller (a test, a benchmark) gets its cores back


def use_extractor_process(
    experience: ExperienceConfig, extractor: ModelConfig, options: ServiceOptions
) -> bool:
    """``experience.extractor_process``, with None = on for asynchronous runs that have an extractor
    with model work (the oracle has none: a process would only cost its start)."""
    if experience.extractor_process is not None:
        return experience.extractor_process
    return experience.asynchronous and options.extractor and extractor.kind is not ModelKind.ORACLE


def build_run(
    cfg: TrainConfig,
    method: Method,
    run_dir: Path,
    *,
    checkpoint: Path | None = None,
    env_factory: RawEnvFactory | None = None,
    generator_factory: GeneratorFactory | None = None,
    bank_dir: Path | None = None,
) -> Run:
    """Everything a run needs. ``env_factory(env_id)`` replaces ``crl_gym.envs.make`` (tests, custom
    envs); ``generator_factory`` replaces the vLLM generator for the actor; ``bank_dir`` replaces
    ``run_dir/bank`` (a read-only evaluation's copy: its wrappers then spill nowhere in ``run_dir``,
    they keep what their client refuses in memory)."""
    raw_env = env_factory or raw_env_factory(cfg.env)
    options = method.service_options()
    torch.manual_seed(cfg.seed)
    # The trainer process's intra-op pool is the actor's share of the cores (see
    # crl_train.service.track); an extractor process sets its own (experience.extractor_threads).
    torch.set_num_threads(max(1, cfg.experience.actor_threads))
    ex = cfg.experience
    ext_ckpt = checkpoint / "extractor" if checkpoint is not None else None
    # the oracle's checkpoints have no extractor/ (it has no weights)
    if (
        options.extractor
        and ext_ckpt is not None
        and not ext_ckpt.is_dir()
        and cfg.extractor.kind is not ModelKind.ORACLE
    ):
        log.error(
            "%s is missing (the extractor worker died before any checkpoint): starting a "
            "fresh extractor",
            ext_ckpt,
        )
        ext_ckpt = None
    in_worker = options.extractor and use_extractor_process(ex, cfg.extractor, options)
    # each model on its own cores (the paper: its own GPUs); without a worker everything is the
    # actor's share
    split = split_cpus(available_cpus(), ex.actor_cpus, ex.extractor_cpus, pin=ex.pin_cpus)
    log.info(
        "core split: %s%s",
        split.describe(),
        ""
        if in_worker or split.actor is None
        else " (no extractor process: this run uses the actor's cores only)",
    )
    need_texts = (cfg.actor.kind is ModelKind.TINY and checkpoint is None) or (
        options.extractor and cfg.extractor.kind is ModelKind.TINY and ext_ckpt is None
    )
    texts = (
        tokenizer_texts(cfg.env, raw_env, ACTOR_TEXTS, seed_entries=seed_texts(cfg))
        if need_texts
        else None
    )
    pinned: list[tuple[int, ...] | None] = []
    built: list[Policy] = []

    def build_actor() -> None:  # runs while the extractor's child (started first) builds π_φ
        pinned.append(pin_process(split.actor))
        built.append(
            build_policy(
                cfg.actor,
                texts,
                loss_scale="none",
                role="actor",
                seed=cfg.seed,
                checkpoint=checkpoint / "actor" if checkpoint else None,
                generator_factory=generator_factory,
            )
        )

    try:
        service = start_service(
            cfg,
            options,
            bank_dir or run_dir / "bank",
            texts=texts,
            raw_env=raw_env,
            extractor_checkpoint=ext_ckpt,
            in_worker=in_worker,
            cpus=split.extractor,
            fresh=checkpoint is None,
            start=False,
            meanwhile=build_actor,
        )
    except BaseException:
        if pinned:
            pin_process(pinned[0])
        raise
    actor, before = built[0], pinned[0]
    client = LocalClient(service)
    unsent = unsent_path(run_dir) if bank_dir is None else None
    runner = RolloutRunner(
        actor,
        _env_maker(cfg.experience, method, raw_env, client, unsent),
        client=client if method.guided else None,
        group_size=cfg.env.group_size,
        max_turns=cfg.env.max_turns,
        max_new_tokens=cfg.actor.max_new_tokens,
        max_context_tokens=cfg.actor.max_context_tokens,
        constrained=cfg.actor.constrained,
        search_and_ask=cfg.experience.search_and_ask,
        episode_search=cfg.experience.retrieve != "turn"
        and cfg.experience.entries_per_episode == 1,
    )
    runner.gate = method.entry_gate(actor)
    return Run(actor, service, client, runner, split, before)


def _env_maker(
    ex: ExperienceConfig,
    method: Method,
    raw_env: RawEnvFactory,
    client: LocalClient,
    unsent: Path | None,
) -> RawEnvFactory:
    """Envs as the method sees them: guided methods get the experience wrappers around each, which
    spill what their client refuses to ``unsent`` (client side: not the bank directory)."""
    if not method.guided:
        return raw_env

    def make_env(env_id: str) -> gym.Env:
        from crl_gym.clients.keeping import KeepingClient
        from crl_gym.wrappers.experience import ExperienceWrapper
        from crl_gym.wrappers.search_and_ask import SearchAndAskWrapper

        env = raw_env(env_id)
        if ex.search_and_ask:
            env = SearchAndAskWrapper(env, client, max_calls=ex.max_search_calls)
        return ExperienceWrapper(
            env,
            KeepingClient(client, spill_path=unsent),
            env_id=env_id,
            retrieve=ex.retrieve,
            warmup_steps=ex.warmup_steps,
            entries_per_episode=ex.entries_per_episode,
            defer_turn_search=True,
        )  # the runner searches for all its envs at once

    return make_env
