"""``crl-train --backend openrlhf --config FILE [--dry-run]``: our config as an OpenRLHF run on Ray.

:func:`build_plan` turns a crl-train config and its ``openrlhf:`` section
(:class:`~crl_train.openrlhf.config.OpenRLHFConfig`) into OpenRLHF's command line
(``openrlhf.cli.train_ppo_ray``) and a Ray resource plan, without importing Ray or OpenRLHF;
``--dry-run`` prints both and stops. :func:`launch` then

1. joins the Ray cluster (``openrlhf.ray_address``) with the run's settings in the job's
   ``runtime_env`` (``CRL_OPENRLHF_SETTINGS``: every process of the job reads them),
2. writes the prompt dataset (one row per task group, the ``hf`` backend's seeds) and the
   resolved config under ``--out``,
3. deploys the experience service: a detached named actor pinned to the head node, its bank in
   ``--out/service/bank`` (reused when an actor of that name is still alive),
4. puts our trainer classes (``crl_train.openrlhf.trainer``, pinned to the head node) in place of
   OpenRLHF's and runs ``openrlhf.cli.train_ppo_ray`` as ``__main__`` with that command line,
5. after training, checkpoints and closes the service. When training fails the service stays
   alive for a rerun (same ``--out``: OpenRLHF resumes from its checkpoint, the service from its).

How our settings map to OpenRLHF's flags is :func:`openrlhf_args`; ``docs/cluster.md`` explains it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crl_train.config import TrainConfig, config_to_dict, dump_config
from crl_train.config.io import ConfigError
from crl_train.config.names import MethodName, ModelKind
from crl_train.openrlhf.config import OpenRLHFConfig, load_cluster_config
from crl_train.openrlhf.settings import SETTINGS_ENV, ClusterSettings
from crl_train.openrlhf.tasks import TaskLabel
from crl_train.rollout.tasks import task_seeds

log = logging.getLogger(__name__)

AGENT_FILE = Path(__file__).with_name("agent.py")
"""``--train.agent_func_path``: OpenRLHF executes it in every vLLM engine actor."""

ENTRY_MODULE = "openrlhf.cli.train_ppo_ray"
SUPPORTED_METHODS: tuple[MethodName, ...] = (
    MethodName.GRPO,
    MethodName.COMPLEMENTARY,
    MethodName.STATIC_ONLINE,
    MethodName.OFFLINE_EXP,
)
"""Methods whose actor side is one RL update on (split-subgroup or GRPO) advantages."""

OPENRLHF_ENV_DEFAULTS: dict[str, str] = {
    "TOKENIZERS_PARALLELISM": "true",
    "NCCL_DEBUG": "WARN",
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
}
"""What OpenRLHF's own ``ray.init`` would put in the job's environment (kept when already set)."""


class LaunchError(RuntimeError):
    """The cluster cannot run the plan (missing packages, too few GPUs); nothing was trained."""


_DTYPES = {"auto": "bf16", "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16"}


@dataclass(frozen=True)
class Role:
    """One line of the resource plan."""

    name: str
    gpus: int
    where: str
    what: str
    cpus: float = 0.0


@dataclass(frozen=True)
class LaunchPlan:
    """Everything :func:`launch` will start, known before anything starts."""

    argv: tuple[str, ...]
    roles: tuple[Role, ...]
    run_dir: Path
    dataset: Path
    rows: int
    service_name: str
    namespace: str
    ray_address: str
    async_train: bool
    env_names: tuple[str, ...] = field(default_factory=tuple)

    @property
    def total_gpus(self) -> int:
        return sum(r.gpus for r in self.roles)

    @property
    def service_gpus(self) -> int:
        return next(r.gpus for r in self.roles if r.name == "experience service")

    def command(self) -> str:
        """The OpenRLHF command line (run in-process, with our trainer classes installed)."""
        lines = [f"python -m {ENTRY_MODULE}"]
        args = list(self.argv)
        i = 0
        while i < len(args):
            j = i + 1
            while j < len(args) and not args[j].startswith("--"):
                j += 1
            lines.append(" ".join(shlex.quote(a) for a in args[i:j]))
            i = j
        return " \\\n    ".join(lines)

    def describe(self) -> str:
        """The command line and the resource plan, as ``--dry-run`` prints them."""
        width = max(len(r.name) for r in self.roles)
        indent = " " * (width + 10)
        rows = [
            f"  {r.name:<{width}}  {r.gpus:>4}  {r.where}\n"
            + textwrap.fill(r.what, 110, initial_indent=indent, subsequent_indent=indent)
            for r in self.roles
        ]
        return "\n".join(
            [
                "OpenRLHF command line (crl-train runs it in-process with its trainer "
                "classes installed:",
                "crl_train.openrlhf.trainer, split-subgroup advantages and the "
                "service's end_step):",
                "",
                self.command(),
                "",
                f"Ray resource plan ({self.total_gpus} GPUs; Ray at {self.ray_address!r}, "
                f"namespace {self.namespace!r}):",
                f"  {'role':<{width}}  GPUs  where / what",
                *rows,
                "",
                f"Run directory: {self.run_dir} (prompt dataset {self.dataset}: {self.rows} "
                "task groups)",
                f"Environment of every Ray process of the job: {', '.join(self.env_names)}",
                "Mode: "
                f"{'asynchronous (--train.async_enable)' if self.async_train else 'synchronous'}",
            ]
        )


# ---------------------------------------------------------------------------------------- checks


def _device_index(device: str) -> int | None:
    """``cuda`` → 0, ``cuda:1`` → 1, anything else (``cpu``) → None."""
    m = re.fullmatch(r"cuda(?::(\d+))?", device.strip())
    return None if m is None else int(m.group(1) or 0)


def _has_extractor(cfg: TrainConfig) -> bool:
    from crl_train.methods import make_method

    return bool(make_method(cfg).service_options().extractor)


def check_supported(cfg: TrainConfig, ocfg: OpenRLHFConfig) -> None:
    """Refuse, with the reason, what the ``openrlhf`` backend cannot run (:class:`ConfigError`)."""
    problems = []
    if cfg.method not in SUPPORTED_METHODS:
        problems.append(
            f"method {cfg.method.value!r}: the openrlhf backend runs "
            f"{', '.join(SUPPORTED_METHODS)} (EDGE's distillation update and exp_only's frozen "
            "actor have no OpenRLHF counterpart: use --backend hf)"
        )
    if cfg.algo.gate.enabled or cfg.algo.self_distill:
        problems.append(
            "algo.gate / algo.self_distill need extra actor passes that OpenRLHF's trainer does "
            "not make: use --backend hf"
        )
    if cfg.actor.kind is ModelKind.TINY:
        problems.append(
            "actor.model: tiny exists only in memory; OpenRLHF loads an HF model id or directory"
        )
    if cfg.actor.constrained:
        problems.append(
            "actor.constrained: constrained decoding is an hf-backend feature (vLLM samples "
            "free text)"
        )
    if cfg.actor.dtype not in _DTYPES:
        problems.append(f"actor.dtype {cfg.actor.dtype!r}: DeepSpeed trains in bfloat16 or float16")
    k, tasks = cfg.env.group_size, cfg.env.tasks_per_step
    if (tasks * k) % (ocfg.train_micro_batch_size * ocfg.actor_gpus()):
        problems.append(
            f"one update takes env.tasks_per_step x env.group_size = {tasks * k} sequences, not a "
            f"multiple of openrlhf.train_micro_batch_size x actor GPUs = "
            f"{ocfg.train_micro_batch_size} x {ocfg.actor_gpus()}"
        )
    if tasks * k // ocfg.rollout_micro_batch_size < ocfg.actor_gpus():
        problems.append(
            f"{tasks * k} sequences in micro-batches of {ocfg.rollout_micro_batch_size} give fewer "
            f"batches than the {ocfg.actor_gpus()} actor GPUs"
        )
    devices = [("openrlhf.embedder_device", ocfg.embedder_device)]
    if _has_extractor(cfg):
        devices.append(("extractor.device", cfg.extractor.device))
        if cfg.extractor.generator == "vllm" and ocfg.service_gpus < 1:
            problems.append(
                "extractor.generator: vllm needs a GPU in the experience service "
                "(openrlhf.service_gpus)"
            )
    for what, device in devices:
        idx = _device_index(device)
        if idx is not None and idx >= ocfg.service_gpus:
            problems.append(
                f"{what} {device!r}: the experience service has "
                f"openrlhf.service_gpus={ocfg.service_gpus} GPU(s), numbered from cuda:0"
            )
    if problems:
        raise ConfigError(
            "the openrlhf backend cannot run this config:\n  - " + "\n  - ".join(problems)
        )


# ---------------------------------------------------------------------------------------- the plan


def openrlhf_args(cfg: TrainConfig, ocfg: OpenRLHFConfig, run_dir: Path) -> list[str]:
    """OpenRLHF's flags for ``cfg`` (every one is checked against OpenRLHF's parser by
    the tests)."""
    a, algo, k = cfg.actor, cfg.algo, cfg.env.group_size
    ordir = run_dir / "openrlhf"
    args = [
        "--actor.model_name_or_path",
        a.model,
        "--actor.num_nodes",
        str(ocfg.actor_nodes),
        "--actor.num_gpus_per_node",
        str(ocfg.actor_gpus_per_node),
        "--vllm.num_engines",
        str(ocfg.vllm_engines),
        "--vllm.tensor_parallel_size",
        str(ocfg.vllm_tensor_parallel),
        "--vllm.gpu_memory_utilization",
        str(ocfg.vllm_gpu_memory_utilization),
        # agent mode: our executor runs the env; the reward comes from it (no reward model)
        "--train.agent_func_path",
        str(AGENT_FILE),
        "--data.prompt_dataset",
        str(ordir / "prompts.jsonl"),
        "--data.input_key",
        "input",
        "--data.label_key",
        "label",
        "--data.max_len",
        str(a.max_context_tokens),
        # one rollout step = tasks_per_step groups of K; one optimizer step per rollout step
        "--rollout.batch_size",
        str(cfg.env.tasks_per_step),
        "--rollout.n_samples_per_prompt",
        str(k),
        "--rollout.micro_batch_size",
        str(ocfg.rollout_micro_batch_size),
        "--rollout.temperature",
        str(a.temperature),
        "--rollout.top_p",
        str(a.top_p),
        "--train.batch_size",
        str(cfg.env.tasks_per_step * k),
        "--train.micro_batch_size",
        str(ocfg.train_micro_batch_size),
        "--train.max_epochs",
        "1",
        "--train.num_episodes",
        "1",
        "--train.seed",
        str(cfg.seed),
        # the objective: outcome reward, split-subgroup advantages (our mixin
        # replaces group_norm's), no KL and no reference model, clip 0.2, sequence-level ratio
        # (GSPO) or per-token (PPO)
        "--algo.advantage.estimator",
        "group_norm",
        "--algo.kl.init_coef",
        "0",
        "--actor.eps_clip",
        str(algo.clip_eps),
        "--actor.policy_loss_type",
        "gspo" if algo.ratio_level == "sequence" else "ppo",
        "--actor.loss_agg_mode",
        "seq-mean-token-mean",
        # AdamW as the hf backend's OptimConfig: constant lr, no warm-up, no weight decay
        "--actor.adam.lr",
        str(a.lr),
        "--actor.adam.betas",
        "0.9",
        "0.999",
        "--actor.adam.weight_decay",
        "0",
        "--actor.lr_scheduler",
        "constant",
        "--actor.lr_warmup_ratio",
        "0",
        "--actor.max_norm",
        "1.0",
        "--ds.zero_stage",
        str(ocfg.zero_stage),
        "--ds.param_dtype",
        _DTYPES.get(a.dtype, "bf16"),
        "--ds.attn_implementation",
        ocfg.attn_implementation,
        "--ckpt.path",
        str(ordir / "ckpt"),
        "--ckpt.output_dir",
        str(ordir / "model"),
        "--ckpt.save_steps",
        str(cfg.train.checkpoint_every),
        "--ckpt.load_enable",
        "--logger.logging_steps",
        str(cfg.train.log_every),
        "--logger.tensorboard_dir",
        str(run_dir / "tb"),
    ]
    flags = [
        ("--vllm.enable_prefix_caching", ocfg.vllm_prefix_caching),
        ("--actor.gradient_checkpointing_enable", ocfg.gradient_checkpointing),
        ("--ds.packing_samples", ocfg.packing_samples),
        ("--ds.adam_offload", ocfg.adam_offload),
        ("--train.async_enable", ocfg.async_train),
    ]
    args += [flag for flag, on in flags if on]
    return args + list(ocfg.extra_args)


def resource_plan(
    cfg: TrainConfig, ocfg: OpenRLHFConfig, run_dir: Path, service_name: str
) -> list[Role]:
    """Who gets which GPUs (the experience service and the trainer controller on the head node)."""
    a, e = cfg.actor, cfg.extractor
    ext = "no extractor (this method has none)"
    if _has_extractor(cfg):
        gen = (
            "vLLM generation on cuda:0 (weights synced after each CISPO update)"
            if e.generator == "vllm"
            else f"generation on {e.device}"
        )
        ext = f"extractor {e.model}: HF training (CISPO) on {e.device}, {gen}"
    trainer = "CRLPPOTrainerAsync + CRLTrainingActor" if ocfg.async_train else "CRLPPOTrainer"
    return [
        Role(
            "actor training",
            ocfg.actor_gpus(),
            f"{ocfg.actor_nodes} node(s) x {ocfg.actor_gpus_per_node} GPUs",
            f"DeepSpeed ZeRO-{ocfg.zero_stage}, {a.model} ({_DTYPES.get(a.dtype, 'bf16')}, AdamW "
            f"lr {a.lr:g}{', gradient checkpointing' if ocfg.gradient_checkpointing else ''})",
            cpus=ocfg.actor_gpus(),
        ),
        Role(
            "actor generation",
            ocfg.vllm_gpus(),
            f"{ocfg.vllm_engines} vLLM engine(s) x {ocfg.vllm_tensor_parallel} GPU",
            f"rollouts of {a.model}; our agent executor steps the envs ({ocfg.env_threads} threads "
            "per engine); weights reloaded by OpenRLHF after each update",
            cpus=ocfg.vllm_gpus(),
        ),
        Role(
            "experience service",
            ocfg.service_gpus,
            "head node (detached, pinned)",
            f"Ray actor {service_name!r} (max_concurrency {ocfg.max_concurrency}, "
            f"{ocfg.service_cpus} CPUs): {ext}; {ocfg.embedding_workers} x "
            f"{cfg.experience.embedder} embedder on {ocfg.embedder_device}; "
            f"{cfg.manager.num_workers} search workers; bank {run_dir / 'service' / 'bank'}",
            cpus=ocfg.service_cpus,
        ),
        Role(
            "trainer controller",
            0,
            "head node",
            f"{trainer}: split-subgroup advantages, end_step to the service",
            cpus=1,
        ),
    ]


def dataset_rows(cfg: TrainConfig) -> list[dict[str, str]]:
    """One prompt row per task group of the run: step t's groups are ``task_seeds(env, t)``."""
    rows: list[dict[str, str]] = []
    for step in range(cfg.train.steps):
        for env_id, seed in task_seeds(cfg.env, step):
            label = TaskLabel(env_id, seed, len(rows))
            rows.append({"input": f"{env_id} seed {seed}", "label": label.encode()})
    return rows


def build_plan(cfg: TrainConfig, ocfg: OpenRLHFConfig, run_dir: Path) -> LaunchPlan:
    """The plan for ``cfg`` in ``run_dir`` (checks first; imports neither Ray nor OpenRLHF)."""
    check_supported(cfg, ocfg)
    run_dir = Path(run_dir).absolute()
    name = ocfg.service_name or f"crl-experience-{re.sub(r'[^A-Za-z0-9_.-]', '-', run_dir.name)}"
    return LaunchPlan(
        argv=tuple(openrlhf_args(cfg, ocfg, run_dir)),
        roles=tuple(resource_plan(cfg, ocfg, run_dir, name)),
        run_dir=run_dir,
        dataset=run_dir / "openrlhf" / "prompts.jsonl",
        rows=cfg.train.steps * cfg.env.tasks_per_step,
        service_name=name,
        namespace=ocfg.namespace,
        ray_address=ocfg.ray_address,
        async_train=ocfg.async_train,
        env_names=(SETTINGS_ENV, *OPENRLHF_ENV_DEFAULTS),
    )


# ---------------------------------------------------------------------------------------- running


def main(
    config_path: Path | None,
    overrides: tuple[str, ...] | list[str],
    out: Path | None,
    *,
    dry_run: bool,
    echo: Callable[[str], Any] = print,
) -> LaunchPlan:
    """What ``crl-train --backend openrlhf`` does (``ConfigError`` for a config it cannot run)."""
    cfg, ocfg = load_cluster_config(config_path, list(overrides))
    run_dir = out if out is not None else Path("runs") / f"{cfg.method}-openrlhf"
    plan = build_plan(cfg, ocfg, run_dir)
    echo(plan.describe())
    if not dry_run:
        launch(plan, cfg, ocfg, echo=echo)
    return plan


def _env_vars(settings: ClusterSettings) -> dict[str, str]:
    env = {k: os.environ.get(k, v) for k, v in OPENRLHF_ENV_DEFAULTS.items()}
    env[SETTINGS_ENV] = settings.to_json()
    return env


def _check_cluster(plan: LaunchPlan) -> None:
    import ray

    from crl_train.service.ray_actor import head_node_id

    total = float(ray.cluster_resources().get("GPU", 0))
    if total < plan.total_gpus:
        raise LaunchError(
            f"the plan needs {plan.total_gpus} GPUs, the Ray cluster has {total:g} "
            "(ray status shows them; see docs/cluster.md)"
        )
    head = head_node_id()
    if ray.get_runtime_context().get_node_id() != head:
        raise LaunchError(
            "run crl-train on the Ray head node: the run directory, the prompt dataset and the "
            "service's bank are written on this machine, and the service and the trainer run on "
            "the head"
        )
    head_gpus = next(
        (float(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["NodeID"] == head), 0.0
    )
    if head_gpus < plan.service_gpus:
        raise LaunchError(
            f"the experience service needs {plan.service_gpus} GPUs on the head node, which has "
            f"{head_gpus:g}"
        )


def launch(
    plan: LaunchPlan, cfg: TrainConfig, ocfg: OpenRLHFConfig, *, echo: Callable[[str], Any] = print
) -> None:
    """Start everything the plan lists and train (see the module docstring)."""
    import importlib.util

    if importlib.util.find_spec("openrlhf") is None or importlib.util.find_spec("vllm") is None:
        raise LaunchError(
            "the openrlhf backend needs OpenRLHF and vLLM on every node: "
            "pip install 'complementary-rl[openrlhf]' (CUDA machines; see docs/cluster.md)"
        )
    import runpy

    import ray

    from crl_train.openrlhf.placement import OnNode
    from crl_train.service.ray_actor import deploy_service, head_node_id

    settings = ClusterSettings.of(
        cfg,
        service_name=plan.service_name,
        namespace=plan.namespace,
        run_dir=str(plan.run_dir),
        env_threads=ocfg.env_threads,
    )
    env = _env_vars(settings)
    os.environ.update(env)  # this driver reads them too
    try:
        ray.init(
            address=None if plan.ray_address == "local" else plan.ray_address,
            namespace=plan.namespace,
            runtime_env={"env_vars": env},
        )
    except ConnectionError as exc:
        raise LaunchError(
            f"no Ray cluster at {plan.ray_address!r} ({exc}): start one with `ray start --head` "
            "(docs/cluster.md) or set openrlhf.ray_address: local"
        ) from exc
    _check_cluster(plan)
    plan.dataset.parent.mkdir(parents=True, exist_ok=True)
    with plan.dataset.open("w", encoding="utf-8") as f:
        for row in dataset_rows(cfg):
            f.write(json.dumps(row) + "\n")
    dump_config(cfg, plan.run_dir / "config.yaml")
    (plan.run_dir / "openrlhf" / "command.txt").write_text(plan.describe() + "\n", encoding="utf-8")
    echo(f"starting the experience service {plan.service_name!r} on the head node …")
    from crl_train.methods import make_method

    client = deploy_service(
        config_to_dict(cfg),
        plan.run_dir / "service",
        options=make_method(cfg).service_options(),
        name=plan.service_name,
        namespace=plan.namespace,
        num_gpus=ocfg.service_gpus,
        num_cpus=ocfg.service_cpus,
        max_concurrency=ocfg.max_concurrency,
        embedding_workers=ocfg.embedding_workers,
        embedder_device=ocfg.embedder_device,
    )
    echo(f"experience service up: {client.health()}")

    from openrlhf.trainer import ppo_trainer, ppo_trainer_async

    from crl_train.openrlhf.trainer import CRLPPOTrainer, CRLPPOTrainerAsync

    head = head_node_id()
    ppo_trainer.PPOTrainer = OnNode(CRLPPOTrainer, head)
    ppo_trainer_async.PPOTrainerAsync = OnNode(CRLPPOTrainerAsync, head)
    argv = sys.argv
    sys.argv = [ENTRY_MODULE, *plan.argv]
    try:
        runpy.run_module(ENTRY_MODULE, run_name="__main__", alter_sys=True)
    except BaseException:
        echo(
            f"training stopped with an error; the experience service {plan.service_name!r} "
            f"(namespace {plan.namespace!r}) stays alive with its bank: rerun the same command to "
            f"resume, or remove it with ray.kill(ray.get_actor({plan.service_name!r}, "
            f"namespace={plan.namespace!r}))"
        )
        raise
    finally:
        sys.argv = argv
    echo(f"training done; service checkpoint: {client.checkpoint()}")
    client.shutdown()


__all__ = [
    "AGENT_FILE",
    "ENTRY_MODULE",
    "SUPPORTED_METHODS",
    "LaunchError",
    "LaunchPlan",
    "Role",
    "build_plan",
    "check_supported",
    "dataset_rows",
    "launch",
    "main",
    "openrlhf_args",
    "resource_plan",
]
