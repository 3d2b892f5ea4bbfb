"""Build the run's components from a config: actor, extractor, bank, manager, envs, runner, track."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from crl_gym.clients import LocalClient
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import load_embedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.prompts import DISTILLATION_TEMPLATE, REFINEMENT_TEMPLATE
from crl_gym.protocol import DistillationRequest
from crl_gym.wrappers.experience import DEFAULT_TEMPLATE
from crl_train.affinity import CpuSplit, available_cpus, pin_process, split_cpus
from crl_train.config import ModelConfig, TrainConfig
from crl_train.extractor import Extractor, example_op_lines
from crl_train.extractor_worker import ExtractorSpec, ExtractorWorker, build_extractor
from crl_train.methods import MethodSpec
from crl_train.policy.base import OptimConfig, SamplingConfig
from crl_train.rollout import SEARCH_ACTION, SYSTEM_CONSTRAINED, SYSTEM_REACT, RolloutRunner
from crl_train.tracks import BackgroundTrack

log = logging.getLogger(__name__)


class NoExtractor:
    """Where π_φ would be for a method that uses no experience (``grpo``): nothing is built.

    The background track only asks it for its state (empty) at checkpoints and never trains,
    distils or merges with it (those methods have ``train_extractor`` / ``distill_online`` off).
    """

    alive = False

    def get_state(self) -> dict[str, Any]:
        return {}

    def set_state(self, state: dict[str, Any]) -> None:
        del state  # no extractor, no version or constraints to restore

    def close(self) -> None:
        return None


@dataclass
class Components:
    actor: Any
    extractor: Extractor | ExtractorWorker | NoExtractor
    """π_φ: in this process, behind a worker process (``experience.extractor_process``), or none."""
    manager: ExperienceManager
    client: LocalClient
    runner: RolloutRunner
    track: BackgroundTrack
    cpu_split: CpuSplit | None = None
    """Cores of each track (``experience.pin_cpus`` / ``actor_cpus`` / ``extractor_cpus``)."""
    cpus_before: tuple[int, ...] | None = None
    """This process's cores before it was pinned to the actor's (restored by :meth:`close`)."""

    def close(self) -> None:
        try:
            self.track.stop()
            self.runner.close()
        finally:  # the child process and the bank are released whatever failed above
            self.extractor.close()
            self.manager.close()
            self.manager.bank.close()
            pin_process(self.cpus_before)  # the caller (a test, a benchmark) gets its cores back


def use_extractor_process(cfg: TrainConfig, spec: MethodSpec) -> bool:
    """``experience.extractor_process``, with None = on for asynchronous runs that use experience."""
    if cfg.experience.extractor_process is not None:
        return cfg.experience.extractor_process
    return cfg.experience.asynchronous and spec.uses_experience


def make_raw_env(cfg: TrainConfig, env_id: str) -> Any:
    from crl_gym.envs import make

    kwargs = dict(cfg.env.kwargs)
    return make(env_id, **kwargs)


CARRIED_TEXT_WEIGHT = 8
"""How many times the tiny tokenizer's corpus repeats the texts guided prompts carry."""


def _texts_for_tokenizer(cfg: TrainConfig, raw_env: Callable[[str], Any]) -> list[str]:
    from crl_train.policy.tiny import gather_env_texts

    envs = [raw_env(env_id) for env_id in cfg.env.ids]
    try:
        texts = gather_env_texts(envs, [], seeds=(0, 1), steps=4)
    finally:
        for e in envs:
            e.close()
    # What every guided prompt carries (the wrapper's header, entries phrased as the tiny extractor
    # writes them): BPE merges the most frequent pairs, so these are weighed like the observations
    # they ride with. Seen once, they would stay near one token per character and a guided prompt
    # would carry far more tokens than a real tokenizer gives the same words.
    carried = [DEFAULT_TEMPLATE.format(experience="", observation=""), *example_op_lines(),
               *cfg.experience.seed_entries]
    return texts + [SYSTEM_CONSTRAINED, SYSTEM_REACT, SEARCH_ACTION, DISTILLATION_TEMPLATE, REFINEMENT_TEMPLATE,
                    "accept refine reject"] + carried * CARRIED_TEXT_WEIGHT


GeneratorFactory = Callable[[Any, ModelConfig, int], Any]
"""``(policy, model_config, seed) -> generator``: builds the fast generator of ``generator: vllm``.
The generator interface (``crl_train.policy.vllm_engine.VLLMGenerator``): ``generate(prompts,
max_new_tokens, *, sampling=None) -> list[Generation]``, ``sync_weights(named_tensors) -> int``
and ``logprobs_exact: bool``."""


class GeneratorUnavailable(RuntimeError):
    """``generator: vllm`` on a machine without vLLM or without a CUDA GPU."""


def vllm_generator(policy: Any, mc: ModelConfig, seed: int) -> Any:
    """A ``VLLMGenerator`` serving ``policy``'s current weights (vLLM is imported only here)."""
    import importlib.util
    import tempfile

    missing = []
    if importlib.util.find_spec("vllm") is None:
        missing.append("vLLM is not installed (pip install 'complementary-rl[vllm]')")
    if not torch.cuda.is_available():
        missing.append("no CUDA GPU is visible (vLLM has no CPU backend here)")
    if missing:
        raise GeneratorUnavailable(f"generator: vllm ({mc.model}) needs vLLM and a CUDA GPU: {'; '.join(missing)}. "
                                   "Use generator: hf on this machine.")
    from crl_train.policy.checkpoint import MODEL_DIR
    from crl_train.policy.vllm_engine import VLLMGenerator

    # vLLM loads a model directory: write the policy's current weights (a tiny model or a
    # checkpoint has no hub id); the engine reads them at start-up, so the directory can go.
    with tempfile.TemporaryDirectory(prefix="crl_vllm_") as tmp:
        policy.save(tmp)
        return VLLMGenerator(str(Path(tmp) / MODEL_DIR), policy.tokenizer, sampling=policy.sampling,
                             dtype="bfloat16" if mc.dtype == "auto" else mc.dtype,
                             gpu_memory_utilization=mc.gpu_memory_utilization, max_model_len=mc.max_context_tokens,
                             seed=seed)


def build_policy(mc: ModelConfig, texts: list[str] | None, *, loss_scale: str, seed: int, checkpoint: Path | None,
                 generator_factory: GeneratorFactory | None = None) -> Any:
    """The HF policy of ``mc``, with its fast generator attached when ``mc.generator`` is ``vllm``."""
    policy = _build_hf_policy(mc, texts, loss_scale=loss_scale, seed=seed, checkpoint=checkpoint)
    policy.prefix_cache = mc.prefix_cache
    if mc.generator == "vllm":
        gen = (generator_factory or vllm_generator)(policy, mc, seed)
        if loss_scale == "tokens" and not gen.logprobs_exact:
            # the extractor's CISPO weighs by π_φ / π_φ_old at sampling time: recomputing later would
            # use newer weights, so only exact engine log-probs are correct there
            raise GeneratorUnavailable(f"extractor.generator: vllm needs exact log-probs (top_p = 1, sampling, "
                                       f"vLLM >= 0.10.2); this engine's are not (top_p={mc.top_p})")
        # attach_generator pushes the current weights now; HFPolicy.train_step after every update
        policy.attach_generator(gen)
    return policy


def _build_hf_policy(mc: ModelConfig, texts: list[str] | None, *, loss_scale: str, seed: int, checkpoint: Path | None) -> Any:
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


def counters(c: Components) -> dict[str, Any]:
    """The background track's and the runner's cumulative counters, for a checkpoint."""
    st = dataclasses.asdict(c.track.stats)
    st["rewards"] = st["rewards"][-200:]  # the metrics' extractor_reward window
    return {"track": st, "runner": {"errors": c.runner.errors, "context_truncations": c.runner.context_truncations}}


def restore_counters(c: Components, d: dict[str, Any]) -> None:
    """Inverse of :func:`counters` (resume); an unknown name is logged and ignored."""
    for k, v in d.get("track", {}).items():
        if hasattr(c.track.stats, k):
            setattr(c.track.stats, k, v)
        else:
            log.warning("checkpoint counter track.%s is unknown here; ignored", k)
    for k, v in d.get("runner", {}).items():
        if k in ("errors", "context_truncations"):
            setattr(c.runner, k, int(v))
        else:
            log.warning("checkpoint counter runner.%s is unknown here; ignored", k)


def save_run_config(cfg: TrainConfig, run_dir: Path, resume_step: int | None) -> None:
    """Write the resolved config to ``config.yaml``. On a resume that changes it (``--set``), the
    previous file is kept as ``config.before_step<N>.yaml`` and the changed keys are logged, so
    a later plain ``--resume`` runs what this one ran."""
    from crl_train.config_io import config_to_dict
    from crl_train.outputs import atomic_write_text

    path = run_dir / "config.yaml"
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
    if resume_step is not None and path.exists():
        before = path.read_text(encoding="utf-8")
        if before == text:
            return
        old = yaml.safe_load(before) or {}
        changed = [f"{k}: {old_v!r} -> {new_v!r}" for k, old_v, new_v in _diff(old, config_to_dict(cfg))]
        keep = run_dir / f"config.before_step{resume_step}.yaml"
        keep.write_text(before, encoding="utf-8")
        log.info("resume at step %d changes the config (%s); config.yaml updated, the previous one is %s",
                 resume_step, "; ".join(changed) or "formatting only", keep.name)
    atomic_write_text(path, text)


def _diff(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[tuple[str, Any, Any]] = []
        for k in list(a) + [k for k in b if k not in a]:
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [(prefix[:-1], a, b)]


def _offline_bank(cfg: TrainConfig, manager: ExperienceManager, extractor: Any) -> None:
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
                     env_factory: Callable[[str], Any] | None = None, generator_factory: GeneratorFactory | None = None,
                     bank_dir: Path | None = None) -> Components:
    """Everything a run needs. ``env_factory(env_id)`` replaces ``crl_gym.envs.make`` (tests, custom envs);
    ``generator_factory`` replaces :func:`vllm_generator` for the actor; ``bank_dir`` replaces ``run_dir/bank``.
    Methods without experience (``grpo``) get no extractor."""
    raw_env = env_factory or (lambda env_id: make_raw_env(cfg, env_id))
    torch.manual_seed(cfg.seed)
    # The trainer process's intra-op pool is the actor's share of the cores (see crl_train.tracks);
    # an extractor process sets its own (experience.extractor_threads).
    torch.set_num_threads(max(1, cfg.experience.actor_threads))
    ext_ckpt = checkpoint / "extractor" if checkpoint is not None else None
    if spec.uses_experience and ext_ckpt is not None and not ext_ckpt.is_dir():
        log.error("%s is missing (the extractor worker died before any checkpoint): starting a fresh extractor", ext_ckpt)
        ext_ckpt = None
    ex = cfg.experience
    in_worker = spec.uses_experience and use_extractor_process(cfg, spec)
    # each track on its own cores (the paper: its own GPUs); without a worker everything is the actor's share
    split = split_cpus(available_cpus(), ex.actor_cpus, ex.extractor_cpus, pin=ex.pin_cpus)
    log.info("core split: %s%s", split.describe(), "" if in_worker or split.actor is None else
             " (no extractor process: this run uses the actor's cores only)")
    need_texts = cfg.actor.model == "tiny" and checkpoint is None or (
        spec.uses_experience and cfg.extractor.model == "tiny" and ext_ckpt is None)
    texts = _texts_for_tokenizer(cfg, raw_env) if need_texts else None
    ext_spec = ExtractorSpec(
        cfg.extractor, tuple(texts) if texts is not None else None, seed=cfg.seed + 1,
        checkpoint=str(ext_ckpt) if ext_ckpt is not None else None, num_threads=cfg.experience.extractor_threads,
        cpus=split.extractor, nice=cfg.experience.extractor_nice, options={"max_new_tokens": cfg.extractor.max_new_tokens, "max_context_tokens": cfg.extractor.max_context_tokens,
                 "max_prompt_chars": cfg.experience.max_prompt_chars, "constrained": cfg.extractor.constrained,
                 "think_tokens": cfg.extractor.think_tokens,
                 "eps_low": cfg.algo.cispo_eps_low, "eps_high": cfg.algo.cispo_eps_high,
                 "cooldown": cfg.algo.cooldown, "alpha": cfg.algo.count_alpha})
    # started first: the child builds π_φ while this process builds the actor
    worker = ExtractorWorker(ext_spec, start_method=cfg.experience.extractor_start_method) if in_worker else None
    before = pin_process(split.actor)
    try:
        actor = build_policy(cfg.actor, texts, loss_scale="none", seed=cfg.seed,
                             checkpoint=checkpoint / "actor" if checkpoint else None, generator_factory=generator_factory)
        if worker is not None:
            log.info("extractor worker ready (pid %d)", worker.wait_ready())
        extractor: Extractor | ExtractorWorker | NoExtractor = NoExtractor()
        if spec.uses_experience:
            extractor = worker if worker is not None else build_extractor(ext_spec)
        c = _assemble(cfg, spec, bank_dir or run_dir / "bank", raw_env, checkpoint, actor, extractor)
        c.cpu_split, c.cpus_before = split, before
        return c
    except BaseException:
        if worker is not None:
            worker.close()
        pin_process(before)
        raise


def _assemble(cfg: TrainConfig, spec: MethodSpec, bank_dir: Path, raw_env: Callable[[str], Any], checkpoint: Path | None,
              actor: Any, extractor: Extractor | ExtractorWorker | NoExtractor) -> Components:
    """Bank, manager, client, wrapped envs, runner and track around the two models."""
    emb_name = f"hashing:{cfg.experience.embed_dim}" if cfg.experience.embedder == "hashing" else (
        None if cfg.experience.embedder == "minilm" else cfg.experience.embedder)
    embedder = load_embedder(emb_name)
    bank = ExperienceBank(bank_dir, dim=int(embedder.dim))
    manager = ExperienceManager(bank, embedder, cfg.manager)
    client = LocalClient(manager)
    if checkpoint is None and len(bank) == 0:
        for text in cfg.experience.seed_entries:
            bank.add(text, embedder.encode([text])[0])
        if spec.offline_bank:
            _offline_bank(cfg, manager, extractor)
    if cfg.experience.search_and_ask and spec.uses_experience:
        assert not isinstance(extractor, NoExtractor)  # methods with experience always build one
        manager.refiner = extractor.refine

    def make_env(env_id: str) -> Any:
        env = raw_env(env_id)
        if not spec.uses_experience:
            return env
        from crl_gym.wrappers.experience import ExperienceWrapper
        from crl_gym.wrappers.search_and_ask import SearchAndAskWrapper

        if cfg.experience.search_and_ask:
            env = SearchAndAskWrapper(env, client, max_calls=cfg.experience.max_search_calls)
        return ExperienceWrapper(env, client, env_id=env_id, spill_path=bank_dir / "unsent_requests.jsonl")

    runner = RolloutRunner(actor, make_env, client=client if spec.uses_experience else None,
                           group_size=cfg.env.group_size, max_turns=cfg.env.max_turns,
                           max_new_tokens=cfg.actor.max_new_tokens, max_context_tokens=cfg.actor.max_context_tokens,
                           constrained=cfg.actor.constrained, search_and_ask=cfg.experience.search_and_ask)
    # NoExtractor (grpo): the track neither trains nor distils, it only asks for get_state()
    track = BackgroundTrack(manager, extractor, buffer_size=cfg.algo.buffer_size, distill_batch=cfg.experience.distill_batch,  # type: ignore[arg-type]
                            distill_linger_s=cfg.experience.distill_linger_s,
                            train=spec.train_extractor, distill=spec.distill_online,
                            merge_token_budget=cfg.algo.merge_token_budget, asynchronous=cfg.experience.asynchronous,
                            num_threads=cfg.experience.extractor_threads)
    return Components(actor, extractor, manager, client, runner, track)
