"""Finding and settling the checkpoint a resume loads from.

Checkpoints are written by :mod:`crl_train.service.checkpoint` (``begin_checkpoint`` /
``commit_checkpoint``: ``state.json`` last); a kill can leave the newest complete one as
``checkpoint.tmp/`` or ``checkpoint.old/``. :func:`find_checkpoint` reads without moving anything,
:func:`settle_checkpoint` puts the one a resume succeeded from back at ``checkpoint/``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crl_train.service.checkpoint import CKPT, OLD, STATE, TMP, discard_checkpoint

log = logging.getLogger(__name__)


class ResumeError(RuntimeError):
    """A checkpoint cannot be resumed from; the message names the file and what to do instead."""


def read_checkpoint_state(d: Path) -> dict[str, Any]:
    """``d/state.json`` as a dict with a non-negative int ``step``; :class:`ResumeError` naming
    it otherwise."""
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
    """Its directory: ``checkpoint/``, or ``checkpoint.tmp/`` / ``checkpoint.old/`` after a
    kill mid-swap."""
    step: int
    state: dict[str, Any]
    """Its ``state.json``."""
    previous: tuple[tuple[Path, int], ...] = ()
    """Other complete checkpoints of the run (directory, step), newest first: what to
    try instead."""

    def alternatives(self) -> str:
        """The advice a failed resume gives: the previous checkpoint, and how to use it."""
        run_dir = self.path.parent
        if not self.previous:
            return (
                f"No earlier checkpoint is kept in {run_dir}: restore a copy of an earlier "
                "checkpoint/ into it, or start the run afresh in a new directory"
            )
        path, step = self.previous[0]
        return (
            f"The previous checkpoint, {path} (step {step}), is complete: resume from it by moving "
            f"{self.path.name}/ aside and {path.name}/ to {CKPT}/ (e.g. mv {self.path} "
            f"{run_dir / (CKPT + '.broken')} && mv {path} {run_dir / CKPT}), then run "
            "--resume again"
        )


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
            others = [
                (run_dir / m, s) for m in names[1:] if (s := _ckpt_step(run_dir / m)) is not None
            ]
            hint = Checkpoint(
                final, -1, {}, tuple(sorted(others, key=lambda x: -x[1]))
            ).alternatives()
            raise ResumeError(
                f"cannot resume {run_dir}: {exc}. Nothing in {run_dir} was changed. {hint}"
            ) from None
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
        log.warning(
            "resume: %s (step %d) is the newest complete checkpoint (a kill interrupted the swap); "
            "moving it to %s",
            ckpt.path.name,
            ckpt.step,
            final.name,
        )
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
