"""crl_train.run.outputs: the declared metrics columns, the docs that list them, the plots that read them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from crl_train.run import outputs
from crl_train.run.outputs import (
    ALL_METRIC_FIELDS,
    METRIC_FIELDS,
    commit_checkpoint,
    make_row,
    metric_fields,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "training.md"


def _documented_fields() -> set[str]:
    text = DOCS.read_text(encoding="utf-8")
    table = text[text.index("### `metrics.jsonl`"):text.index("## Checkpoints")]
    names: set[str] = set()
    for line in table.splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`([a-z_]+)`", line.split("|")[1]))
    return names


def test_docs_table_lists_exactly_the_declared_fields() -> None:
    assert _documented_fields() == set(ALL_METRIC_FIELDS)


def test_fields_are_unique_and_method_extras_are_appended() -> None:
    assert len(set(ALL_METRIC_FIELDS)) == len(ALL_METRIC_FIELDS)
    assert metric_fields() == METRIC_FIELDS
    assert metric_fields(outputs.EDGE_FIELDS)[-4:] == outputs.EDGE_FIELDS
    assert set(metric_fields(outputs.EDGE_FIELDS + outputs.SELF_DISTILL_FIELDS)) == set(ALL_METRIC_FIELDS)
    with pytest.raises(KeyError, match="not declared"):
        metric_fields(("nope",))


def test_make_row_fills_missing_and_rejects_undeclared() -> None:
    assert make_row(("step", "success"), {"success": 0.5}) == {"step": None, "success": 0.5}
    with pytest.raises(KeyError, match="not declared"):
        make_row(("step",), {"step": 0, "mystery": 1})


def test_plot_reads_only_declared_fields(tmp_path: Path) -> None:
    src = Path(outputs.__file__).read_text(encoding="utf-8")
    plot = src[src.index("def plot_curves"):]
    used = set(re.findall(r'series\("([a-z_]+)"\)', plot)) | set(re.findall(r'"(success[a-z_]*)"', plot))
    assert used and used <= set(METRIC_FIELDS)
    rows = [make_row(METRIC_FIELDS, {"step": t, "success": t / 2, "bank_size": t}) for t in range(3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = outputs.plot_curves(tmp_path)
    assert out is not None and out.stat().st_size > 1000


def test_commit_checkpoint_writes_state_last_and_swaps(tmp_path: Path) -> None:
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "state.json").write_text('{"step": 0}')
    tmp = tmp_path / "checkpoint.tmp"
    tmp.mkdir()
    commit_checkpoint(tmp_path, tmp, {"step": 1})
    assert json.loads((tmp_path / "checkpoint" / "state.json").read_text()) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
