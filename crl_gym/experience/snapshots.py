"""Named snapshots of a bank, kept under its own directory: ``BANK/snapshots/NAME/``.

A snapshot is what :meth:`ExperienceManager.snapshot` writes (the database with its WAL folded
in, the index, the queued requests) plus ``snapshot.json`` (name, time, entries, queued
requests), written last: a directory without it is an unfinished snapshot and is not listed.
:func:`restore_snapshot` makes the bank that snapshot again; it first snapshots the current
state as ``before-restore-TIME``, so a restore can itself be undone.

>>> import tempfile
>>> from crl_gym.experience.bank import ExperienceBank
>>> from crl_gym.experience.embedders import HashingEmbedder
>>> from crl_gym.experience.manager import ExperienceManager
>>> from crl_gym.protocol import AddOp
>>> tmp = tempfile.TemporaryDirectory()
>>> m = ExperienceManager(ExperienceBank(tmp.name, dim=16), HashingEmbedder(16))
>>> _ = m.apply_ops([AddOp("go north")])
>>> take_snapshot(m, "first").entries
1
>>> _ = m.apply_ops([AddOp("go east")])
>>> _ = restore_snapshot(m, "first")
>>> len(m.bank), [s.name.split("-2")[0] for s in list_snapshots(m.bank.path)]
(1, ['before-restore', 'first'])
>>> m.close(); m.bank.close(); tmp.cleanup()
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from crl_gym.json_types import SnapshotInfoDict

if TYPE_CHECKING:
    from crl_gym.experience.manager import ExperienceManager

SNAPSHOTS = "snapshots"
INFO = "snapshot.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


@dataclass(frozen=True)
class SnapshotInfo:
    """One snapshot of a bank (``snapshot.json``)."""

    name: str
    created_at: float
    entries: int
    pending: int
    path: str

    def to_dict(self) -> SnapshotInfoDict:
        return {
            "name": self.name,
            "created_at": self.created_at,
            "entries": self.entries,
            "pending": self.pending,
            "path": self.path,
        }


def snapshot_dir(bank_dir: Path) -> Path:
    return Path(bank_dir) / SNAPSHOTS


def check_name(name: str) -> str:
    """``name`` if it can name a snapshot directory, else a ``ValueError`` saying what can."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            "snapshot name must be 1-100 letters, digits, '.', '_' or '-' (not first), "
            f"got {name!r}"
        )
    return name


def default_name(prefix: str = "") -> str:
    return (
        prefix
        + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        + f"-{time.time_ns() % 1_000_000:06d}"
    )


def _bank_dir(manager: ExperienceManager) -> Path:
    if manager.bank.path is None:
        raise ValueError("an in-memory bank has no directory to keep snapshots in")
    return manager.bank.path


def take_snapshot(manager: ExperienceManager, name: str | None = None) -> SnapshotInfo:
    """Snapshot the manager's bank and queue as ``name`` (default: the UTC time); refuses a name
    in use."""
    root = snapshot_dir(_bank_dir(manager))
    name = check_name(name) if name is not None else default_name()
    target = root / name
    if target.exists():
        if (target / INFO).is_file():
            raise FileExistsError(f"snapshot {name!r} exists already ({target}); pick another name")
        shutil.rmtree(target)  # an unfinished one (a kill midway): start over
    tmp = root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    manager.bank.flush_stats()
    manager.snapshot(tmp)
    info = SnapshotInfo(
        name,
        time.time(),
        len(manager.bank),
        _count_lines(tmp / "pending_requests.jsonl"),
        str(target),
    )
    (tmp / INFO).write_text(json.dumps(info.to_dict()))
    tmp.rename(target)
    return info


def _count_lines(path: Path) -> int:
    if not path.is_file():
        return 0
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def list_snapshots(bank_dir: Path) -> list[SnapshotInfo]:
    """The finished snapshots of the bank in ``bank_dir``, newest first."""
    root = snapshot_dir(bank_dir)
    out = []
    for d in root.iterdir() if root.is_dir() else ():
        try:
            raw = json.loads((d / INFO).read_text())
            out.append(
                SnapshotInfo(
                    raw["name"],
                    float(raw["created_at"]),
                    int(raw["entries"]),
                    int(raw.get("pending", 0)),
                    str(d),
                )
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unfinished, or not a snapshot
    return sorted(out, key=lambda s: s.created_at, reverse=True)


def find_snapshot(bank_dir: Path, name: str) -> Path:
    d = snapshot_dir(bank_dir) / check_name(name)
    if not (d / INFO).is_file():
        names = ", ".join(s.name for s in list_snapshots(bank_dir)) or "none"
        raise FileNotFoundError(
            f"no snapshot {name!r} of the bank {bank_dir} (its snapshots: {names})"
        )
    return d


def restore_snapshot(manager: ExperienceManager, name: str) -> SnapshotInfo:
    """Make the bank and the queue the snapshot ``name``; the state before is kept as the snapshot
    ``before-restore-TIME`` (returned)."""
    source = find_snapshot(_bank_dir(manager), name)
    before = take_snapshot(manager, default_name("before-restore-"))
    manager.restore(source)
    return before


def prune_snapshots(bank_dir: Path, prefix: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` snapshots whose name starts with ``prefix``; returns
    their names."""
    gone = [s for s in list_snapshots(bank_dir) if s.name.startswith(prefix)][keep:]
    for s in gone:
        (Path(s.path) / INFO).unlink(
            missing_ok=True
        )  # first: a kill midway leaves no half snapshot listed
        shutil.rmtree(s.path, ignore_errors=True)
    return [s.name for s in gone]
