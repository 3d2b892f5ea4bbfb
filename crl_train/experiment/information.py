"""Does experience carry information? Two tables of a suite's report.

* **Guided − free gap over training**: per method, the mean over seeds of success_guided −
  success_free over each fifth of the training steps (the same rollout step, the same tasks: the
  gap is what the entries added), with a 95 % t interval over seeds.
* **Entries that hold their task's secret** (``crl/Recall-v0`` suites only): per method, the share
  of the final bank's entries whose action words are exactly the secret of the task they were
  written for (:func:`crl_gym.envs.recall.holds_secret`), mean over seeds with a t interval. The
  oracle's share is 1 by construction; a learnt extractor's says whether it writes the answer.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from crl_train.experiment.suite import CellRecord, record_dir
from crl_train.run.stats import LEVEL, mean_t

RECALL = "crl/Recall-v0"
PARTS = 5
"""The gap table splits training into this many equal spans of steps."""


def gap_by_part(rows: Sequence[dict[str, Any]], parts: int = PARTS) -> list[float | None]:
    """Mean of success_guided − success_free over each of ``parts`` equal spans of a run's rows
    (None for a span without a row that has both).

    >>> pairs = [(0.5, 0.5), (1.0, 0.5), (1.0, 0.0), (0.5, 0.0)]
    >>> rows = [{"success_guided": g, "success_free": f} for g, f in pairs]
    >>> gap_by_part(rows, parts=2)
    [0.25, 0.75]
    """
    out: list[float | None] = []
    n = len(rows)
    for p in range(parts):
        span = rows[p * n // parts : (p + 1) * n // parts]
        gaps = [
            float(r["success_guided"]) - float(r["success_free"])
            for r in span
            if r.get("success_guided") is not None and r.get("success_free") is not None
        ]
        out.append(sum(gaps) / len(gaps) if gaps else None)
    return out


def gap_table(records: Sequence[CellRecord], methods: Sequence[str], out: Path) -> list[str]:
    """Markdown: one row per guided method, one column per fifth of training."""
    from crl_train.run.metrics import read_metrics

    head = [
        "| method | "
        + " | ".join(f"steps {p * 100 // PARTS}–{(p + 1) * 100 // PARTS} %" for p in range(PARTS))
        + " |",
        "| --- |" + " --- |" * PARTS,
    ]
    lines = []
    for m in methods:
        per_seed = []
        for r in records:
            path = record_dir(out, r) / "metrics.jsonl"
            if r["method"] == m and path.exists():
                per_seed.append(gap_by_part(read_metrics(path)))
        if not per_seed or all(g is None for gaps in per_seed for g in gaps):
            continue
        cells = [
            mean_t([v for g in per_seed if (v := g[p]) is not None]).text() for p in range(PARTS)
        ]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    if not lines:
        return []
    return [
        "## Guided − free success gap over training",
        "",
        "Per method, success_guided − success_free of the same rollout steps, averaged over each "
        f"fifth of training, then over seeds ({int(LEVEL * 100)} % t interval). Above 0: the "
        "entries raised success.",
        "",
        *head,
        *lines,
        "",
    ]


def secret_share(cell_dir: Path) -> tuple[int, int] | None:
    """(entries that hold their task's secret, entries) of a Recall cell's final bank; None when the
    cell has no bank export."""
    from crl_gym.envs.recall import RecallEnv, holds_secret

    export = cell_dir / "bank" / "bank.jsonl"
    if not export.exists():
        return None
    kwargs = (yaml.safe_load((cell_dir / "config.yaml").read_text(encoding="utf-8")) or {}).get(
        "env", {}
    ).get("kwargs") or {}
    defaults = RecallEnv()
    length = int(kwargs.get("length", defaults.length))
    num_actions = int(kwargs.get("num_actions", defaults.num_actions))
    secret_seed = int(kwargs.get("secret_seed", defaults.secret_seed))
    held = total = 0
    for line in export.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        entry = json.loads(line)
        text = str(entry.get("text", ""))
        context = str((entry.get("provenance") or {}).get("prompt") or "") + "\n" + text
        verdict = holds_secret(
            text, context, length=length, num_actions=num_actions, secret_seed=secret_seed
        )
        total += 1
        held += bool(verdict)
    return held, total


def secret_table(records: Sequence[CellRecord], methods: Sequence[str], out: Path) -> list[str]:
    """Markdown: per method, the share of final-bank entries holding their task's secret
    (Recall only)."""
    if not records or any(tuple(r["envs"]) != (RECALL,) for r in records):
        return []
    shares: dict[str, list[float]] = defaultdict(list)
    sizes: dict[str, list[int]] = defaultdict(list)
    for r in records:
        got = secret_share(record_dir(out, r))
        if got is not None and got[1] > 0:
            shares[r["method"]].append(got[0] / got[1])
            sizes[r["method"]].append(got[1])
    lines = [
        f"| {m} | {len(shares[m])} | {sum(sizes[m]) / len(sizes[m]):.1f} | "
        f"{mean_t(shares[m]).text()} |"
        for m in methods
        if shares.get(m)
    ]
    if not lines:
        return []
    return [
        "## Entries that hold their task's secret",
        "",
        "Share of the final bank's entries whose action words are exactly the secret of the task "
        "they were written for (`crl_gym.envs.recall.holds_secret`), mean over seeds "
        f"({int(LEVEL * 100)} % t interval).",
        "",
        "| method | seeds | entries (mean) | share holding the secret |",
        "| --- | --- | --- | --- |",
        *lines,
        "",
    ]
