"""``new_entries.jsonl`` of a run directory: every entry the bank gained, as it was written.

The bank keeps an entry's current text and the provenance of its last write: an Update replaces
both (the first text goes to ``history``, the first prompt is gone), and a Merge or Delete removes
the row. What an extractor wrote, for which task and when, is only certain at the moment it is
written; the experiment tables that follow new entries over training (the share that holds its
task's secret, per fifth of training) read it from here.

After each step the trainer appends one line per entry id above the highest id already logged:
``step`` (the entry's ``created_step``: the rollout step of the episode it was distilled from),
``id``, ``text``, ``tags``, ``prompt`` (the extractor's prompt, which names the task; ``null``
for an entry written without one), ``source`` (the task it was distilled from) and ``key`` (what
retrieval matches it by, ``null`` for its text). With an asynchronous extractor an entry is logged
at the first step end that finds it, under its own ``created_step``. A resume rolls the bank back to
its checkpoint, and :func:`trim_new_entries` drops the rows of entries written after it (their ids
are issued again by the resumed run).

>>> import tempfile
>>> from crl_gym.experience import ExperienceBank
>>> from crl_gym.experience.bank import PendingAdd
>>> tmp = tempfile.TemporaryDirectory()
>>> d = Path(tmp.name)
>>> bank = ExperienceBank(None, dim=2)
>>> log = NewEntryLog(bank, d)
>>> _ = bank.apply_batch(adds=[PendingAdd("go north", [1.0, 0.0], 3, ())])
>>> log.record()
1
>>> read_new_entries(d)[0]["step"], read_new_entries(d)[0]["text"]
(3, 'go north')
>>> log.record()
0
>>> tmp.cleanup()
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from crl_gym.experience import ExperienceBank

log = logging.getLogger(__name__)

NEW_ENTRIES = "new_entries.jsonl"


class NewEntryLog:
    """Appends the bank's entries with ids above the highest one seen to
    ``run_dir/new_entries.jsonl``."""

    def __init__(self, bank: ExperienceBank, run_dir: Path) -> None:
        self.bank = bank
        self.path = Path(run_dir) / NEW_ENTRIES
        ids = bank.ids()
        # entries already in the bank (seed entries, a resumed run's) were not written by this start
        self.seen = max(ids) if ids else 0

    def record(self) -> int:
        """Log the entries added since the last call; returns how many."""
        new = [i for i in self.bank.ids() if i > self.seen]
        if not new:
            return 0
        rows = []
        for e in self.bank.get_many(new):
            if e is None:  # removed between the two reads: nothing left to log
                continue
            rows.append(
                {
                    "step": e.created_step,
                    "id": e.id,
                    "text": e.text,
                    "tags": list(e.tags),
                    "prompt": e.provenance.prompt if e.provenance is not None else None,
                    "source": e.source,
                    "key": e.key,
                }
            )
        self.seen = max(new)
        with self.path.open("a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        return len(rows)


def read_new_entries(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of ``run_dir/new_entries.jsonl`` (``[]`` without one); a line that does not parse (a
    write cut by a kill) is skipped, counted and logged."""
    path = Path(run_dir) / NEW_ENTRIES
    if not path.exists():
        return []
    rows, bad = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
        else:
            bad += 1
    if bad:
        log.warning("%s: skipped %d unreadable line(s)", path, bad)
    return rows


def trim_new_entries(run_dir: Path, bank: ExperienceBank) -> int:
    """Drop the rows of entries ``bank`` never issued (written after the checkpoint it was rolled
    back to); returns how many were dropped."""
    from crl_train.run.trim import truncate_jsonl

    _, dropped = truncate_jsonl(
        Path(run_dir) / NEW_ENTRIES,
        lambda r: isinstance(r.get("id"), int) and bank.was_issued(r["id"]),
    )
    return dropped
