"""Run-directory outputs: metrics.jsonl, TensorBoard events, PNG curves, checkpoint swap, resume trims.

Layout of a run directory::

    config.yaml          the resolved config (rewritten by a resume that changes it; the previous
                         one is kept as config.before_step<N>.yaml)
    metrics.jsonl        one JSON object per logged actor step (see ``metric_fields``)
    tb/                  TensorBoard events
    curves.png           main curves
    checkpoint/          actor/, extractor/, state.json (state.json written last: it marks a complete checkpoint)
    checkpoint.old/      the previous checkpoint, kept until the next one is being written
    bank/                the experience bank (SQLite + index) and bank.jsonl export
    trajectories.jsonl   every finished episode's distillation request (offline_exp source)
    eval.json            held-out evaluation (crl-eval / end of training)

>>> metric_fields()[:3]
('step', 'actor_loss', 'actor_objective')
>>> len(metric_fields(SELF_DISTILL_FIELDS)) - len(metric_fields())
2
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

# each method declares its own keys; these are re-exported for the readers of this module
from crl_train.methods import EDGE_FIELDS as EDGE_FIELDS
from crl_train.methods import GATE_FIELDS as GATE_FIELDS
from crl_train.methods import SELF_DISTILL_FIELDS as SELF_DISTILL_FIELDS
from crl_train.methods import declared_metric_fields
from crl_train.service.checkpoint import CKPT, OLD, STATE, TMP, discard_checkpoint
from crl_train.service.checkpoint import atomic_write_text as atomic_write_text
from crl_train.service.checkpoint import begin_checkpoint as begin_checkpoint
from crl_train.service.checkpoint import commit_checkpoint as commit_checkpoint
from crl_train.service.service import row_columns

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from crl_train.config import TrainConfig

log = logging.getLogger(__name__)

# A metrics row's keys, each declared by what produces it: the actor update and the rollout here,
# the experience service's counters by the service (``row_columns``: its stats dataclass), a
# method's own by the method (``declared_fields``). The trainer fills rows through ``make_row``
# (which rejects an undeclared key), the plots read them, docs/training.md documents them
# (tests/test_outputs.py checks both directions).
ACTOR_FIELDS: tuple[str, ...] = ("actor_loss", "actor_objective", "actor_clip_frac", "actor_approx_kl", "actor_grad_norm")
"""Actor update; null when the actor did not train this step."""
ROLLOUT_FIELDS: tuple[str, ...] = (
    "success", "success_guided", "success_free", "success_by_env", "actions_per_episode", "turns_per_episode",
    "adv_mean", "adv_std", "adv_abs_mean", "search_latency_s", "env_errors", "context_truncations", "extractor_alive",
)
"""Every step's rollout columns (``extractor_alive``: the service's ``extractor`` status, as a bool)."""
SERVICE_FIELDS: tuple[str, ...] = tuple(row_columns())
"""The experience service's columns (:func:`crl_train.service.service.row_columns`)."""
TIME_FIELDS: tuple[str, ...] = ("step_time_s", "rollout_time_s", "update_time_s")
"""Seconds of the step and of its rollout and update."""
STEP_FIELDS: tuple[str, ...] = (*ROLLOUT_FIELDS, *SERVICE_FIELDS, *TIME_FIELDS)
"""Every step's rollout, bank and background-track columns."""
METRIC_FIELDS: tuple[str, ...] = ("step", *ACTOR_FIELDS, *STEP_FIELDS)
"""Columns every metrics row has (``metric_fields`` adds the method's own)."""
ALL_METRIC_FIELDS: tuple[str, ...] = (*METRIC_FIELDS, *declared_metric_fields())
"""Every key a row may have: :data:`METRIC_FIELDS` and each method's own."""

_UNDECLARED = "are not declared (a method's own keys go in its declared_fields, the service's in its stats)"


def metric_fields(extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The exact keys of a metrics row: every row's, then a method's own (``Method.metric_fields``)."""
    unknown = sorted(set(extra) - set(ALL_METRIC_FIELDS))
    if unknown:
        raise KeyError(f"metrics keys {unknown} {_UNDECLARED}")
    return (*METRIC_FIELDS, *extra)


def make_row(fields: tuple[str, ...], values: dict[str, Any]) -> dict[str, Any]:
    """A row with exactly ``fields`` (missing ones None); an undeclared key is a programming error.

    >>> make_row(("step", "success"), {"step": 3})
    {'step': 3, 'success': None}
    """
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise KeyError(f"metrics keys {unknown} {_UNDECLARED}")
    return {k: values.get(k) for k in fields}


# ---------------------------------------------------------------------------- atomic files
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
# written by crl_train.service.checkpoint (begin_checkpoint / commit_checkpoint); found and settled here


class ResumeError(RuntimeError):
    """A checkpoint cannot be resumed from; the message names the file and what to do instead."""


def read_checkpoint_state(d: Path) -> dict[str, Any]:
    """``d/state.json`` as a dict with a non-negative int ``step``; :class:`ResumeError` naming it otherwise."""
    path = d / STATE
    try:
        state = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ResumeError(f"{path} is missing: {d.name}/ is not a complete checkpoint") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ResumeError(f"{path} is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict):
        raise ResumeError(f"{path} holds a {type(state).__name__}, not a checkpoint state")
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ResumeError(f"{path}: 'step' must be a non-negative integer, got {step!r}")
    return state


def _ckpt_step(d: Path) -> int | None:
    try:
        return int(read_checkpoint_state(d)["step"])
    except ResumeError:
        return None


@dataclass(frozen=True)
class Checkpoint:
    """The checkpoint a resume loads from, found without changing the run directory."""

    path: Path
    """Its directory: ``checkpoint/``, or ``checkpoint.tmp/`` / ``checkpoint.old/`` after a kill mid-swap."""
    step: int
    state: dict[str, Any]
    """Its ``state.json``."""
    previous: tuple[tuple[Path, int], ...] = ()
    """Other complete checkpoints of the run (directory, step), newest first: what to try instead."""

    def alternatives(self) -> str:
        """The advice a failed resume gives: the previous checkpoint, and how to use it."""
        run_dir = self.path.parent
        if not self.previous:
            return (f"No earlier checkpoint is kept in {run_dir}: restore a copy of an earlier checkpoint/ "
                    f"into it, or start the run afresh in a new directory")
        path, step = self.previous[0]
        return (f"The previous checkpoint, {path} (step {step}), is complete: resume from it by moving "
                f"{self.path.name}/ aside and {path.name}/ to {CKPT}/ (e.g. mv {self.path} {run_dir / (CKPT + '.broken')}"
                f" && mv {path} {run_dir / CKPT}), then run --resume again")


def find_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The newest complete checkpoint of ``run_dir``, read but not moved (None: there is none).

    Candidates: ``checkpoint/``, ``checkpoint.tmp/`` and ``checkpoint.old/``, complete when their
    ``state.json`` reads; the highest step wins (``checkpoint/`` on a tie). ``checkpoint/`` is
    never written without its ``state.json``, so one that does not read is damaged: a
    :class:`ResumeError` names its file and the previous checkpoint, rather than silently
    resuming from an older one.
    """
    names = (CKPT, TMP, OLD)
    found: list[tuple[int, int, Path, dict[str, Any]]] = []
    final = run_dir / CKPT
    for i, n in enumerate(names):
        d = run_dir / n
        if not d.is_dir():
            continue
        try:
            state = read_checkpoint_state(d)
        except ResumeError as exc:
            if n != CKPT:
                continue  # an interrupted write (tmp) or a leftover: not a checkpoint
            others = [(run_dir / m, s) for m in names[1:] if (s := _ckpt_step(run_dir / m)) is not None]
            hint = Checkpoint(final, -1, {}, tuple(sorted(others, key=lambda x: -x[1]))).alternatives()
            raise ResumeError(f"cannot resume {run_dir}: {exc}. Nothing in {run_dir} was changed. {hint}") from None
        found.append((int(state["step"]), -i, d, state))
    if not found:
        return None
    found.sort(key=lambda x: (x[0], x[1]), reverse=True)
    step, _, best, state = found[0]
    return Checkpoint(best, step, state, tuple((d, s) for s, _, d, _ in found[1:] if s < step))


def settle_checkpoint(run_dir: Path, ckpt: Checkpoint) -> Path:
    """After a successful resume from ``ckpt``: move it to ``checkpoint/`` if a kill left it
    elsewhere, keep the newest older complete one as ``checkpoint.old/``, drop the rest."""
    final, tmp, old = run_dir / CKPT, run_dir / TMP, run_dir / OLD
    prev = next((d for d, _ in ckpt.previous if (d / STATE).exists()), None)
    if ckpt.path != final:
        log.warning("resume: %s (step %d) is the newest complete checkpoint (a kill interrupted the swap); "
                    "moving it to %s", ckpt.path.name, ckpt.step, final.name)
        if final.exists():
            if prev == final:
                parked = run_dir / (CKPT + ".prev")
                discard_checkpoint(parked)
                final.rename(parked)
                prev = parked
            else:
                discard_checkpoint(final)
        ckpt.path.rename(final)
    if prev is None:
        discard_checkpoint(old)
    elif prev != old:
        discard_checkpoint(old)
        prev.rename(old)
    discard_checkpoint(tmp)  # never kept: it was renamed above if it was the newest or the previous
    return final


def resolve_checkpoint(run_dir: Path) -> Path | None:
    """:func:`find_checkpoint`, then :func:`settle_checkpoint`: the checkpoint's directory, now
    ``checkpoint/`` (None: no checkpoint). A damaged ``checkpoint/`` raises :class:`ResumeError`."""
    ckpt = find_checkpoint(run_dir)
    return None if ckpt is None else settle_checkpoint(run_dir, ckpt)


class MetricsWriter:
    """Appends rows to metrics.jsonl and TensorBoard (when tensorboard is installed).

    ``purge_step`` (resume): TensorBoard hides the events at and after it that the killed run wrote.
    """

    def __init__(self, run_dir: Path, purge_step: int | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.tb: SummaryWriter | None = None
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


def _diff(a: object, b: object, prefix: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[tuple[str, Any, Any]] = []
        for k in list(a) + [k for k in b if k not in a]:
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [(prefix[:-1], a, b)]
