"""``crl-swe``: SWE-Bench task tools.

crl-swe filter --tasks tasks.jsonl --policy agent.py:act --k 16 --low 0 --high 0.8 --out kept.jsonl
crl-swe reap [--all]
"""

from __future__ import annotations

import json
import logging

import click


@click.group()
def cli() -> None:
    """SWE-Bench environment tools (task filtering, sandbox clean-up)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


@cli.command("filter")
@click.option(
    "--tasks",
    "tasks_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="JSONL/JSON file of SWE-bench instances.",
)
@click.option(
    "--policy", required=True, help="file.py:name, package.module:name, or a model directory."
)
@click.option(
    "--k", default=16, show_default=True, type=click.IntRange(min=1), help="Attempts per task."
)
@click.option(
    "--low", default=0.0, show_default=True, type=float, help="Keep tasks with rate > low."
)
@click.option(
    "--high", default=0.8, show_default=True, type=float, help="Keep tasks with rate < high."
)
@click.option(
    "--out", required=True, type=click.Path(dir_okay=False), help="JSONL of the kept instances."
)
@click.option(
    "--workers",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Concurrent episodes.",
)
@click.option("--max-turns", default=50, show_default=True, type=click.IntRange(min=1))
@click.option("--command-timeout", default=60.0, show_default=True, type=float)
@click.option(
    "--report",
    "report_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="Also write the per-task success rates here (JSON).",
)
def filter_cmd(
    tasks_path: str,
    policy: str,
    k: int,
    low: float,
    high: float,
    out: str,
    workers: int,
    max_turns: int,
    command_timeout: float,
    report_path: str | None,
) -> None:
    """Keep the tasks whose pass@k success rate of POLICY lies in (LOW, HIGH)."""
    from crl_gym.envs.swebench.env import SWEBenchEnv
    from crl_gym.envs.swebench.filter import filter_tasks, load_policy
    from crl_gym.envs.swebench.sandbox import SandboxConfig, docker_client
    from crl_gym.envs.swebench.tasks import load_tasks, write_tasks

    if not 0.0 <= low < high <= 1.0:
        raise click.BadParameter(f"need 0 <= low < high <= 1, got low={low}, high={high}")
    tasks = load_tasks(tasks_path)
    factory = load_policy(policy)
    client = docker_client()
    cfg = SandboxConfig(command_timeout=command_timeout)

    def make_env() -> SWEBenchEnv:
        return SWEBenchEnv(tasks=tasks, max_turns=max_turns, sandbox_config=cfg, client=client)

    kept, report = filter_tasks(tasks, make_env, factory, k=k, low=low, high=high, workers=workers)
    write_tasks(kept, out)
    if report_path:
        with open(report_path, "w", encoding="utf-8") as f:
            json.dump(report.to_dict(), f, indent=2)
    click.echo(json.dumps(report.to_dict()))


@cli.command("reap")
@click.option(
    "--all", "everything", is_flag=True, help="Remove every sandbox container, not only orphans."
)
@click.option(
    "--images", is_flag=True, help="Also remove the per-instance images built from the base image."
)
def reap_cmd(everything: bool, images: bool) -> None:
    """Remove leftover sandbox containers (label crl.sandbox=1)."""
    from crl_gym.envs.swebench.image import remove_instance_images
    from crl_gym.envs.swebench.sandbox import docker_client, reap

    client = docker_client()
    result = {"containers_removed": reap(client, everything=everything)}
    if images:
        result["images_removed"] = remove_instance_images(client)
    click.echo(json.dumps(result))


if __name__ == "__main__":
    cli()
