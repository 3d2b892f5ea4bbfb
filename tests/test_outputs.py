"""crl_train.run.outputs: the declared metrics columns, the docs that list them, the plots that read them."""

from __future__ import annotations

import inspect
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
    assert metric_fields(outputs.EDGE_FIELDS)[-len(outputs.EDGE_FIELDS):] == outputs.EDGE_FIELDS
    assert set(metric_fields(outputs.EDGE_FIELDS + outputs.SELF_DISTILL_FIELDS + outputs.GATE_FIELDS)) == set(ALL_METRIC_FIELDS)
    with pytest.raises(KeyError, match="not declared"):
        metric_fields(("nope",))


def test_make_row_fills_missing_and_rejects_undeclared() -> None:
    assert make_row(("step", "success"), {"success": 0.5}) == {"step": None, "success": 0.5}
    with pytest.raises(KeyError, match="not declared"):
        make_row(("step",), {"step": 0, "mystery": 1})


def test_plot_reads_only_declared_fields(tmp_path: Path) -> None:
    src = Path(inspect.getsourcefile(outputs.plot_curves) or "").read_text(encoding="utf-8")
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
    # the previous checkpoint is kept, to resume from if the new one turns out damaged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "checkpoint.old"]
    assert json.loads((tmp_path / "checkpoint.old" / "state.json").read_text()) == {"step": 0}
    # the next checkpoint drops the one before the current before it is written: two at most
    nxt = outputs.begin_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "checkpoint.tmp"]
    commit_checkpoint(tmp_path, nxt, {"step": 2})
    assert json.loads((tmp_path / "checkpoint.old" / "state.json").read_text()) == {"step": 1}


def _ckpt(run: Path, name: str, step: int | None) -> None:
    """A checkpoint directory holding a weights stand-in and, when ``step`` is given, its state.json."""
    d = run / name
    d.mkdir()
    (d / "weights").write_text(name)
    if step is not None:
        (d / "state.json").write_text(json.dumps({"step": step}))


def _layout(run: Path) -> dict[str, int | None]:
    return {p.name: outputs._ckpt_step(p) for p in sorted(run.iterdir())}


@pytest.mark.parametrize(
    ("before", "best", "after"),
    [
        # normal: checkpoint/ and its previous; an interrupted write in tmp is dropped
        ({"checkpoint": 1, "checkpoint.old": 0, "checkpoint.tmp": None}, "checkpoint", {"checkpoint": 1, "checkpoint.old": 0}),
        # a kill between the two renames of a swap
        ({"checkpoint.old": 1, "checkpoint.tmp": 2}, "checkpoint.tmp", {"checkpoint": 2, "checkpoint.old": 1}),
        # a kill after tmp was complete, before checkpoint/ moved to .old: checkpoint/ becomes the previous
        ({"checkpoint": 1, "checkpoint.tmp": 2}, "checkpoint.tmp", {"checkpoint": 2, "checkpoint.old": 1}),
        # only an older leftover
        ({"checkpoint.old": 3, "checkpoint.tmp": None}, "checkpoint.old", {"checkpoint": 3}),
    ],
)
def test_find_reads_only_and_settle_keeps_the_previous_checkpoint(
        tmp_path: Path, before: dict[str, int | None], best: str, after: dict[str, int | None]) -> None:
    for name, step in before.items():
        _ckpt(tmp_path, name, step)
    found = outputs.find_checkpoint(tmp_path)
    assert found is not None and found.path == tmp_path / best
    assert _layout(tmp_path) == dict(sorted(before.items()))  # finding changes nothing
    outputs.settle_checkpoint(tmp_path, found)
    assert _layout(tmp_path) == after
    assert (tmp_path / "checkpoint" / "weights").read_text() == best  # the weights moved with their state


def test_a_damaged_checkpoint_dir_is_an_error_naming_the_previous_one(tmp_path: Path) -> None:
    _ckpt(tmp_path, "checkpoint", None)  # checkpoint/ is never written without state.json: damaged
    _ckpt(tmp_path, "checkpoint.old", 4)
    before = _layout(tmp_path)
    with pytest.raises(outputs.ResumeError, match=r"checkpoint/state.json is missing.*Nothing in .* was changed\. "
                                                  r"The previous checkpoint, .*checkpoint.old \(step 4\), is complete"):
        outputs.find_checkpoint(tmp_path)
    assert _layout(tmp_path) == before
    (tmp_path / "checkpoint" / "state.json").write_text("[1, 2]")
    with pytest.raises(outputs.ResumeError, match="holds a list, not a checkpoint state"):
        outputs.find_checkpoint(tmp_path)
    (tmp_path / "fresh").mkdir()
    assert outputs.find_checkpoint(tmp_path / "fresh") is None


def test_service_columns_come_from_the_service_stats_dataclass() -> None:
    import dataclasses

    from crl_train.service.service import STATS_COLUMNS, row_columns
    from crl_train.service.track import COLUMN, TrackStats

    marked = [f.name for f in dataclasses.fields(TrackStats) if COLUMN in f.metadata]
    cols = row_columns()
    assert set(cols.values()) == set(STATS_COLUMNS) | set(marked)
    assert cols["track_errors"] == "errors" and "errors" not in cols  # a mark may rename its column
    assert set(cols) <= set(METRIC_FIELDS) and "returned" not in METRIC_FIELDS  # unmarked counters stay out


def test_the_service_actor_resumes_from_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    from crl_train.service.checkpoint import begin_checkpoint
    from crl_train.service.ray_actor import newest_checkpoint

    assert newest_checkpoint(tmp_path) is None
    commit_checkpoint(tmp_path, begin_checkpoint(tmp_path), {"service": {"last_ended": 3}})
    commit_checkpoint(tmp_path, begin_checkpoint(tmp_path), {"service": {"last_ended": 5}})
    assert (tmp_path / "checkpoint.old" / "state.json").is_file()  # the writer keeps the previous one
    # a kill between the writer's two renames: no checkpoint/, the newest is checkpoint.tmp/
    (tmp_path / "checkpoint").rename(tmp_path / "checkpoint.tmp")
    found = newest_checkpoint(tmp_path)
    assert found is not None and found[0].name == "checkpoint.tmp" and found[1]["service"]["last_ended"] == 5
    (tmp_path / "checkpoint.tmp" / "state.json").write_text("{cut")
    found = newest_checkpoint(tmp_path)
    assert found is not None and found[0].name == "checkpoint.old"
