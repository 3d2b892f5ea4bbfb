"""A run's ``config.yaml``: the resolved config, and what a resume that changes it changed."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from crl_train.service.checkpoint import atomic_write_text

if TYPE_CHECKING:
    from crl_train.config import TrainConfig

log = logging.getLogger(__name__)


def save_run_config(cfg: TrainConfig, run_dir: Path, resume_step: int | None) -> None:
    """Write the resolved config to ``config.yaml``. On a resume that changes it (``--set``), the
    previous file is kept as ``config.before_step<N>.yaml`` and the changed keys are logged, so
    a later plain ``--resume`` runs what this one ran."""
    from crl_train.config.io import config_to_dict

    path = run_dir / "config.yaml"
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
    if resume_step is not None and path.exists():
        before = path.read_text(encoding="utf-8")
        if before == text:
            return
        old = yaml.safe_load(before) or {}
        changed = [
            f"{k}: {old_v!r} -> {new_v!r}" for k, old_v, new_v in _diff(old, config_to_dict(cfg))
        ]
        keep = run_dir / f"config.before_step{resume_step}.yaml"
        keep.write_text(before, encoding="utf-8")
        log.info(
            "resume at step %d changes the config (%s); config.yaml updated, the previous one "
            "is %s",
            resume_step,
            "; ".join(changed) or "formatting only",
            keep.name,
        )
    atomic_write_text(path, text)


def _diff(a: object, b: object, prefix: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[tuple[str, Any, Any]] = []
        for k in list(a) + [k for k in b if k not in a]:
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [(prefix[:-1], a, b)]
