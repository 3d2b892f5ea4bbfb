"""The service behind ``crl-experience serve --extractor``: Complementary RL's extractor side for
any trainer.

``crl_gym.cli`` imports :func:`build_served_service` only when ``--extractor`` is given, so serving
a bank for retrieval alone needs nothing from ``crl_train``.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from crl_gym.experience.bank import DB_FILE
from crl_train.config import load_config
from crl_train.config.names import ModelKind
from crl_train.methods import make_method
from crl_train.service import ExperienceService, start_service
from crl_train.service.ray_actor import newest_checkpoint

log = logging.getLogger(__name__)

SERVICE_DIR = "service"
"""Under the bank directory: the served extractor side's checkpoints (B_φ, π_φ, counters), written
when the server stops and read when it starts again on the same directory."""


def build_served_service(
    bank_dir: Path, extractor: str, embedder: str | None = None, *, merge_seeded: bool = False
) -> ExperienceService:
    """The service behind ``crl-experience serve --extractor``: started, its extractor in a
    worker process.

    ``extractor`` is ``tiny`` (the packaged tiny preset: a tiny random-initialised extractor whose
    tokenizer is trained on the preset's envs) or a crl-train YAML config whose ``extractor``,
    ``algo`` and ``experience`` sections are used, with the extractor side of its ``method``.
    ``embedder`` overrides the config's (it must match the one the bank was built with).
    ``merge_seeded``: whether the Merge may touch entries written without an extractor sample (a
    user's seeded advice); by default it leaves them as they are.
    A bank directory the server ran on before resumes the extractor side from its last checkpoint
    (``BANK/service/checkpoint``, written when the server stopped); the bank itself is kept as
    it is.
    """
    overrides = [] if embedder is None else [f"experience.embedder={embedder}"]
    cfg = load_config(None if extractor == ModelKind.TINY else Path(extractor), overrides)
    options = make_method(cfg).service_options()
    if not options.extractor:
        raise ValueError(
            f"method {cfg.method.value!r} has no extractor: serve without --extractor instead"
        )
    # a server never waits inside end_step; a user's own entries survive the untrained merges
    options = dataclasses.replace(options, asynchronous=True, merge_seeded=merge_seeded)
    service_dir = Path(bank_dir) / SERVICE_DIR
    found = newest_checkpoint(service_dir)
    state = None if found is None else found[1]["service"]
    ext_ckpt = (
        None if found is None or not (found[0] / "extractor").is_dir() else found[0] / "extractor"
    )
    if found is not None:
        log.info(
            "resuming the extractor side from %s (last ended step %s)",
            found[0],
            found[1]["service"].get("last_ended"),
        )
    service = start_service(
        cfg,
        options,
        bank_dir,
        extractor_checkpoint=ext_ckpt,
        state=state,
        fresh=not (Path(bank_dir) / DB_FILE).exists(),
    )
    service.checkpoint_dir = (
        service_dir  # stopping the server (SIGTERM, SIGINT) checkpoints B_φ and π_φ
    )
    return service
