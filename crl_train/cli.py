"""``crl-train`` and ``crl-eval`` (thin click commands over :mod:`crl_train.run.trainer`)."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from crl_gym.json_types import JSONDict
from crl_train.config import METHOD_NAMES, ConfigError, TrainConfig, load_config

if TYPE_CHECKING:
    from crl_train.run.trainer import Trainer

log = logging.getLogger("crl_train")


def _setup_logging(run_dir: Path | None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(run_dir / "train.log", encoding="utf-8"))
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=handlers,
        force=True,
    )
    logging.getLogger("crl_train").setLevel(logging.INFO)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="YAML config file. Default: the packaged tiny preset (tiny random-init models on MiniHack "
    "Room, CPU).",
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override one config value, e.g. --set train.steps=3 --set method=grpo (value parsed as "
    "YAML). Repeatable.",
)
@click.option(
    "--method",
    "method",
    type=click.Choice(list(METHOD_NAMES)),
    default=None,
    help="The method (the same as --set method=NAME, applied before the other --set).",
)
@click.option(
    "--env",
    "env_ids",
    multiple=True,
    metavar="ID",
    help="Train on this Gymnasium id (the same as --set env.ids='[ID, ...]', applied before the "
    "other --set; repeatable for several envs): a crl/ id, an id registered with "
    "gymnasium.register, 'module:EnvId-v0' (the module is imported first) or an entry point's id.",
)
@click.option(
    "--out",
    "out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Run directory (config.yaml, metrics.jsonl, tb/, curves.png, checkpoint/, bank/). "
    "Default: runs/<method>.",
)
@click.option(
    "--resume",
    "resume",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    default=None,
    help="Continue the run in this directory from its last checkpoint (its config.yaml is used; "
    "--set still applies and is saved to config.yaml, the previous one kept as "
    "config.before_step<N>.yaml).",
)
@click.option("--no-progress", is_flag=True, default=False, help="Hide the progress bar.")
@click.option(
    "--show-config",
    is_flag=True,
    default=False,
    help="Print the resolved config (after --config / --resume / --set) as YAML, every key with "
    "its documentation, type and default as comments, and exit without training. This is the full "
    "key reference; the output can be saved and passed back with --config.",
)
@click.option(
    "--backend",
    type=click.Choice(["hf", "openrlhf"]),
    default="hf",
    show_default=True,
    help="hf: this process trains both models (CPU or one GPU per model). openrlhf: a Ray cluster; "
    "OpenRLHF trains the actor, the experience service runs as a Ray actor (docs/cluster.md; "
    "the config's openrlhf: section sizes it).",
)
@click.option(
    "--dry-run",
    is_flag=True,
    default=False,
    help="--backend openrlhf: print the OpenRLHF command line and the Ray resource plan, "
    "start nothing.",
)
def train(
    config_path: Path | None,
    overrides: tuple[str, ...],
    method: str | None,
    env_ids: tuple[str, ...],
    out: Path | None,
    resume: Path | None,
    no_progress: bool,
    show_config: bool,
    backend: str,
    dry_run: bool,
) -> None:
    """Train an actor (and an experience extractor) with Complementary RL or a baseline."""
    if env_ids:
        overrides = (f"env.ids={json.dumps(list(env_ids))}", *overrides)
    if method is not None:
        overrides = (f"method={method}", *overrides)
    if backend == "openrlhf" or dry_run:
        _train_openrlhf(
            config_path,
            overrides,
            out,
            dry_run=dry_run,
            backend=backend,
            unsupported={"--resume": resume is not None, "--show-config": show_config},
        )
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        source = config_path or (resume / "config.yaml" if resume is not None else None)
        cfg = load_config(source, list(overrides))
        from crl_train.methods import check_method_config

        check_method_config(cfg)
        run_dir = resume if resume is not None else out or Path("runs") / cfg.method
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if show_config:  # before anything touches the run directory
        click.echo(_show_config(cfg, source, overrides), nl=False)
        return
    _check_env_ids(cfg, resume)
    _setup_logging(run_dir)
    from crl_train.run.trainer import TrackFailure

    trainer = _make_trainer(cfg, run_dir, resume=resume is not None, progress=not no_progress)
    try:
        row = trainer.run()
        if cfg.train.eval_episodes:
            from crl_train.run.evaluate import evaluate_run

            evaluate_run(trainer, cfg.train.eval_episodes)
    except TrackFailure as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        trainer.close()
    # what kept the extractor from training, if anything, beside the last row
    click.echo(
        json.dumps(
            {
                "run_dir": str(run_dir),
                "final": row,
                **({"problems": trainer.problems} if trainer.problems else {}),
            }
        )
    )


def _train_openrlhf(
    config_path: Path | None,
    overrides: tuple[str, ...],
    out: Path | None,
    *,
    dry_run: bool,
    backend: str,
    unsupported: dict[str, bool],
) -> None:
    """``--backend openrlhf``: :func:`crl_train.openrlhf.launcher.main` (its errors as
    usage errors)."""
    if backend != "openrlhf":
        raise click.UsageError("--dry-run goes with --backend openrlhf")
    given = [flag for flag, on in unsupported.items() if on]
    if given:
        raise click.UsageError(
            f"{', '.join(given)}: not with --backend openrlhf (rerun the same command to resume)"
        )
    from crl_train.openrlhf.launcher import LaunchError
    from crl_train.openrlhf.launcher import main as launch_openrlhf

    try:
        launch_openrlhf(config_path, overrides, out, dry_run=dry_run, echo=click.echo)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    except LaunchError as exc:
        raise click.ClickException(str(exc)) from None


def _check_env_ids(cfg: TrainConfig, run_dir: Path | None) -> None:
    """Every id of ``env.ids`` found (its module imported, entry points loaded) before anything
    starts; one that is not is a usage error that says how to register it."""
    import gymnasium as gym

    from crl_gym.envs import resolve

    where = f" (recorded in {run_dir / 'config.yaml'})" if run_dir is not None else ""
    for env_id in cfg.env.ids:
        try:
            resolve(env_id)
        except (ImportError, gym.error.Error) as exc:
            raise click.UsageError(f"env.ids{where}: {exc}") from None


def _show_config(cfg: TrainConfig, source: Path | None, overrides: tuple[str, ...]) -> str:
    from crl_train.config.docs import render_config_yaml

    header = "\n".join(
        [
            "Resolved crl-train config",
            f"  from: {source}"
            if source is not None
            else "  from: the packaged tiny preset (crl_train/configs/tiny.yaml)",
            *([f"  --set {o}" for o in overrides]),
            "Above each key: its documentation, then its type and its dataclass default.",
            "Save this output and pass it back with --config to run exactly this config.",
        ]
    )
    return render_config_yaml(cfg, header=header)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--run",
    "run_dir",
    required=True,
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="A run directory written by crl-train (uses its config.yaml, checkpoint/ and bank/).",
)
@click.option(
    "--episodes",
    default=16,
    show_default=True,
    type=click.IntRange(min=1),
    help="Held-out episodes per mode (rounded up to whole groups of K).",
)
@click.option(
    "--memory",
    "memory",
    multiple=True,
    type=click.Choice(["none", "frozen", "online"]),
    help="What the actor may retrieve from: none (no bank), frozen (the checkpoint's bank, "
    "read-only) or online (that bank live: the extractor distils the held-out episodes as they "
    "finish). Repeat for several; every mode plays the same held-out tasks. Default: frozen "
    "and none.",
)
@click.option(
    "--with-exp/--without-exp",
    "with_exp",
    default=None,
    hidden=True,
    help="Deprecated: --memory frozen / --memory none.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    default=False,
    help="Print the result as one JSON object (for machines).",
)
def evaluate(
    run_dir: Path, episodes: int, memory: tuple[str, ...], with_exp: bool | None, as_json: bool
) -> None:
    """Evaluate a trained actor on held-out seeds, with 95 % intervals; prints and writes eval.json.

    Success rates get Wilson intervals at the effective number of episodes (each task is played a
    group of times), actions per episode a t interval, the paired difference between modes a t
    interval over the same tasks, and the internalisation ratio (success none / frozen) a bootstrap
    interval over tasks.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        cfg = load_config(run_dir / "config.yaml")
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    _check_env_ids(cfg, run_dir)
    _setup_logging(None)
    if with_exp is not None:
        click.echo(
            "crl-eval: --with-exp/--without-exp are deprecated; use --memory "
            f"{'frozen' if with_exp else 'none'}",
            err=True,
        )
        memory = memory or (("frozen",) if with_exp else ("none",))
    result = evaluate_dir(cfg, run_dir, episodes, memory=memory or ("frozen", "none"))
    click.echo(json.dumps(result) if as_json else _eval_table(result))


def _eval_table(result: dict[str, Any]) -> str:
    """eval.json as a few readable lines."""

    def iv(value: float | None, ci: list[float | None]) -> str:
        if value is None:
            return "n/a"
        lo, hi = ci
        return f"{value:.3f}" if lo is None or hi is None else f"{value:.3f} [{lo:.3f}, {hi:.3f}]"

    lines = [f"held-out episodes per mode: {result['episodes_per_mode']} (95 % intervals)"]
    for mode, r in result.get("memory", {}).items():
        lines.append(
            f"memory {mode}: success {iv(r['success'], r['success_ci'])} "
            f"(Wilson, {r['tasks']} tasks, effective n {r['effective_episodes']:.1f}), "
            f"actions per episode {iv(r['actions_per_episode'], r['actions_per_episode_ci'])} (t)"
        )
    for mode, why in result.get("skipped", {}).items():
        lines.append(f"memory {mode}: skipped ({why})")
    for p in result.get("paired", []):
        lines.append(
            f"{p['a']} − {p['b']}: {iv(p['diff'], p['ci95'])} (paired t over {p['tasks']} tasks)"
        )
    if "internalisation" in result:
        r = result["internalisation"]
        lines.append(
            f"internalisation (none / frozen): {iv(r['ratio'], r['ratio_ci'])} (bootstrap)"
        )
    return "\n".join(lines)


def _make_trainer(cfg: TrainConfig, run_dir: Path, **kw: Any) -> Trainer:
    from crl_train.policy.factory import GeneratorUnavailable
    from crl_train.run.trainer import Trainer

    try:
        return Trainer(cfg, run_dir, **kw)
    except GeneratorUnavailable as exc:
        raise click.ClickException(str(exc)) from None


def evaluate_dir(
    cfg: TrainConfig,
    run_dir: Path,
    episodes: int,
    modes: tuple[bool, ...] | None = None,
    env_factory: Callable[[str], Any] | None = None,
    *,
    memory: tuple[str, ...] = ("frozen", "none"),
) -> JSONDict:
    """:func:`crl_train.run.evaluate.evaluate_dir`, a vLLM generator that cannot start reported
    as a usage error."""
    from crl_train.policy.factory import GeneratorUnavailable
    from crl_train.run.evaluate import evaluate_dir as run_eval

    try:
        return run_eval(cfg, run_dir, episodes, modes, env_factory=env_factory, memory=memory)
    except GeneratorUnavailable as exc:
        raise click.ClickException(str(exc)) from None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--suite",
    "suite_path",
    required=True,
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="Suite YAML: methods × seeds × env mixtures (see experiments/).",
)
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Output folder: cells/<method>/<envs>/seed<N>/ run directories, report.md and its plots.",
)
@click.option(
    "--ray",
    "ray_address",
    default=None,
    metavar="ADDRESS",
    help="Run each cell as a Ray task with the suite's resources: 'local' or a cluster address.",
)
@click.option("--no-progress", is_flag=True, default=False, help="Hide the progress bar.")
@click.option(
    "--report-only",
    is_flag=True,
    default=False,
    help="Run nothing: write report.md and summary.json from the cells already finished under "
    "--out (a suite in progress, or a report re-made by newer code).",
)
def experiment(
    suite_path: Path, out: Path, ray_address: str | None, no_progress: bool, report_only: bool
) -> None:
    """Run a grid of crl-train runs and write report.md with 95 % intervals over seeds.

    Safe to interrupt: run the same command again and finished cells are kept, a cell with a
    checkpoint resumes from it. Several processes may share one --out (one per core): each skips
    the cells another is running and waits for them at the end.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from crl_train.experiment.report import write_report
    from crl_train.experiment.suite import finished_records, load_suite, run_suite

    try:
        suite = load_suite(suite_path)
    except ConfigError as exc:
        raise click.UsageError(f"{suite_path}: {exc}") from None
    if report_only:
        records = finished_records(suite, out)
        if not records:
            raise click.UsageError(f"--report-only: no finished cell of {suite.name} under {out}")
        click.echo(
            json.dumps({"report": str(write_report(suite, out, records)), "cells": len(records)})
        )
        return
    _setup_logging(out)
    records = run_suite(suite, out, ray_address=ray_address, progress=not no_progress)
    click.echo(
        json.dumps({"report": str(write_report(suite, out, records)), "cells": len(records)})
    )
