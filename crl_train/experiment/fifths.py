"""What the extractor writes and what it earns, per fifth of training: three tables of a
suite's report.

Each cell's steps ``0 .. steps−1`` are cut into :data:`PARTS` equal spans (step t is in part
``t · PARTS // steps``). Per span and cell:

* **new entries that hold their task's secret** (``crl/Recall-v0`` only): of the entries written
  from the episodes of that span (the run's ``new_entries.jsonl``, :mod:`crl_train.run.new_entries`:
  each entry as first written, with its prompt), the share whose action words are exactly the secret
  of the task they were written for (:func:`crl_gym.envs.recall.holds_secret`);
* **guided episodes shown an entry of their own task**: of the span's guided episodes that were
  shown an entry (``trajectories.jsonl``), the share whose entry was distilled from an episode of
  the same task (the task its prompt names, ``new_entries.jsonl``). Retrieval embeds the entry's
  text, so an entry that does not name its task lands on any task; then its credit is the outcome
  of another task's episode;
* **r̄(m) of the entries retrieved**: the bank's ``credit`` events of the span's steps (one per entry
  and step: r̄(m) of that step over ``n`` episodes, what B_φ trained on); per entry the mean over
  all its episodes in the span, then the mean over the entries;
* **guided success**: the mean of the span's ``success_guided`` metrics rows.

Then per method the mean over seeds with a t interval, and per contrast (a, b) the paired difference
a − b over the seeds both have a value for.

>>> part_of(0, 10), part_of(9, 10), part_of(3, 7), part_of(12, 10)
(0, 4, 2, 4)
"""

from __future__ import annotations

import json
import sqlite3
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from crl_train.experiment.suite import CellRecord, record_dir
from crl_train.run.stats import LEVEL, mean_t, paired_difference

RECALL = "crl/Recall-v0"
TASK_SECTION = "\n## Task\n"
"""Where a distillation prompt names its episode's task
(``crl_gym.templates.DISTILLATION_TEMPLATE``)."""
PARTS = 5
"""Training is cut into this many equal spans of steps."""

Parts = list[float | None]
"""One value per span of training (None: nothing to measure in that span)."""


def part_of(step: int, steps: int, parts: int = PARTS) -> int:
    """The span of training step ``step`` of a ``steps``-step run is in (a later step: the
    last span)."""
    if steps < 1:
        raise ValueError(f"part_of: a run has at least one step, got steps={steps}")
    return min(parts - 1, max(0, int(step)) * parts // steps)


def _means(values: Sequence[tuple[int, float]], steps: int, parts: int) -> Parts:
    by: dict[int, list[float]] = defaultdict(list)
    for step, v in values:
        by[part_of(step, steps, parts)].append(v)
    return [sum(by[p]) / len(by[p]) if by.get(p) else None for p in range(parts)]


def guided_success_by_part(rows: Sequence[dict[str, Any]], steps: int, parts: int = PARTS) -> Parts:
    """Mean ``success_guided`` of each span's metrics rows.

    >>> rows = [{"step": 0, "success_guided": 0.5}, {"step": 1, "success_guided": 1.0},
    ...         {"step": 2, "success_guided": None}, {"step": 3, "success_guided": 0.0}]
    >>> guided_success_by_part(rows, steps=4, parts=2)
    [0.75, 0.0]
    """
    return _means(
        [
            (int(r["step"]), float(r["success_guided"]))
            for r in rows
            if r.get("success_guided") is not None and "step" in r
        ],
        steps,
        parts,
    )


def recall_verdict(cell_dir: Path) -> Callable[[str, str], bool | None]:
    """``verdict(text, context)``: whether an entry of the cell holds its task's secret, for the
    cell's Recall settings (``env.kwargs`` of its ``config.yaml``; the env's defaults otherwise)."""
    from crl_gym.envs.recall import RecallEnv, holds_secret

    cfg = cell_dir / "config.yaml"
    data = (yaml.safe_load(cfg.read_text(encoding="utf-8")) or {}) if cfg.exists() else {}
    kwargs = (data.get("env") or {}).get("kwargs") or {}
    defaults = RecallEnv()
    length = int(kwargs.get("length", defaults.length))
    num_actions = int(kwargs.get("num_actions", defaults.num_actions))
    secret_seed = int(kwargs.get("secret_seed", defaults.secret_seed))

    def verdict(text: str, context: str) -> bool | None:
        return holds_secret(
            text, context, length=length, num_actions=num_actions, secret_seed=secret_seed
        )

    return verdict


def new_entry_verdicts(cell_dir: Path) -> list[tuple[dict[str, Any], bool]]:
    """Each new entry of a Recall cell with whether it holds its task's secret (the task named by
    its prompt, else by the entry itself; an entry that names no task does not hold one)."""
    from crl_train.run.new_entries import read_new_entries

    verdict = recall_verdict(cell_dir)
    out = []
    for row in read_new_entries(cell_dir):
        text = str(row.get("text", ""))
        out.append((row, bool(verdict(text, str(row.get("prompt") or "") + "\n" + text))))
    return out


def secret_share_by_part(cell_dir: Path, steps: int, parts: int = PARTS) -> Parts:
    """Share of each span's new entries that hold their task's secret (None: no entry written)."""
    return _means(
        [(int(row["step"]), 1.0 if held else 0.0) for row, held in new_entry_verdicts(cell_dir)],
        steps,
        parts,
    )


def credit_events(cell_dir: Path) -> list[tuple[int, int, float, int]] | None:
    """(entry id, step, r̄(m) of the step, episodes) of every ``credit`` event of the cell's bank;
    None when the cell has no bank database or one without the event log."""
    from crl_gym.experience.store import BankCorruptError, open_readonly

    path = cell_dir / "bank" / "bank.sqlite"
    if not path.exists():
        return None
    try:
        conn = open_readonly(path)
    except BankCorruptError:
        return None
    try:
        rows = conn.execute(
            "SELECT entry_id, step, value, n FROM entry_events WHERE kind = 'credit' ORDER BY seq"
        ).fetchall()
    except sqlite3.OperationalError:  # a bank written before the event log
        return None
    finally:
        conn.close()
    return [(int(i), int(s), float(v), int(n or 0)) for i, s, v, n in rows if v is not None]


def source_task(prompt: str | None) -> str | None:
    r"""The task an entry was distilled for, from its prompt: the ``## Task`` section of a
    distillation prompt, or the whole prompt when it is one line (the oracle's prompt is the task).

    >>> source_task("Rules.\n\n## Task\nTask amber badger: repeat it.\n\n## Outcome\nSUCCESS")
    'Task amber badger: repeat it.'
    >>> source_task("Task amber badger: repeat it."), source_task(None)
    ('Task amber badger: repeat it.', None)
    """
    if not prompt:
        return None
    _, sep, rest = prompt.partition(TASK_SECTION)
    if sep:
        return rest.split("\n\n## ", 1)[0].strip()
    return prompt.strip() if "\n" not in prompt.strip() else None


def logged_episodes(cell_dir: Path) -> Iterator[dict[str, Any]]:
    """The cell's finished episodes as their requests (``trajectories.jsonl``, one per line; nothing
    when the cell logged none)."""
    path = cell_dir / "trajectories.jsonl"
    if not path.exists():
        return
    with path.open(encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def guided_requests(cell_dir: Path) -> Iterator[dict[str, Any]]:
    """The cell's guided episodes that were shown an entry."""
    from crl_gym.protocol import GUIDED_CONDITION

    return (
        req
        for req in logged_episodes(cell_dir)
        if req.get("condition") == GUIDED_CONDITION and req.get("experience")
    )


def entry_task(row: dict[str, Any]) -> str | None:
    """The task a ``new_entries.jsonl`` row was distilled from: its ``source``, else the task its
    prompt names."""
    return (row.get("source") or source_task(row.get("prompt")) or "").strip() or None


def own_task_share_by_part(cell_dir: Path, steps: int, parts: int = PARTS) -> Parts:
    """Share of each span's guided episodes shown an entry whose entry was distilled from their own
    task (None: no such episode, or the cell logged no trajectories or new entries)."""
    from crl_train.run.new_entries import read_new_entries

    sources = {int(r["id"]): entry_task(r) for r in read_new_entries(cell_dir)}
    if not sources:
        return [None] * parts
    got = [
        (
            int(req.get("rollout_step") or 0),
            1.0
            if sources.get(int(req["experience"]["id"])) == str(req.get("task", "")).strip()
            else 0.0,
        )
        for req in guided_requests(cell_dir)
    ]
    return _means(got, steps, parts)


def coverage_by_part(cell_dir: Path, steps: int, parts: int = PARTS) -> Parts:
    """At the end of each span, the share of the tasks played so far that have an entry distilled
    from one of their episodes (written up to then; an entry removed since still counts: the bank
    held it).

    None for a cell that logged no trajectories or no new entries.
    """
    from crl_train.run.new_entries import read_new_entries

    written: dict[str, int] = {}
    for r in read_new_entries(cell_dir):
        task = entry_task(r)
        if task:
            written[task] = min(written.get(task, steps), int(r["step"]))
    first_played: dict[str, int] = {}
    for req in logged_episodes(cell_dir):
        task, step = str(req.get("task", "")).strip(), int(req.get("rollout_step") or 0)
        first_played[task] = min(first_played.get(task, step), step)
    if not written or not first_played:
        return [None] * parts
    out: Parts = []
    for p in range(parts):
        end = (p + 1) * steps // parts  # steps of spans 0..p are < end
        seen = [t for t, s in first_played.items() if s < end]
        out.append(sum(written.get(t, steps) < end for t in seen) / len(seen) if seen else None)
    return out


def retrieved_rbar_by_part(cell_dir: Path, steps: int, parts: int = PARTS) -> Parts:
    """Mean over the entries credited in each span of their r̄(m) over the span's episodes."""
    events = credit_events(cell_dir)
    if events is None:
        return [None] * parts
    total: dict[tuple[int, int], float] = defaultdict(float)
    episodes: dict[tuple[int, int], int] = defaultdict(int)
    for entry, step, rbar, n in events:
        key = (part_of(step, steps, parts), entry)
        weight = max(n, 1)  # an event without its episode count counts as one episode
        total[key] += rbar * weight
        episodes[key] += weight
    per_part: dict[int, list[float]] = defaultdict(list)
    for key, s in sorted(total.items()):
        per_part[key[0]].append(s / episodes[key])
    return [sum(per_part[p]) / len(per_part[p]) if per_part.get(p) else None for p in range(parts)]


@dataclass(frozen=True)
class Measure:
    """One table: its title, what it holds, and its per-cell values by span."""

    title: str
    explanation: str
    by_part: Callable[[Path, CellRecord], Parts]
    recall_only: bool = False


def _guided(cell_dir: Path, record: CellRecord) -> Parts:
    from crl_train.run.metrics import read_metrics

    path = cell_dir / "metrics.jsonl"
    return (
        guided_success_by_part(read_metrics(path), int(record["steps"]))
        if path.exists()
        else [None] * PARTS
    )


MEASURES = (
    Measure(
        "New entries that hold their task's secret, per fifth of training",
        "Of the entries written from the episodes of each fifth (`new_entries.jsonl`: each entry "
        "as first written), the share whose action words are exactly the secret of their task "
        "(`crl_gym.envs.recall.holds_secret`).",
        lambda d, r: secret_share_by_part(d, int(r["steps"])),
        recall_only=True,
    ),
    Measure(
        "Entries shown to an episode of their own task, per fifth of training",
        "Of the guided episodes shown an entry (`trajectories.jsonl`), the share whose entry was "
        "distilled from an episode of the same task (the task its prompt names, "
        "`new_entries.jsonl`): an entry found for another task is credited with that "
        "task's outcome.",
        lambda d, r: own_task_share_by_part(d, int(r["steps"])),
    ),
    Measure(
        "Tasks with an entry of their own, at the end of each fifth of training",
        "Of the tasks played up to the end of the fifth (`trajectories.jsonl`), the share that an "
        "entry was distilled from by then (`new_entries.jsonl`): the coverage of the bank, which "
        "the distillation rule (`experience.distill_per_group`, "
        "`experience.distill_fraction`) decides.",
        lambda d, r: coverage_by_part(d, int(r["steps"])),
    ),
    Measure(
        "r̄(m) of the entries retrieved, per fifth of training",
        "Per entry credited in the fifth (the bank's `credit` events: r̄(m) of a step over its "
        "episodes, what B_φ trains on), its r̄(m) over the fifth's episodes; then the mean over "
        "those entries. r(m) = +1 when the episode it guided succeeded, −1 otherwise.",
        lambda d, r: retrieved_rbar_by_part(d, int(r["steps"])),
    ),
    Measure(
        "Guided success, per fifth of training",
        "Mean of `success_guided` (the guided half of each rollout group) over the fifth's steps.",
        _guided,
    ),
)


def values(
    records: Sequence[CellRecord], out: Path, measure: Measure
) -> dict[str, dict[int, Parts]]:
    """method → seed → the measure's values by span, for every cell that has its run directory."""
    got: dict[str, dict[int, Parts]] = defaultdict(dict)
    for r in records:
        d = record_dir(out, r)
        if d.is_dir():
            got[r["method"]][int(r["seed"])] = measure.by_part(d, r)
    return got


def table_rows(
    per_method: dict[str, dict[int, Parts]],
    methods: Sequence[str],
    contrasts: Sequence[tuple[str, str]],
    parts: int = PARTS,
) -> list[str]:
    """Markdown rows: each method's mean over seeds per span, then each contrast's
    paired difference."""
    rows = []
    for m in methods:
        seeds = per_method.get(m, {})
        if not seeds or all(v is None for vs in seeds.values() for v in vs):
            continue
        cells = [
            mean_t([v for vs in seeds.values() if (v := vs[p]) is not None]).text()
            for p in range(parts)
        ]
        rows.append(f"| {m} | {len(seeds)} | " + " | ".join(cells) + " |")
    for a, b in contrasts:
        da, db = per_method.get(a, {}), per_method.get(b, {})
        common = sorted(set(da) & set(db))
        if not common:
            continue
        cells = []
        for p in range(parts):
            xs, ys = _paired(da, db, p)
            cells.append(paired_difference(xs, ys).text() if xs else "n/a")
        if all(c == "n/a" for c in cells):
            continue
        rows.append(f"| **{a} − {b}** (paired) | {len(common)} | " + " | ".join(cells) + " |")
    return rows


def _paired(
    da: dict[int, Parts], db: dict[int, Parts], part: int
) -> tuple[list[float], list[float]]:
    """The values of span ``part`` of the seeds where both a and b have one, in seed order."""
    xs: list[float] = []
    ys: list[float] = []
    for s in sorted(set(da) & set(db)):
        x, y = da[s][part], db[s][part]
        if x is not None and y is not None:
            xs.append(x)
            ys.append(y)
    return xs, ys


def last_part_contrast(
    per_method: dict[str, dict[int, Parts]], a: str, b: str
) -> tuple[str, bool | None]:
    """The paired difference a − b in the last span as text, and whether its interval excludes 0
    (None: no interval, fewer than two seeds with both values)."""
    da, db = per_method.get(a, {}), per_method.get(b, {})
    iv = paired_difference(*_paired(da, db, -1))
    if iv.low is None or iv.high is None:
        return iv.text(), None
    return iv.text(), iv.low > 0 or iv.high < 0


def is_recall(records: Sequence[CellRecord]) -> bool:
    return bool(records) and all(tuple(r["envs"]) == (RECALL,) for r in records)


def fifths_tables(
    records: Sequence[CellRecord],
    methods: Sequence[str],
    out: Path,
    contrasts: Sequence[tuple[str, str]],
) -> list[str]:
    """Markdown: the three tables of the module docstring (the secret share on Recall
    suites only)."""
    head = (
        "| method | seeds | "
        + " | ".join(f"steps {p * 100 // PARTS}–{(p + 1) * 100 // PARTS} %" for p in range(PARTS))
        + " |",
        "| --- | --- |" + " --- |" * PARTS,
    )
    lines: list[str] = []
    for measure in MEASURES:
        if measure.recall_only and not is_recall(records):
            continue
        rows = table_rows(values(records, out, measure), methods, contrasts)
        if rows:
            lines += [
                f"## {measure.title}",
                "",
                measure.explanation + f" Mean over seeds ({int(LEVEL * 100)} % t "
                "interval); a paired row is the difference over the same seeds (paired t).",
                "",
                *head,
                *rows,
                "",
            ]
    return lines


def headline(
    records: Sequence[CellRecord], out: Path, contrasts: Sequence[tuple[str, str]]
) -> list[str]:
    """One line per measure and contrast: the last fifth's paired difference, and whether it
    excludes 0."""
    lines = []
    for a, b in contrasts:
        for measure in MEASURES:
            if measure.recall_only and not is_recall(records):
                continue
            text, excludes = last_part_contrast(values(records, out, measure), a, b)
            if text == "n/a":
                continue
            verdict = {
                True: "the interval excludes 0",
                False: "the interval includes 0",
                None: "no interval (fewer than 2 paired seeds, or no spread)",
            }[excludes]
            name = measure.title.split(",")[0]
            lines.append(f"* {name}, last fifth, {a} − {b}: **{text}** ({verdict}).")
    return lines
