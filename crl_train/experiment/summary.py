"""``summary.json`` of a suite: its paired comparisons as numbers, for machines.

``{"comparisons": [{"a", "b", "metric", "memory", "diff", "ci95", "n_seeds"}, ...]}``, one per:

* contrast (a, b) of the suite and memory mode: held-out success of a in that mode minus b's, paired
  over the seeds both rows have (``metric: "heldout_success"``). A row without a bank (grpo) is
  evaluated with memory ``none`` whatever the mode: its success is what it learnt alone.
* contrast (a, b) of two rows with an extractor, on a Recall suite: right entries per request
  (new entries holding their task's secret / requests distilled) over the whole run and over the
  last fifth (``metric: "right_entries_per_request"`` / ``"right_entries_per_request_last_fifth"``,
  ``memory: null``).

Each ``diff`` is the mean paired difference with its 95 % t interval (``ci95``); ``n_seeds``
the pairs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from crl_train.experiment.fifths import PARTS, is_recall, new_entry_verdicts, part_of
from crl_train.experiment.suite import CellRecord, record_dir
from crl_train.run.stats import LEVEL, mean_t, paired_difference

MEMORY_ORDER = ("frozen", "none", "online")


def heldout_success(record: CellRecord, memory: str) -> float | None:
    """A cell's held-out success in ``memory`` (a cell evaluated without a bank: its ``none``),
    or None."""
    modes = record["eval"].get("memory") or {
        m: record["eval"][k]
        for m, k in (("frozen", "with_experience"), ("none", "without_experience"))
        if k in record["eval"]
    }
    got = modes.get(memory) or (modes.get("none") if "frozen" not in modes else None)
    return None if got is None or got.get("success") is None else float(got["success"])


def right_entries_per_request(
    cell_dir: Path, steps: int, *, last_part_only: bool = False
) -> float | None:
    """New entries that hold their task's secret per request the extractor distilled (``distilled``,
    a cumulative counter of ``metrics.jsonl``), over the run or its last fifth; None
    without requests."""
    from crl_train.run.metrics import read_metrics

    path = cell_dir / "metrics.jsonl"
    if not path.exists():
        return None
    rows = sorted(read_metrics(path), key=lambda r: int(r["step"]))
    first = (PARTS - 1) * steps // PARTS if last_part_only else 0
    before = [int(r.get("distilled") or 0) for r in rows if int(r["step"]) < first]
    total = max((int(r.get("distilled") or 0) for r in rows), default=0)
    requests = total - (before[-1] if before else 0)
    if requests <= 0:
        return None
    right = sum(
        held
        for row, held in new_entry_verdicts(cell_dir)
        if not last_part_only or part_of(int(row["step"]), steps) == PARTS - 1
    )
    return right / requests


def comparisons(
    records: Sequence[CellRecord], out: Path, contrasts: Sequence[tuple[str, str]]
) -> list[dict[str, Any]]:
    """The comparisons of the module docstring."""
    by_row: dict[str, dict[int, CellRecord]] = {}
    for r in records:
        by_row.setdefault(r["method"], {})[int(r["seed"])] = r
    modes = [
        m for m in MEMORY_ORDER if any(m in (r["eval"].get("memory") or {}) for r in records)
    ] or ["frozen", "none"]
    out_rows: list[dict[str, Any]] = []

    def add(
        a: str,
        b: str,
        metric: str,
        memory: str | None,
        values: dict[int, tuple[float | None, float | None]],
    ) -> None:
        pairs = [(x, y) for _, (x, y) in sorted(values.items()) if x is not None and y is not None]
        if not pairs:
            return
        iv = paired_difference([x for x, _ in pairs], [y for _, y in pairs])
        out_rows.append(
            {
                "a": a,
                "b": b,
                "metric": metric,
                "memory": memory,
                "diff": iv.value,
                "ci95": [iv.low, iv.high],
                "n_seeds": len(pairs),
            }
        )

    for a, b in contrasts:
        ra, rb = by_row.get(a, {}), by_row.get(b, {})
        seeds = sorted(set(ra) & set(rb))
        for memory in modes:
            add(
                a,
                b,
                "heldout_success",
                memory,
                {
                    s: (heldout_success(ra[s], memory), heldout_success(rb[s], memory))
                    for s in seeds
                },
            )
        if is_recall(records):
            for metric, last in (
                ("right_entries_per_request", False),
                ("right_entries_per_request_last_fifth", True),
            ):
                add(
                    a,
                    b,
                    metric,
                    None,
                    {
                        s: tuple(  # type: ignore[misc]
                            right_entries_per_request(
                                record_dir(out, rec), int(rec["steps"]), last_part_only=last
                            )
                            for rec in (ra[s], rb[s])
                        )
                        for s in seeds
                    },
                )
    return out_rows


def right_entries_table(
    records: Sequence[CellRecord], methods: Sequence[str], out: Path
) -> list[str]:
    """Markdown: per method with an extractor (Recall suites), right entries per request over the
    run and over its last fifth, mean over seeds with a t interval."""
    if not is_recall(records):
        return []
    lines = []
    for m in methods:
        cells = [(record_dir(out, r), int(r["steps"])) for r in records if r["method"] == m]
        whole = [v for d, n in cells if (v := right_entries_per_request(d, n)) is not None]
        last = [
            v
            for d, n in cells
            if (v := right_entries_per_request(d, n, last_part_only=True)) is not None
        ]
        if whole:
            lines.append(f"| {m} | {len(whole)} | {mean_t(whole).text()} | {mean_t(last).text()} |")
    if not lines:
        return []
    return [
        "## Right entries per request",
        "",
        "New entries that hold their task's secret (`new_entries.jsonl`, "
        "`crl_gym.envs.recall.holds_secret`) per distillation request (`distilled`), over the "
        f"whole run and over its last fifth; mean over seeds ({int(LEVEL * 100)} % t interval). "
        "This is what the actor can gain from the extractor: the share of entries that are right "
        "can rise while fewer are written.",
        "",
        "| method | seeds | whole run | last fifth |",
        "| --- | --- | --- | --- |",
        *lines,
        "",
    ]


def comparisons_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown: the paired comparisons of ``summary.json``, one row each."""
    if not rows:
        return []
    body = [
        f"| {r['a']} − {r['b']} | {r['metric']} | {r['memory'] or '—'} | {r['diff']:+.3f} "
        f"[{_num(r['ci95'][0])}, {_num(r['ci95'][1])}] | {r['n_seeds']} |"
        for r in rows
    ]
    return [
        "## Paired comparisons (summary.json)",
        "",
        "Mean difference over the seeds both rows have (seed s against seed s), "
        f"{int(LEVEL * 100)} % paired t interval; memory: the bank each row's held-out episodes "
        "read (a row without a bank is evaluated with none).",
        "",
        "| contrast | metric | memory | difference | seeds |",
        "| --- | --- | --- | --- | --- |",
        *body,
        "",
    ]


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.3f}"


def write_summary(
    out: Path,
    records: Sequence[CellRecord],
    contrasts: Sequence[tuple[str, str]],
    rows: Sequence[dict[str, Any]] | None = None,
) -> Path:
    """``OUT/summary.json`` (written atomically); ``rows``: :func:`comparisons` already made."""
    path = out / "summary.json"
    tmp = path.with_name(path.name + ".tmp")
    made = comparisons(records, out, contrasts) if rows is None else rows
    tmp.write_text(json.dumps({"comparisons": list(made)}, indent=1), encoding="utf-8")
    tmp.replace(path)
    return path
