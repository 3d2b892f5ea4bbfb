"""A resume's trim of the run's JSONL files: the rows of steps the resumed run writes again are
dropped, the file replaced atomically (a kill midway leaves it whole)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crl_train.service.checkpoint import atomic_write_text

log = logging.getLogger(__name__)


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
    _, t = truncate_jsonl(
        run_dir / "trajectories.jsonl", lambda r: int(r.get("rollout_step") or 0) <= step
    )
    if m or t:
        log.info(
            "resume from step %d: dropped %d metrics rows and %d trajectories of later steps",
            step,
            m,
            t,
        )
    return {"metrics": m, "trajectories": t}
