"""The metrics schema (the exact keys of a ``metrics.jsonl`` row) and its writer.

A row's keys are each declared by what fills them: the actor update and the rollout in
:mod:`crl_train.run.columns` (next to the code that fills them), the experience service's counters
by the service (``row_columns``: its stats dataclass), a method's own by the method
(``declared_fields``). The trainer builds rows through :func:`make_row` (which rejects an
undeclared key), the plots read them, docs/training.md documents them (tests/test_outputs.py
checks both directions).

>>> metric_fields()[:3]
('step', 'actor_loss', 'actor_objective')
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crl_gym.json_types import JSONDict
from crl_train.methods import declared_metric_fields
from crl_train.run.columns import ACTOR_FIELDS, ROLLOUT_FIELDS, SERVICE_FIELDS, TIME_FIELDS

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)

STEP_FIELDS: tuple[str, ...] = (*ROLLOUT_FIELDS, *SERVICE_FIELDS, *TIME_FIELDS)
"""Every step's rollout, bank and background-track columns."""
METRIC_FIELDS: tuple[str, ...] = ("step", *ACTOR_FIELDS, *STEP_FIELDS)
"""Columns every metrics row has (``metric_fields`` adds the method's own)."""
ALL_METRIC_FIELDS: tuple[str, ...] = (*METRIC_FIELDS, *declared_metric_fields())
"""Every key a row may have: :data:`METRIC_FIELDS` and each method's own."""

_UNDECLARED = (
    "are not declared (a method's own keys go in its declared_fields, the service's in its stats)"
)


def metric_fields(extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The exact keys of a metrics row: every row's, then a method's own
    (``Method.metric_fields``)."""
    unknown = sorted(set(extra) - set(ALL_METRIC_FIELDS))
    if unknown:
        raise KeyError(f"metrics keys {unknown} {_UNDECLARED}")
    return (*METRIC_FIELDS, *extra)


def make_row(fields: tuple[str, ...], values: dict[str, Any]) -> JSONDict:
    """A row with exactly ``fields`` (missing ones None); an undeclared key is a programming error.

    >>> make_row(("step", "success"), {"step": 3})
    {'step': 3, 'success': None}
    """
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise KeyError(f"metrics keys {unknown} {_UNDECLARED}")
    return {k: values.get(k) for k in fields}


class MetricsWriter:
    """Appends rows to metrics.jsonl and TensorBoard (when tensorboard is installed).

    ``purge_step`` (resume): TensorBoard hides the events at and after it that the killed run wrote.
    """

    def __init__(self, run_dir: Path, purge_step: int | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.tb: SummaryWriter | None = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=purge_step)
        except Exception as exc:  # noqa: BLE001 - TensorBoard is optional
            log.warning("TensorBoard disabled: %s", exc)

    def write(self, row: dict[str, Any]) -> None:
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()
        }
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(clean) + "\n")
        if self.tb is not None:
            step = int(row.get("step", 0))
            for k, v in clean.items():
                if (
                    k != "step"
                    and isinstance(v, (int, float))
                    and not isinstance(v, bool)
                    and v is not None
                ):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s:%d: unreadable metrics row skipped", path, i)
    return rows
