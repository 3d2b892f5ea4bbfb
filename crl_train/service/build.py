"""Build an :class:`~crl_train.service.ExperienceService` from a crl-train config.

:func:`start_service` is the one builder of its three faces: the trainer (``crl_train.run.build``:
the service of one run, its bank under the run directory), ``crl-experience serve --extractor``
(``crl_train.serve``: a service for any trainer, over HTTP) and the Ray service actor
(``crl_train.service.ray_actor``). :func:`embedder_of` is the one reading of
``experience.embedder``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.config import ManagerConfig
from crl_gym.experience.embedders import Embedder, embedder_name, load_embedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.protocol import DistillationRequest
from crl_train.config import ExperienceConfig, ExtractorSettings, TrainConfig
from crl_train.config.names import ModelKind
from crl_train.extractor import AnyExtractor, ExtractorSpec, ExtractorWorker, build_extractor
from crl_train.rollout.envs import RawEnvFactory, raw_env_factory, seed_texts, tokenizer_texts
from crl_train.service.service import ExperienceService, ServiceOptions

log = logging.getLogger(__name__)


def embedder_of(experience: ExperienceConfig, device: str = "cpu") -> Embedder:
    """``experience.embedder`` on ``device``: ``hashing`` (of ``embed_dim``), ``minilm``
    (bundled) or a model path."""
    name = experience.embedder
    spec = (
        f"hashing:{experience.embed_dim}"
        if name == "hashing"
        else None
        if name == "minilm"
        else name
    )
    return load_embedder(spec, device=device)


def extractor_spec(
    cfg: TrainConfig,
    texts: list[str] | None,
    *,
    checkpoint: Path | None = None,
    cpus: tuple[int, ...] | None = None,
) -> ExtractorSpec:
    """How to build π_φ from ``cfg`` (in this process or in its worker)."""
    return ExtractorSpec(
        cfg.extractor,
        tuple(texts) if texts is not None else None,
        seed=cfg.seed + 1,
        checkpoint=str(checkpoint) if checkpoint is not None else None,
        num_threads=cfg.experience.extractor_threads,
        cpus=cpus,
        nice=cfg.experience.extractor_nice,
        settings=ExtractorSettings.from_config(cfg),
    )


def service_options(cfg: TrainConfig, **method_side: Any) -> ServiceOptions:
    """The config's queue, buffer and merge settings (:meth:`ServiceOptions.from_config`), with a
    method's own choices (``method_side``: fields of :class:`ServiceOptions`)."""
    return dataclasses.replace(ServiceOptions.from_config(cfg), **method_side)


def build_service(
    experience: ExperienceConfig,
    manager_config: ManagerConfig,
    options: ServiceOptions,
    bank_dir: Path | None,
    extractor: AnyExtractor | None,
    *,
    fresh: bool = True,
    last_ended: int = -1,
    embedder: Embedder | None = None,
    env_ids: tuple[str, ...] = (),
) -> ExperienceService:
    """The bank in ``bank_dir`` (None: in memory), its manager, and the service
    around ``extractor``.

    ``experience`` / ``manager_config``: the config's sections (its embedder and seed entries, the
    manager's knobs). ``embedder`` replaces the config's (e.g. a pool of them on GPUs). ``fresh``: a
    new run; an empty bank gets ``experience.seed_entries`` (those for ``env_ids``, tagged with
    their id, when they are given per env) and, for a frozen offline
    bank, ``experience.offline_source``. Not fresh (a resume), ``bank_dir`` must hold a bank. The
    bank records the embedder it is built with and refuses another one (``BankEmbedderError``).
    """
    embedder = embedder if embedder is not None else embedder_of(experience)
    # a resumed run's bank must be there (create=False): an empty one in its place would lose it
    bank = ExperienceBank(
        bank_dir, dim=int(embedder.dim), embedder_name=embedder_name(embedder), create=fresh
    )
    try:
        manager = ExperienceManager(bank, embedder, manager_config)
    except BaseException:
        bank.close()
        raise
    service = ExperienceService(manager, extractor, options, last_ended=last_ended)
    try:
        if fresh and len(bank) == 0 and options.seed_bank:
            for text, tags in experience.seeds_for(env_ids):
                bank.add(text, embedder.encode([text])[0], tags=tags)
        if fresh and len(bank) == 0 and options.offline_source is not None:
            load_offline_bank(Path(options.offline_source), manager, extractor)
    except BaseException:
        service.close()
        raise
    return service


def start_service(
    cfg: TrainConfig,
    options: ServiceOptions,
    bank_dir: Path | None,
    *,
    texts: list[str] | None = None,
    raw_env: RawEnvFactory | None = None,
    extractor_checkpoint: Path | None = None,
    in_worker: bool = True,
    cpus: tuple[int, ...] | None = None,
    state: dict[str, Any] | None = None,
    fresh: bool | None = None,
    embedder: Embedder | None = None,
    start: bool = True,
    meanwhile: Callable[[], None] | None = None,
) -> ExperienceService:
    """The experience service of ``cfg`` with its extractor, ready to serve.

    1. π_φ (when ``options.extractor``): in its worker process (``in_worker``; started first, so
       ``meanwhile`` runs while the child loads: the trainer builds its actor there), else in this
       process; from ``extractor_checkpoint`` when given. The tiny extractor's tokenizer is trained
       on ``texts`` (None: :func:`crl_train.rollout.envs.tokenizer_texts` of the config's envs, made
       by ``raw_env``, default ``crl_gym.envs.make``).
    2. the bank in ``bank_dir``, its manager and the service (:func:`build_service`); ``fresh``
       (default: no ``state``) seeds an empty bank, a resume needs the bank to be there.
    3. ``state`` (a checkpoint's service part) loaded, and the extractor's thread
       started (``start``).

    Whatever fails on the way closes what was started (the worker, the bank).
    """
    if (
        options.extractor
        and texts is None
        and cfg.extractor.kind is ModelKind.TINY
        and extractor_checkpoint is None
    ):
        texts = tokenizer_texts(
            cfg.env, raw_env or raw_env_factory(cfg.env), seed_entries=seed_texts(cfg)
        )
    spec = extractor_spec(cfg, texts, checkpoint=extractor_checkpoint, cpus=cpus)
    worker = None
    if options.extractor and in_worker:
        worker = ExtractorWorker(spec, start_method=cfg.experience.extractor_start_method)
    try:
        if meanwhile is not None:
            meanwhile()
        extractor: AnyExtractor | None = None
        if worker is not None:
            log.info("extractor worker ready (pid %d)", worker.wait_ready())
            extractor = worker
        elif options.extractor:
            extractor = build_extractor(spec)
        last_ended = int(state.get("last_ended", -1)) if state is not None else -1
        service = build_service(
            cfg.experience,
            cfg.manager,
            options,
            bank_dir,
            extractor,
            env_ids=cfg.env.ids,
            fresh=state is None if fresh is None else fresh,
            last_ended=last_ended,
            embedder=embedder,
        )
    except BaseException:
        if worker is not None:
            worker.close()
        raise
    try:
        if state is not None:
            service.load_state(state)
        if start:
            service.start()
    except BaseException:
        service.close()
        raise
    return service


def load_offline_bank(
    src: Path, manager: ExperienceManager, extractor: AnyExtractor | None
) -> None:
    """A frozen bank: a bank ``.jsonl`` export is imported; a ``trajectories.jsonl`` is
    distilled once."""
    if not src.is_file():
        raise FileNotFoundError(f"experience.offline_source {str(src)!r} does not exist")
    lines = src.read_text(encoding="utf-8").splitlines()
    if lines and "trajectory" not in json.loads(lines[0]):
        n = manager.bank.import_jsonl(src)
        log.info("offline bank: imported %d entries from %s", n, src)
        return
    if extractor is None:
        raise ValueError(f"{src} holds trajectories: distilling them needs an extractor")
    reqs = []
    for i, line in enumerate(lines, 1):
        if line.strip():
            try:
                reqs.append(DistillationRequest.from_json(line))
            except (ValueError, KeyError) as exc:
                log.warning("%s:%d: unreadable request skipped (%s)", src, i, exc)
    for s in range(0, len(reqs), 8):
        chunk = reqs[s : s + 8]
        for req, (sample, ops) in zip(chunk, extractor.distill(chunk), strict=True):
            manager.apply_ops(ops, sample=sample, request=req)
    log.info(
        "offline bank: distilled %d trajectories into %d entries", len(reqs), len(manager.bank)
    )


__all__ = [
    "build_service",
    "embedder_of",
    "extractor_spec",
    "load_offline_bank",
    "service_options",
    "start_service",
]
