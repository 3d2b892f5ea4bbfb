"""``report.md`` of a suite: tables with 95 % intervals over seeds, learning curves, the final
bank, provenance.

Final success (with and without experience) is the mean over seeds of each cell's held-out
evaluation, with a t interval; each method's paired difference to ``grpo`` is over the same seeds
(the free, experience-less success: the only one grpo has); the internalisation ratio is
success without / with experience, bootstrapped over seeds. Curves are the mean over seeds of each
step's metrics row with a shaded t interval.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypedDict, TypeVar

import yaml

from crl_gym.json_types import JSONDict
from crl_train.config.names import MethodName
from crl_train.experiment.fifths import (
    PARTS,
    fifths_tables,
    guided_requests,
    headline,
    is_recall,
    new_entry_verdicts,
    part_of,
)
from crl_train.experiment.information import gap_table, secret_table
from crl_train.experiment.provenance import provenance
from crl_train.experiment.suite import CellRecord, Suite, record_dir
from crl_train.experiment.summary import (
    comparisons,
    comparisons_table,
    right_entries_table,
    write_summary,
)
from crl_train.run.stats import LEVEL, Interval, mean_t, paired_difference, ratio_of_means

CURVES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("success", ("success",), "success rate (all episodes)"),
    (
        "success_guided_free",
        ("success_guided", "success_free"),
        "success rate: guided (solid) vs free (dashed)",
    ),
    ("actions", ("actions_per_episode",), "actions per episode"),
    ("bank_size", ("bank_size",), "bank size"),
)
"""Learning-curve plots: file stem, metrics keys, title."""


class SeedEval(TypedDict):
    """What the results table reads of a record: its seed and its ``eval.json`` (a
    :class:`CellRecord`, or the mean of a seed's records over env mixtures)."""

    seed: int
    eval: dict[str, Any]


K = TypeVar("K", str, int)


def _final(records: Sequence[SeedEval], mode: str, key: str = "success") -> list[float]:
    return [
        float(r["eval"][mode][key])
        for r in records
        if mode in r["eval"] and r["eval"][mode][key] is not None
    ]


def _by(records: Sequence[CellRecord], key: Callable[[CellRecord], K]) -> dict[K, list[CellRecord]]:
    out: dict[K, list[CellRecord]] = defaultdict(list)
    for r in records:
        out[key(r)].append(r)
    return out


def results_table(records: Sequence[CellRecord], methods: Sequence[str]) -> list[str]:
    """Markdown rows: per env mixture and method, and averaged over mixtures."""
    head = [
        "| env | method | seeds | success with exp | success without exp | Δ without vs grpo "
        "(paired) | internalisation (without / with) | actions / episode (without) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = []
    by_env = _by(records, lambda r: "+".join(r["envs"]))
    envs = sorted(by_env)
    for env in envs:
        per_method = _by(by_env[env], lambda r: r["method"])
        grpo: dict[int, SeedEval] = {r["seed"]: r for r in per_method.get("grpo", [])}
        for m in methods:
            recs = sorted(per_method.get(m, []), key=lambda r: r["seed"])
            rows.append(_row(env, m, recs, grpo))
    if len(envs) > 1:
        for m in methods:
            per_seed = _by([r for r in records if r["method"] == m], lambda r: r["seed"])
            avg: list[SeedEval] = [
                {"seed": s, "eval": _mean_eval(rs)} for s, rs in sorted(per_seed.items())
            ]
            grpo_runs = [r for r in records if r["method"] == MethodName.GRPO]
            grpo_seed = _by(grpo_runs, lambda r: r["seed"])
            grpo_avg: dict[int, SeedEval] = {
                s: {"seed": s, "eval": _mean_eval(rs)} for s, rs in grpo_seed.items()
            }
            rows.append(_row("**mean over envs**", m, avg, grpo_avg))
    return head + rows


def _mean_eval(recs: Sequence[SeedEval]) -> JSONDict:
    out: JSONDict = {}
    for mode in ("with_experience", "without_experience"):
        vals = _final(recs, mode)
        acts = _final(recs, mode, "actions_per_episode")
        if vals:
            out[mode] = {
                "success": sum(vals) / len(vals),
                "actions_per_episode": sum(acts) / len(acts) if acts else None,
            }
    return out


def _row(env: str, method: str, recs: Sequence[SeedEval], grpo: dict[int, SeedEval]) -> str:
    with_exp = mean_t(_final(recs, "with_experience"))
    without = mean_t(_final(recs, "without_experience"))
    paired = [
        (r, grpo[r["seed"]])
        for r in recs
        if r["seed"] in grpo and "without_experience" in r["eval"]
    ]
    if method == MethodName.GRPO or not paired:
        delta = "—" if method == MethodName.GRPO else "n/a"
    else:
        delta = paired_difference(
            [a["eval"]["without_experience"]["success"] for a, _ in paired],
            [b["eval"]["without_experience"]["success"] for _, b in paired],
        ).text()
    inter = ratio_of_means(_final(recs, "without_experience"), _final(recs, "with_experience"))
    acts = mean_t(_final(recs, "without_experience", "actions_per_episode"))
    return (
        f"| {env} | {method} | {len(recs)} | {with_exp.text()} | {without.text()} | {delta} | "
        f"{inter.text() if with_exp.value is not None else 'n/a'} | {acts.text(2)} |"
    )


def _curves(records: Sequence[CellRecord], out: Path) -> list[str]:
    """One PNG per curve, one line per method (per mixture): each run's mean over windows of steps
    (``curve_window``), then the mean over seeds of those, shaded t interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from crl_train.run.metrics import read_metrics

    series: dict[tuple[str, str], list[list[dict[str, Any]]]] = defaultdict(list)
    for r in records:
        path = record_dir(out, r) / "metrics.jsonl"
        if path.exists():
            series[("+".join(e.split("/")[-1] for e in r["envs"]), r["method"])].append(
                read_metrics(path)
            )
    names = []
    window = curve_window(max((len(rows) for runs in series.values() for rows in runs), default=0))
    for stem, keys, title in CURVES:
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, ((env, method), runs) in enumerate(sorted(series.items())):
            colour = f"C{i % 10}"
            for key, style in zip(keys, ("-", "--"), strict=False):
                steps, mean, low, high = band(runs, key, window)
                if not steps:
                    continue
                label = f"{method} ({env})" + (f" {key}" if len(keys) > 1 else "")
                ax.plot(steps, mean, style, color=colour, label=label)
                if key.startswith(
                    "success"
                ):  # a rate: the t interval is cut to where a rate can be
                    low, high = [max(0.0, x) for x in low], [min(1.0, x) for x in high]
                ax.fill_between(steps, low, high, color=colour, alpha=0.15)
        per = f"each point: {window} steps, " if window > 1 else ""
        ax.set_title(
            f"{title}\n{per}mean over seeds, shaded: {int(LEVEL * 100)} % t interval", fontsize=10
        )
        ax.set_xlabel("actor step")
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = f"{stem}.png"
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        names.append(name)
    return names


def curve_window(steps: int, points: int = 25) -> int:
    """Steps averaged into one point of a curve: about ``points`` points a curve, at least 1 step.

    A step's success over a handful of episodes is mostly noise; a window of steps shows the trend.

    >>> curve_window(250), curve_window(24), curve_window(0)
    (10, 1, 1)
    """
    return max(1, steps // points)


def band(
    runs: Sequence[list[dict[str, Any]]], key: str, window: int = 1
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Each run's mean of ``key`` over windows of ``window`` steps, then their mean over runs with
    its t interval per window (the interval is the value itself for one run); x = the window's
    mean step.

    >>> x, mean, low, high = band([[{"step": 0, "s": 0.0}, {"step": 1, "s": 1.0}],
    ...                             [{"step": 0, "s": 1.0}, {"step": 1, "s": 1.0}]], "s", window=2)
    >>> x, mean, [round(v, 4) for v in low + high]  # runs' means 0.5 and 1.0: ± t(0.975, 1)·0.25
    ([0.5], [0.75], [-2.4266, 3.9266])
    """
    per_window: dict[int, list[float]] = defaultdict(list)
    for rows in runs:
        cells: dict[int, list[float]] = defaultdict(list)
        for row in rows:
            if row.get(key) is not None:
                cells[int(row["step"]) // window].append(float(row[key]))
        for w, values in cells.items():
            per_window[w].append(sum(values) / len(values))
    steps, mean, low, high = [], [], [], []
    for w in sorted(per_window):
        iv: Interval = mean_t(per_window[w])
        assert iv.value is not None
        steps.append(w * window + (window - 1) / 2)
        mean.append(iv.value)
        low.append(iv.low if iv.low is not None else iv.value)
        high.append(iv.high if iv.high is not None else iv.value)
    return steps, mean, low, high


def bank_snapshot(cell_dir: Path, top: int = 10) -> list[str]:
    """The final bank's most retrieved entries with r̄(m) over every guided episode they guided."""
    export = cell_dir / "bank" / "bank.jsonl"
    if not export.exists():
        return ["(no bank export)"]
    entries = [json.loads(x) for x in export.read_text(encoding="utf-8").splitlines() if x.strip()]
    outcomes: dict[int, list[float]] = defaultdict(list)
    for req in guided_requests(cell_dir):
        outcomes[int(req["experience"]["id"])].append(1.0 if req.get("success") else -1.0)
    entries.sort(key=lambda e: (-int(e.get("retrieval_count", 0)), int(e.get("id", 0))))
    rows = [
        f"Final bank: {len(entries)} entries. Most retrieved:",
        "",
        "| entry | r̄(m) (episodes) | retrieved | trained | text |",
        "| --- | --- | --- | --- | --- |",
    ]
    for e in entries[:top]:
        rs = outcomes.get(int(e["id"]), [])
        rbar = f"{sum(rs) / len(rs):+.2f} ({len(rs)})" if rs else "n/a (0)"
        text = str(e.get("text", "")).replace("|", "\\|").replace("\n", " ")[:160]
        rows.append(
            f"| {e['id']} | {rbar} | {e.get('retrieval_count', 0)} | {e.get('train_count', 0)} | "
            f"{text} |"
        )
    return rows


def new_entries_sample(cell_dir: Path, steps: int, *, recall: bool, per_part: int = 3) -> list[str]:
    """A few of the entries written in each fifth of training (evenly spaced through the fifth), as
    first written; with ``recall``, whether each holds its task's secret."""
    from crl_train.run.new_entries import read_new_entries

    rows: list[tuple[dict[str, Any], bool | None]] = (
        [(r, held) for r, held in new_entry_verdicts(cell_dir)]
        if recall
        else [(r, None) for r in read_new_entries(cell_dir)]
    )
    if not rows:
        return []
    by_part: dict[int, list[tuple[dict[str, Any], bool | None]]] = defaultdict(list)
    for r, held in rows:
        by_part[part_of(int(r["step"]), steps)].append((r, held))
    out = [
        f"New entries as first written ({len(rows)} in all; {per_part} per fifth, evenly spaced):",
        "",
        "| fifth | step | entry |" + (" holds the secret |" if recall else "") + " text |",
        "| --- | --- | --- |" + (" --- |" if recall else "") + " --- |",
    ]
    for p in range(PARTS):
        got = by_part.get(p, [])
        picks = (
            got
            if len(got) <= per_part
            else [got[i * len(got) // per_part] for i in range(per_part)]
        )
        for r, held in picks:
            text = str(r.get("text", "")).replace("|", "\\|").replace("\n", " ")[:160]
            mark = "" if held is None else f" {'yes' if held else 'no'} |"
            out.append(f"| {p + 1} | {r['step']} | {r.get('id')} |{mark} {text} |")
    return out


def cells_table(records: Sequence[CellRecord], out: Path) -> list[str]:
    """Per cell: steps, whether it was resumed, the extractor's CISPO updates (and the samples they
    trained on: updates × ``algo.buffer_size``) and the background track's failed passes at its
    last metrics row (read by column name), entries written, final bank, training time."""
    from crl_train.run.metrics import read_metrics
    from crl_train.run.new_entries import read_new_entries

    lines = [
        "## Cells",
        "",
        "Resumed: the checkpoint step(s) a cell's later starts continued from (no: one start). "
        "Extractor updates: CISPO steps of the extractor over the run (0 for a frozen or "
        "weightless extractor), and the samples they trained on (updates × B_φ, the cell's "
        "`algo.buffer_size`); track errors: passes of the extractor's background track that "
        "raised; both from the cell's last metrics row. Entries written: lines of the cell's "
        '`new_entries.jsonl`. "not recorded": the run\'s data has no such field.',
        "",
        "| cell | steps | resumed | extractor updates (samples) | track errors | entries written "
        "| final bank | training time (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        d = record_dir(out, r)
        rows = read_metrics(d / "metrics.jsonl") if (d / "metrics.jsonl").exists() else []
        last = rows[-1] if rows else {}
        seconds = sum(float(x.get("step_time_s") or 0.0) for x in rows)
        lines.append(
            f"| {r['method']} seed {r['seed']} | {r.get('steps', 'n/a')} | {_resumed(r)} | "
            f"{_updates(last, d)} | {_column(last, 'track_errors')} | "
            f"{len(read_new_entries(d))} | {last.get('bank_size', 'n/a')} | {seconds:.0f} |"
        )
    return [*lines, ""]


def _resumed(record: CellRecord) -> str:
    if "resumed_from" not in record:
        return "not recorded"
    steps = record["resumed_from"]
    return "no" if not steps else "after step " + ", ".join(map(str, steps))


def _column(row: dict[str, Any], name: str) -> str:
    """A metrics row's column by name; a row without it (an older run) did not record it, a
    ``None`` in it (a run without an extractor track) is n/a."""
    if not row or row.get(name, "") is None:
        return "n/a"
    return str(row[name]) if name in row else "not recorded"


def _updates(row: dict[str, Any], cell_dir: Path) -> str:
    """``updates (updates × B_φ)``, B_φ read from the cell's ``config.yaml``."""
    updates = _column(row, "extractor_updates")
    cfg = cell_dir / "config.yaml"
    if not updates.isdigit() or not cfg.exists():
        return updates
    algo = (yaml.safe_load(cfg.read_text(encoding="utf-8")) or {}).get("algo") or {}
    size = algo.get("buffer_size")
    return f"{updates} ({int(updates) * int(size)})" if isinstance(size, int) else updates


def _bank_sizes(cell_dir: Path) -> str:
    from crl_train.run.metrics import read_metrics

    path = cell_dir / "metrics.jsonl"
    if not path.exists():
        return "n/a"
    rows = read_metrics(path)
    every = max(1, len(rows) // 8)
    shown = rows[::every] if rows[::every][-1] is rows[-1] else rows[::every] + rows[-1:]
    return ", ".join(f"step {r['step']}: {r.get('bank_size')}" for r in shown) if rows else "n/a"


def write_report(suite: Suite, out: Path, records: Sequence[CellRecord]) -> Path:
    """``OUT/report.md``, its PNGs and ``OUT/summary.json`` (:mod:`crl_train.experiment.summary`)
    from the cells' records."""
    plots = _curves(records, out)
    compared = comparisons(records, out, suite.pairs)
    variants = "".join(
        f" + reference line {n} ({v.method} with {', '.join(v.set) or 'no overrides'})"
        for n, v in suite.variants.items()
    )
    lines = [
        f"# {suite.name}",
        "",
        *([suite.description, ""] if suite.description else []),
        f"{len(records)} cells: methods {', '.join(suite.methods)}{variants} × "
        f"seeds {', '.join(map(str, suite.seeds))} × "
        f"{len(suite.envs)} env mixture(s); {suite.eval_episodes} held-out episodes per mode "
        "and cell.",
        "",
        *_reading(suite),
        *_headline(records, out, suite.pairs),
        *comparisons_table(compared),
        "## Final success",
        "",
        f"Mean over seeds with a {int(LEVEL * 100)} % t interval; Δ = the method's success without "
        "experience minus grpo's on the same seeds (paired t); internalisation = success without "
        "/ with experience (bootstrap over seeds; 1 means the actor keeps all its gain without "
        "the bank).",
        "",
        *results_table(records, suite.rows),
        "",
        *gap_table(records, suite.rows, out),
        *secret_table(records, suite.rows, out),
        *right_entries_table(records, suite.rows, out),
        *fifths_tables(records, suite.rows, out, suite.pairs),
        *cells_table(records, out),
        "## Learning curves",
        "",
    ]
    lines += [f"![{p}]({p})" for p in plots]
    lines += ["", "## The final bank (seed of the first cell of each experience method)", ""]
    for m in suite.rows:
        first = next((r for r in records if r["method"] == m), None)
        if first is None or "with_experience" not in first["eval"]:
            continue
        cell = record_dir(out, first)
        lines += [
            f"### {m} (seed {first['seed']})",
            "",
            f"Bank size: {_bank_sizes(cell)}.",
            "",
            *bank_snapshot(cell),
            "",
            *new_entries_sample(cell, int(first["steps"]), recall=is_recall(records)),
            "",
        ]
    lines += [
        "## Provenance",
        "",
        *provenance(records),
        "",
        "The suite:",
        "",
        "```yaml",
        yaml.safe_dump(_plain(suite), sort_keys=False).strip(),
        "```",
        "",
    ]
    for m in suite.rows:
        first = next((r for r in records if r["method"] == m), None)
        if first is not None:
            cfg = record_dir(out, first) / "config.yaml"
            if cfg.exists():
                lines += [
                    f"<details><summary>config of {m} (seed {first['seed']})</summary>",
                    "",
                    "```yaml",
                    cfg.read_text(encoding="utf-8").strip(),
                    "```",
                    "",
                    "</details>",
                    "",
                ]
    write_summary(out, records, suite.pairs, compared)
    path = out / "report.md"
    tmp = out / f"report.md.{os.getpid()}.tmp"  # two processes sharing --out may both write it
    tmp.write_text("\n".join(lines), encoding="utf-8")
    tmp.replace(path)
    return path


def _reading(suite: Suite) -> list[str]:
    """The suite's ``reading`` file (what the run shows, written after it), if it has one."""
    if suite.reading is None or not Path(suite.reading).is_file():
        return []
    return [Path(suite.reading).read_text(encoding="utf-8").strip(), ""]


def _headline(
    records: Sequence[CellRecord], out: Path, pairs: Sequence[tuple[str, str]]
) -> list[str]:
    lines = headline(records, out, pairs)
    if not lines:
        return []
    what = "share of new entries holding their task's secret, " if is_recall(records) else ""
    return [
        "## Headline: the last fifth of training",
        "",
        f"The paired differences of the tables per fifth of training "
        f"({what}r̄(m) of the entries retrieved, guided success) in their last fifth, "
        f"{int(LEVEL * 100)} % paired t interval over seeds:",
        "",
        *lines,
        "",
    ]


def _plain(suite: Suite) -> JSONDict:
    from crl_train.config.io import config_to_dict

    data: dict[str, Any] = config_to_dict(suite)
    return data
