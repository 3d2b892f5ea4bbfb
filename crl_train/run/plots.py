"""``curves.png``: the main curves of a run, read from its ``metrics.jsonl`` (declared
columns only)."""

from __future__ import annotations

from pathlib import Path

from crl_train.run.metrics import read_metrics


def plot_curves(run_dir: Path) -> Path | None:
    """curves.png: success (guided / free / all), actions per episode, bank size,
    extractor reward."""
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
