"""Run-directory outputs: metrics.jsonl, TensorBoard events, PNG curves, checkpoint swap, resume trims.

Layout of a run directory::

    config.yaml          the resolved config (rewritten by a resume that changes it; the previous
                         one is kept as config.before_step<N>.yaml)
    metrics.jsonl        one JSON object per logged actor step (see ``metric_fields``)
    tb/                  TensorBoard events
    curves.png           main curves
    checkpoint/          actor/, extractor/, state.json (state.json written last: it marks a complete checkpoint)
    bank/                the experience bank (SQLite + index) and bank.jsonl export
    trajectories.jsonl   every finished episode's distillation request (offline_exp source)
    eval.json            held-out evaluation (crl-eval / end of training)

>>> metric_fields()[:3]
('step', 'actor_loss', 'actor_clip_frac')
>>> len(metric_fields(EDGE_FIELDS + SELF_DISTILL_FIELDS)) - len(metric_fields())
6
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from crl_train.methods.base import SELF_DISTILL_FIELDS
from crl_train.methods.edge import EDGE_FIELDS

if TYPE_CHECKING:
    from crl_train.config import TrainConfig

log = logging.getLogger(__name__)

# The declaration of a metrics row's keys (a method's own keys are declared in its module): the
# trainer fills rows through ``make_row`` (which rejects an undeclared key), the plots read them,
# docs/training.md documents them (tests/test_outputs.py checks both directions).
ACTOR_FIELDS: tuple[str, ...] = ("actor_loss", "actor_clip_frac", "actor_approx_kl", "actor_grad_norm")
"""Actor update; null when the actor did not train this step."""
STEP_FIELDS: tuple[str, ...] = (
    "success", "success_guided", "success_free", "actions_per_episode", "turns_per_episode",
    "adv_mean", "adv_std", "adv_abs_mean", "bank_size", "search_latency_s", "queue_depth", "extractor_reward",
    "extractor_updates", "extractor_loss", "buffer_size", "distilled", "distill_batches", "malformed", "added",
    "updated", "credited", "uncreditable", "merges", "merge_failures", "track_errors", "extractor_alive", "skipped_distill",
    "skipped_updates", "env_errors", "context_truncations", "step_time_s", "rollout_time_s", "update_time_s",
)
"""Every step's rollout, bank and background-track columns."""
METRIC_FIELDS: tuple[str, ...] = ("step", *ACTOR_FIELDS, *STEP_FIELDS)
"""Columns every metrics row has (``metric_fields`` adds the method's own)."""
ALL_METRIC_FIELDS: tuple[str, ...] = (*METRIC_FIELDS, *EDGE_FIELDS, *SELF_DISTILL_FIELDS)
"""Every key a row may have: :data:`METRIC_FIELDS` and each method's own."""


def metric_fields(extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The exact keys of a metrics row: every row's, then a method's own (``Method.metric_fields``)."""
    unknown = sorted(set(extra) - set(ALL_METRIC_FIELDS))
    if unknown:
        raise KeyError(f"metrics keys {unknown} are not declared in crl_train.run.outputs (declare them there)")
    return (*METRIC_FIELDS, *extra)


def make_row(fields: tuple[str, ...], values: dict[str, Any]) -> dict[str, Any]:
    """A row with exactly ``fields`` (missing ones None); an undeclared key is a programming error.

    >>> make_row(("step", "success"), {"step": 3})
    {'step': 3, 'success': None}
    """
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise KeyError(f"metrics keys {unknown} are not declared in crl_train.run.outputs (declare them there)")
    return {k: values.get(k) for k in fields}


# ---------------------------------------------------------------------------- atomic files
def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to a temp file beside ``path``, fsync it, and rename it over ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def truncate_jsonl(path: Path, keep: Callable[[dict[str, Any]], bool]) -> tuple[int, int]:
    """Keep the rows of ``path`` for which ``keep(row)`` holds, atomically; returns (kept, dropped).

    A line that does not parse (a write cut by a kill) is dropped, counted and logged.
    """
    if not path.exists():
        return 0, 0
    kept: list[str] = []
    dropped = 0
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s:%d: unreadable row dropped on resume (cut by the kill)", path, i)
            dropped += 1
            continue
        if keep(row):
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        atomic_write_text(path, "".join(x + "\n" for x in kept))
    return len(kept), dropped


def trim_run_outputs(run_dir: Path, step: int) -> dict[str, int]:
    """Resume from checkpoint ``step``: drop the rows of steps the resumed run will write again."""
    _, m = truncate_jsonl(run_dir / "metrics.jsonl", lambda r: int(r.get("step", 0)) <= step)
    _, t = truncate_jsonl(run_dir / "trajectories.jsonl", lambda r: int(r.get("rollout_step") or 0) <= step)
    if m or t:
        log.info("resume from step %d: dropped %d metrics rows and %d trajectories of later steps", step, m, t)
    return {"metrics": m, "trajectories": t}


# ---------------------------------------------------------------------------- checkpoints
CKPT = "checkpoint"
STATE = "state.json"


def _ckpt_step(d: Path) -> int | None:
    try:
        return int(json.loads((d / STATE).read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def commit_checkpoint(run_dir: Path, tmp: Path, state: dict[str, Any]) -> Path:
    """Make ``tmp`` (weights already in it) the run's checkpoint.

    ``state.json`` is written last and atomically, so a directory with one is complete. The swap
    is ``checkpoint → checkpoint.old``, ``tmp → checkpoint``; a kill between the two renames
    leaves two complete directories and no ``checkpoint/``, which ``resolve_checkpoint`` repairs.
    """
    atomic_write_text(tmp / STATE, json.dumps(state))
    final, old = run_dir / CKPT, run_dir / (CKPT + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def resolve_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of ``run_dir``, moved to ``checkpoint/`` if a kill left it elsewhere.

    Candidates: ``checkpoint/``, ``checkpoint.tmp/`` and ``checkpoint.old/``, complete when their
    ``state.json`` reads; the highest step wins (``checkpoint/`` on a tie). None: no checkpoint.
    """
    names = (CKPT, CKPT + ".tmp", CKPT + ".old")
    found = [(s, -i, run_dir / n) for i, n in enumerate(names) if (s := _ckpt_step(run_dir / n)) is not None]
    if not found:
        return None
    step, _, best = max(found)
    final = run_dir / CKPT
    if best != final:
        log.warning("resume: %s (step %d) is the newest complete checkpoint (a kill interrupted the swap); "
                    "moving it to %s", best.name, step, final.name)
        if final.exists():
            final.rename(run_dir / (CKPT + ".stale"))
            shutil.rmtree(run_dir / (CKPT + ".stale"), ignore_errors=True)
        best.rename(final)
    for n in names[1:]:
        shutil.rmtree(run_dir / n, ignore_errors=True)
    return final


class MetricsWriter:
    """Appends rows to metrics.jsonl and TensorBoard (when tensorboard is installed).

    ``purge_step`` (resume): TensorBoard hides the events at and after it that the killed run wrote.
    """

    def __init__(self, run_dir: Path, purge_step: int | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.tb: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=purge_step)
        except Exception as exc:  # noqa: BLE001 - TensorBoard is optional
            log.warning("TensorBoard disabled: %s", exc)

    def write(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(clean) + "\n")
        if self.tb is not None:
            step = int(row.get("step", 0))
            for k, v in clean.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None:
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s:%d: unreadable metrics row skipped", path, i)
    return rows


def plot_curves(run_dir: Path) -> Path | None:
    """curves.png: success (guided / free / all), actions per episode, bank size, extractor reward."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    rows = read_metrics(path)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]

    def series(key: str) -> list[float]:
        return [float(r[key]) if r.get(key) is not None else float("nan") for r in rows]

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    ax = axes[0][0]
    for key in ("success", "success_guided", "success_free"):
        ax.plot(steps, series(key), label=key)
    ax.set_title("success rate")
    ax.legend()
    axes[0][1].plot(steps, series("actions_per_episode"))
    axes[0][1].set_title("actions per episode")
    axes[1][0].plot(steps, series("bank_size"))
    axes[1][0].set_title("bank size")
    axes[1][1].plot(steps, series("extractor_reward"), label="extractor reward")
    axes[1][1].plot(steps, series("actor_loss"), label="actor loss")
    axes[1][1].legend()
    axes[1][1].set_title("extractor reward / actor loss")
    for a in axes.flat:
        a.set_xlabel("actor step")
    fig.tight_layout()
    out = run_dir / "curves.png"
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------- config.yaml
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
