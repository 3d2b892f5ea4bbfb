"""Run-directory outputs, one module per concept; their names are re-exported here.

* :mod:`crl_train.run.columns` — the actor-update, rollout, service and time columns, declared where
  they are filled
* :mod:`crl_train.run.metrics` — the metrics schema (``metric_fields``, ``make_row``),
  ``MetricsWriter``, ``read_metrics``
* :mod:`crl_train.run.trim` — a resume's trim of the JSONL files (``truncate_jsonl``,
  ``trim_run_outputs``)
* :mod:`crl_train.run.checkpoints` — the checkpoint a resume loads (``find_checkpoint``,
  ``settle_checkpoint``)
* :mod:`crl_train.run.plots` — ``curves.png``
* :mod:`crl_train.run.config_file` — ``config.yaml`` and the changes of a resume

Layout of a run directory::

    config.yaml          the resolved config (rewritten by a resume that changes it; the previous
                         one is kept as config.before_step<N>.yaml)
    metrics.jsonl        one JSON object per logged actor step (see ``metric_fields``)
    tb/                  TensorBoard events
    curves.png           main curves
    checkpoint/          actor/, extractor/, state.json (state.json written last: it marks a
                         complete checkpoint)
    checkpoint.old/      the previous checkpoint, kept until the next one is being written
    bank/                the experience bank (SQLite + index) and bank.jsonl export
    trajectories.jsonl   every finished episode's distillation request (offline_exp source)
    eval.json            held-out evaluation (crl-eval / end of training)

>>> metric_fields()[:3]
('step', 'actor_loss', 'actor_objective')
>>> len(metric_fields(SELF_DISTILL_FIELDS)) - len(metric_fields())
2
"""

from __future__ import annotations

from crl_train.methods import EDGE_FIELDS, GATE_FIELDS, SELF_DISTILL_FIELDS
from crl_train.run.checkpoints import (
    Checkpoint,
    ResumeError,
    _ckpt_step,
    find_checkpoint,
    read_checkpoint_state,
    resolve_checkpoint,
    settle_checkpoint,
)
from crl_train.run.columns import ACTOR_FIELDS, ROLLOUT_FIELDS, SERVICE_FIELDS, TIME_FIELDS
from crl_train.run.config_file import save_run_config
from crl_train.run.metrics import (
    ALL_METRIC_FIELDS,
    METRIC_FIELDS,
    STEP_FIELDS,
    MetricsWriter,
    make_row,
    metric_fields,
    read_metrics,
)
from crl_train.run.plots import plot_curves
from crl_train.run.trim import trim_run_outputs, truncate_jsonl
from crl_train.service.checkpoint import (
    CKPT,
    OLD,
    STATE,
    TMP,
    atomic_write_text,
    begin_checkpoint,
    commit_checkpoint,
)

__all__ = [
    "ACTOR_FIELDS",
    "ALL_METRIC_FIELDS",
    "CKPT",
    "EDGE_FIELDS",
    "GATE_FIELDS",
    "METRIC_FIELDS",
    "OLD",
    "ROLLOUT_FIELDS",
    "SELF_DISTILL_FIELDS",
    "SERVICE_FIELDS",
    "STATE",
    "STEP_FIELDS",
    "TIME_FIELDS",
    "TMP",
    "Checkpoint",
    "MetricsWriter",
    "ResumeError",
    "_ckpt_step",
    "atomic_write_text",
    "begin_checkpoint",
    "commit_checkpoint",
    "find_checkpoint",
    "make_row",
    "metric_fields",
    "plot_curves",
    "read_checkpoint_state",
    "read_metrics",
    "resolve_checkpoint",
    "save_run_config",
    "settle_checkpoint",
    "trim_run_outputs",
    "truncate_jsonl",
]
