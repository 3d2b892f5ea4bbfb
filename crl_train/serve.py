"""The service behind ``crl-experience serve --extractor``: Complementary RL's extractor side for any trainer.

``crl_gym.cli`` imports :func:`build_served_service` only when ``--extractor`` is given, so serving
a bank for retrieval alone needs nothing from ``crl_train``.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from crl_train.config import load_config
from crl_train.methods import make_method
from crl_train.service import ExperienceService, start_service

log = logging.getLogger(__name__)


def build_served_service(bank_dir: Path, extractor: str, embedder: str | None = None, *,
                         merge_seeded: bool = False) -> ExperienceService:
    """The service behind ``crl-experience serve --extractor``: started, its extractor in a worker process.

    ``extractor`` is ``tiny`` (the packaged tiny preset: a tiny random-initialised extractor whose
    tokenizer is trained on the preset's envs) or a crl-train YAML config whose ``extractor``,
    ``algo`` and ``experience`` sections are used, with the extractor side of its ``method``.
    ``embedder`` overrides the config's (it must match the one the bank was built with).
    ``merge_seeded``: whether the Merge may touch entries written without an extractor sample (a
    user's seeded advice); by default it leaves them as they are.
    """
    overrides = [] if embedder is None else [f"experience.embedder={embedder}"]
    cfg = load_config(None if extractor == "tiny" else Path(extractor), overrides)
    options = make_method(cfg).service_options()
    if not options.extractor:
        raise ValueError(f"method {cfg.method!r} has no extractor: serve without --extractor instead")
    # a server never waits inside end_step; a user's own entries survive the untrained merges
    options = dataclasses.replace(options, asynchronous=True, merge_seeded=merge_seeded)
    return start_service(cfg, options, bank_dir)
