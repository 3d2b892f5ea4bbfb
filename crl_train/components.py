"""Build the run's components from a config: actor, extractor, bank, manager, envs, runner, track."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from crl_gym.clients import LocalClient
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import load_embedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.prompts import DISTILLATION_TEMPLATE, REFINEMENT_TEMPLATE
from crl_gym.protocol import DistillationRequest
from crl_train.config import ModelConfig, TrainConfig
from crl_train.extractor import Extractor
from crl_train.extractor_worker import ExtractorSpec, ExtractorWorker, build_extractor
from crl_train.methods import MethodSpec
from crl_train.policy.base import OptimConfig, SamplingConfig
from crl_train.rollout import SEARCH_ACTION, SYSTEM_CONSTRAINED, SYSTEM_REACT, RolloutRunner
from crl_train.tracks import BackgroundTrack

log = logging.getLogger(__name__)


@dataclass
class Components:
    actor: Any
    extractor: Extractor | ExtractorWorker
    """π_φ: in this process, or behind a worker process (``experience.extractor_process``)."""
    manager: ExperienceManager
    client: LocalClient
    runner: RolloutRunner
    track: BackgroundTrack

    def close(self) -> None:
        try:
            self.track.stop()
            self.runner.close()
        finally:  # the child process and the bank are released whatever failed above
            self.extractor.close()
            self.manager.close()
            self.manager.bank.close()


def use_extractor_process(cfg: TrainConfig, spec: MethodSpec) -> bool:
    """``experience.extractor_process``, with None = on for asynchronous runs that use experience."""
    if cfg.experience.extractor_process is not None:
        return cfg.experience.extractor_process
    return cfg.experience.asynchronous and spec.uses_experience


def make_raw_env(cfg: TrainConfig, env_id: str) -> Any:
    from crl_gym.envs import make

    kwargs = dict(cfg.env.kwargs)
    return make(env_id, **kwargs)


def _texts_for_tokenizer(cfg: TrainConfig, raw_env: Callable[[str], Any]) -> list[str]:
    from crl_train.policy.tiny import gather_env_texts

    envs = [raw_env(env_id) for env_id in cfg.env.ids]
    try:
        texts = gather_env_texts(envs, [], seeds=(0, 1), steps=4)
    finally:
        for e in envs:
            e.close()
    return texts + [SYSTEM_CONSTRAINED, SYSTEM_REACT, SEARCH_ACTION, DISTILLATION_TEMPLATE, REFINEMENT_TEMPLATE,
                    "RETURN: nothing new", "ADD: UPDATE: Avoid repeating explore other directions. helped reach the goal.",
                    "accept refine reject", *cfg.experience.seed_entries]


def build_policy(mc: ModelConfig, texts: list[str] | None, *, loss_scale: str, seed: int, checkpoint: Path | None) -> Any:
    from crl_train.policy.hf import HFPolicy

    if checkpoint is not None:
        return HFPolicy.from_checkpoint(checkpoint, device=mc.device, dtype=mc.dtype)
    sampling = SamplingConfig(temperature=mc.temperature, top_p=mc.top_p)
    optim = OptimConfig(lr=mc.lr, micro_batch_size=mc.micro_batch_size, loss_scale=loss_scale)  # type: ignore[arg-type]
    if mc.model == "tiny":
        from crl_train.policy.tiny import build_tiny_policy

        assert texts is not None
        return build_tiny_policy(texts, vocab_size=mc.tiny_vocab_size, device=mc.device, sampling=sampling, optim=optim,
                                 seed=seed, hidden=mc.tiny_hidden, layers=mc.tiny_layers, heads=mc.tiny_heads,
                                 kv_heads=mc.tiny_kv_heads, intermediate=mc.tiny_intermediate,
                                 max_positions=max(mc.max_context_tokens, 512))
    return HFPolicy.from_pretrained(mc.model, device=mc.device, dtype=mc.dtype, sampling=sampling, optim=optim,
                                    enable_thinking=mc.enable_thinking)


def _offline_bank(cfg: TrainConfig, manager: ExperienceManager, extractor: Extractor | ExtractorWorker) -> None:
    """offline_exp: a bank export is imported; a trajectories.jsonl is distilled once."""
    src = Path(str(cfg.experience.offline_source))
    if not src.is_file():
        raise FileNotFoundError(f"experience.offline_source {str(src)!r} does not exist")
    first = src.read_text(encoding="utf-8").splitlines()[:1]
    if first and "trajectory" not in json.loads(first[0]):
        n = manager.bank.import_jsonl(src)
        log.info("offline_exp: imported %d entries from %s", n, src)
        return
    reqs = []
    for i, line in enumerate(src.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                reqs.append(DistillationRequest.from_json(line))
            except (ValueError, KeyError) as exc:
                log.warning("%s:%d: unreadable request skipped (%s)", src, i, exc)
    for s in range(0, len(reqs), 8):
        chunk = reqs[s:s + 8]
        for req, (sample, ops) in zip(chunk, extractor.distill(chunk), strict=True):
            manager.apply_ops(ops, sample=sample, request=req)
    log.info("offline_exp: distilled %d trajectories into %d entries", len(reqs), len(manager.bank))


def build_components(cfg: TrainConfig, spec: MethodSpec, run_dir: Path, *, checkpoint: Path | None = None,
                     env_factory: Callable[[str], Any] | None = None) -> Components:
    """Everything a run needs. ``env_factory(env_id)`` replaces ``crl_gym.envs.make`` (tests, custom envs)."""
    raw_env = env_factory or (lambda env_id: make_raw_env(cfg, env_id))
    torch.manual_seed(cfg.seed)
    # The trainer process's intra-op pool is the actor's share of the cores (see crl_train.tracks);
    # an extractor process sets its own (experience.extractor_threads).
    torch.set_num_threads(max(1, cfg.experience.actor_threads))
    ext_ckpt = checkpoint / "extractor" if checkpoint is not None else None
    if ext_ckpt is not None and not ext_ckpt.is_dir():
        log.error("%s is missing (the extractor worker died before any checkpoint): starting a fresh extractor", ext_ckpt)
        ext_ckpt = None
    need_texts = cfg.actor.model == "tiny" and checkpoint is None or cfg.extractor.model == "tiny" and ext_ckpt is None
    texts = _texts_for_tokenizer(cfg, raw_env) if need_texts else None
    ext_spec = ExtractorSpec(
        cfg.extractor, tuple(texts) if texts is not None else None, seed=cfg.seed + 1,
        checkpoint=str(ext_ckpt) if ext_ckpt is not None else None, num_threads=cfg.experience.extractor_threads,
        nice=cfg.experience.extractor_nice, options={"max_new_tokens": cfg.extractor.max_new_tokens, "max_context_tokens": cfg.extractor.max_context_tokens,
                 "max_prompt_chars": cfg.experience.max_prompt_chars, "constrained": cfg.extractor.constrained,
                 "eps_low": cfg.algo.cispo_eps_low, "eps_high": cfg.algo.cispo_eps_high,
                 "cooldown": cfg.algo.cooldown, "alpha": cfg.algo.count_alpha})
    # started first: the child builds π_φ while this process builds the actor
    worker = ExtractorWorker(ext_spec, start_method=cfg.experience.extractor_start_method) \
        if use_extractor_process(cfg, spec) else None
    try:
        actor = build_policy(cfg.actor, texts, loss_scale="none", seed=cfg.seed,
                             checkpoint=checkpoint / "actor" if checkpoint else None)
        if worker is not None:
            log.info("extractor worker ready (pid %d)", worker.wait_ready())
        extractor = worker if worker is not None else build_extractor(ext_spec)
        return _assemble(cfg, spec, run_dir, raw_env, checkpoint, actor, extractor)
    except BaseException:
        if worker is not None:
            worker.close()
        raise


def _assemble(cfg: TrainConfig, spec: MethodSpec, run_dir: Path, raw_env: Callable[[str], Any], checkpoint: Path | None,
              actor: Any, extractor: Extractor | ExtractorWorker) -> Components:
    """Bank, manager, client, wrapped envs, runner and track around the two models."""
    emb_name = f"hashing:{cfg.experience.embed_dim}" if cfg.experience.embedder == "hashing" else (
        None if cfg.experience.embedder == "minilm" else cfg.experience.embedder)
    embedder = load_embedder(emb_name)
    bank = ExperienceBank(run_dir / "bank", dim=int(embedder.dim))
    manager = ExperienceManager(bank, embedder, cfg.manager)
    client = LocalClient(manager)
    if checkpoint is None and len(bank) == 0:
        for text in cfg.experience.seed_entries:
            bank.add(text, embedder.encode([text])[0])
        if spec.offline_bank:
            _offline_bank(cfg, manager, extractor)
    if cfg.experience.search_and_ask and spec.uses_experience:
        manager.refiner = extractor.refine

    def make_env(env_id: str) -> Any:
        env = raw_env(env_id)
        if not spec.uses_experience:
            return env
        from crl_gym.wrappers.experience import ExperienceWrapper
        from crl_gym.wrappers.search_and_ask import SearchAndAskWrapper

        if cfg.experience.search_and_ask:
            env = SearchAndAskWrapper(env, client, max_calls=cfg.experience.max_search_calls)
        return ExperienceWrapper(env, client, env_id=env_id, spill_path=run_dir / "bank" / "unsent_requests.jsonl")

    runner = RolloutRunner(actor, make_env, client=client if spec.uses_experience else None,
                           group_size=cfg.env.group_size, max_turns=cfg.env.max_turns,
                           max_new_tokens=cfg.actor.max_new_tokens, max_context_tokens=cfg.actor.max_context_tokens,
                           constrained=cfg.actor.constrained, search_and_ask=cfg.experience.search_and_ask)
    track = BackgroundTrack(manager, extractor, buffer_size=cfg.algo.buffer_size, distill_batch=cfg.experience.distill_batch,
                            distill_linger_s=cfg.experience.distill_linger_s,
                            train=spec.train_extractor, distill=spec.distill_online,
                            merge_token_budget=cfg.algo.merge_token_budget, asynchronous=cfg.experience.asynchronous,
                            num_threads=cfg.experience.extractor_threads)
    return Components(actor, extractor, manager, client, runner, track)
