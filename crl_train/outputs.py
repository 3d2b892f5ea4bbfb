"""Run-directory outputs: metrics.jsonl, TensorBoard events, PNG curves.

Layout of a run directory::

    config.yaml          the resolved config
    metrics.jsonl        one JSON object per actor step (see ``METRIC_FIELDS``)
    tb/                  TensorBoard events
    curves.png           main curves
    checkpoint/          actor/, extractor/, state.json (written atomically)
    bank/                the experience bank (SQLite + index) and bank.jsonl export
    trajectories.jsonl   every finished episode's distillation request (offline_exp source)
    eval.json            held-out evaluation (crl-eval / end of training)
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRIC_FIELDS: tuple[str, ...] = (
    "step", "success", "success_guided", "success_free", "actions_per_episode", "turns_per_episode",
    "adv_mean", "adv_std", "adv_abs_mean", "actor_loss", "actor_clip_frac", "actor_approx_kl",
    "actor_grad_norm", "bank_size", "search_latency_s", "queue_depth", "extractor_reward",
    "extractor_updates", "extractor_loss", "buffer_size", "distilled", "malformed", "env_errors",
    "context_truncations", "step_time_s", "rollout_time_s", "update_time_s",
)
"""Columns every metrics row has (more may follow: EDGE, self-distillation, merges)."""


class MetricsWriter:
    """Appends rows to metrics.jsonl and TensorBoard (when tensorboard is installed)."""

    def __init__(self, run_dir: Path, keep_until_step: int | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        if keep_until_step is not None and self.path.exists():
            # resume: drop rows written after the checkpoint we resume from
            rows = [r for r in read_metrics(self.path) if int(r.get("step", 0)) <= keep_until_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        self.tb: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"))
        except Exception as exc:  # noqa: BLE001 - TensorBoard is optional
            log.warning("TensorBoard disabled: %s", exc)

    def write(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(clean) + "\n")
        if self.tb is not None:
            step = int(row.get("step", 0))
            for k, v in clean.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None:
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


def plot_curves(run_dir: Path) -> Path | None:
    """curves.png: success (guided / free / all), actions per episode, bank size, extractor reward."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    rows = read_metrics(path)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]

    def series(key: str) -> list[float]:
        return [float(r[key]) if r.get(key) is not None else float("nan") for r in rows]

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    ax = axes[0][0]
    for key in ("success", "success_guided", "success_free"):
        ax.plot(steps, series(key), label=key)
    ax.set_title("success rate")
    ax.legend()
    axes[0][1].plot(steps, series("actions_per_episode"))
    axes[0][1].set_title("actions per episode")
    axes[1][0].plot(steps, series("bank_size"))
    axes[1][0].set_title("bank size")
    axes[1][1].plot(steps, series("extractor_reward"), label="extractor reward")
    axes[1][1].plot(steps, series("actor_loss"), label="actor loss")
    axes[1][1].legend()
    axes[1][1].set_title("extractor reward / actor loss")
    for a in axes.flat:
        a.set_xlabel("actor step")
    fig.tight_layout()
    out = run_dir / "curves.png"
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
