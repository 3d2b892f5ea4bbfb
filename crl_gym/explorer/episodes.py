"""The episodes an entry guided, where the run kept them: its ``trajectories.jsonl`` (one
distillation request per finished episode, ``crl_train/run/trainer.py``).

The file is read once into a per-entry index of small summaries and read again only when it has
grown or changed; a line that is not a request is skipped and counted (the run may be writing
its last line as we read).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import TypedDict

log = logging.getLogger(__name__)
TRAJECTORIES = "trajectories.jsonl"
MAX_TASK_CHARS = 300


class EpisodeSummary(TypedDict):
    """One guided episode of an entry, as ``trajectories.jsonl`` has it (the explorer shows it)."""

    step: int | None
    """The rollout step (``rollout_step``)."""
    condition: str | None
    success: bool
    outcome: float | None
    env_id: str | None
    seed: int | None
    actions: int
    """How many steps the trajectory has."""
    task: str
    """The task, cut to ``MAX_TASK_CHARS``."""
    request_id: str | None
    version: int | None
    """The version of the entry the episode was shown (``None`` for a gated entry)."""


class EpisodeIndex:
    """Entry id → the episodes it guided (``step``, ``condition``, ``success``, ``outcome``,
    ``env_id``, ``seed``, ``actions``, ``task``, ``request_id``), read from a run directory."""

    def __init__(self, run_dir: Path | None) -> None:
        self.path = None if run_dir is None else run_dir / TRAJECTORIES
        self.skipped = 0
        self._key: tuple[int, int] | None = None
        self._by_entry: dict[int, list[EpisodeSummary]] = {}
        self._lock = threading.Lock()

    def available(self) -> bool:
        return self.path is not None and self.path.is_file()

    def for_entry(self, entry_id: int) -> list[EpisodeSummary] | None:
        """The entry's episodes in file order, or ``None`` when the run kept none (no file)."""
        if self.path is None or not self.path.is_file():
            return None
        with self._lock:
            st = self.path.stat()
            if self._key != (st.st_mtime_ns, st.st_size):
                self._read(self.path)
                self._key = (st.st_mtime_ns, st.st_size)
            return list(self._by_entry.get(int(entry_id), []))

    def _read(self, path: Path) -> None:
        by_entry: dict[int, list[EpisodeSummary]] = {}
        skipped = 0
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    d = json.loads(line)
                    exp = d.get("experience") or {}
                    gate = (d.get("meta") or {}).get("gate")
                    entry = (
                        exp.get("id")
                        if exp
                        else (gate or {}).get("entry")
                        if isinstance(gate, dict)
                        else None
                    )
                    if entry is None:
                        continue
                    by_entry.setdefault(int(entry), []).append(
                        {
                            "step": d.get("rollout_step"),
                            "condition": d.get("condition"),
                            "success": bool(d.get("success")),
                            "outcome": d.get("outcome"),
                            "env_id": d.get("env_id"),
                            "seed": d.get("seed"),
                            "actions": len((d.get("trajectory") or {}).get("steps") or []),
                            "task": str(d.get("task", ""))[:MAX_TASK_CHARS],
                            "request_id": d.get("request_id"),
                            "version": exp.get("version") if exp else None,
                        }
                    )
                except (ValueError, TypeError, AttributeError):
                    skipped += 1
        if skipped:
            log.warning("%s: %d lines that are not episodes were skipped", path, skipped)
        self._by_entry, self.skipped = by_entry, skipped
