"""The one checkpoint writer: a directory written whole beside the current one, then swapped in.

Used for a run's ``checkpoint/`` (``crl_train.run``: actor, extractor, state) and for the Ray
service actor's ``service_dir/checkpoint/`` (extractor, state). The next checkpoint is written
into ``checkpoint.tmp/``; its ``state.json`` last, fsync'd and renamed into place, so a directory
with one is complete; then ``checkpoint → checkpoint.old``, ``tmp → checkpoint``. The previous
checkpoint stays as ``checkpoint.old/`` (the one to go back to if ``checkpoint/`` is damaged)
until the next checkpoint begins, so at most two are on disk.

>>> import tempfile, json
>>> tmp = tempfile.TemporaryDirectory()
>>> d = Path(tmp.name)
>>> for step in (1, 2):
...     _ = commit_checkpoint(d, begin_checkpoint(d), {"step": step})
>>> sorted(p.name for p in d.iterdir()), json.loads((d / CKPT / STATE).read_text())
(['checkpoint', 'checkpoint.old'], {'step': 2})
>>> tmp.cleanup()
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

FAULT_ENV = "CRL_KILL_AT"
"""Test hook: ``<point>:<n>`` SIGKILLs this process the n-th time it reaches
``fault_point(<point>)`` (``checkpoint-written``: a checkpoint's files and state are in
``checkpoint.tmp/``, nothing renamed; ``checkpoint-renamed``: between the two renames of the swap,
reached from the second checkpoint on; ``merge-applied``: a Merge committed to the bank, before
anything else of its step). Unset, a point costs one lookup."""
_fault_hits: dict[str, int] = {}

CKPT = "checkpoint"
STATE = "state.json"
TMP, OLD = CKPT + ".tmp", CKPT + ".old"


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to a temp file beside ``path``, fsync it, and rename it over ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fault_point(name: str) -> None:
    """SIGKILL this process here when :data:`FAULT_ENV` names this point and its count is reached
    (deterministic kills for the resume tests; a no-op otherwise)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    point, _, nth = spec.partition(":")
    if point != name:
        return
    _fault_hits[name] = _fault_hits.get(name, 0) + 1
    if _fault_hits[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def discard_checkpoint(d: Path) -> None:
    """Delete a checkpoint directory, its ``state.json`` first: a kill midway leaves no directory
    that looks complete but has lost its weights."""
    if d.exists():
        (d / STATE).unlink(missing_ok=True)
        shutil.rmtree(d, ignore_errors=True)


def begin_checkpoint(root: Path) -> Path:
    """An empty ``checkpoint.tmp/`` under ``root`` to write the next checkpoint into. The checkpoint
    before the current one (``checkpoint.old/``) is deleted first, so at most two are on disk at
    any time."""
    tmp = root / TMP
    discard_checkpoint(tmp)
    if (root / CKPT).exists():
        discard_checkpoint(root / OLD)
    tmp.mkdir(parents=True)
    return tmp


def commit_checkpoint(root: Path, tmp: Path, state: dict[str, Any]) -> Path:
    """Make ``tmp`` (weights already in it) the checkpoint; the current one becomes
    ``checkpoint.old/``.

    ``state.json`` is written last and atomically, so a directory with one is complete. A kill
    between the two renames leaves two complete directories and no ``checkpoint/``, which a
    resume repairs (:func:`crl_train.run.checkpoints.find_checkpoint`, the service actor's
    own lookup).
    """
    atomic_write_text(tmp / STATE, json.dumps(state))
    fault_point("checkpoint-written")
    final, old = root / CKPT, root / OLD
    if final.exists():
        discard_checkpoint(old)
        final.rename(old)
        fault_point("checkpoint-renamed")
    tmp.rename(final)
    return final


__all__ = [
    "CKPT",
    "FAULT_ENV",
    "OLD",
    "STATE",
    "TMP",
    "atomic_write_text",
    "begin_checkpoint",
    "commit_checkpoint",
    "discard_checkpoint",
    "fault_point",
]
