"""The ``openrlhf:`` section of a cluster preset: GPUs per role and the OpenRLHF knobs our
config lacks.

A cluster preset (``configs/cluster/*.yaml``) is an ordinary crl-train config plus one
``openrlhf:`` section. :func:`load_cluster_config` splits the two, so the crl-train part is
validated exactly as ``crl-train --config`` validates it, and ``--set openrlhf.vllm_engines=4``
works like any other override.

>>> cfg, ocfg = load_cluster_config(None, ["openrlhf.actor_gpus_per_node=4"])
>>> cfg.method.value, ocfg.actor_gpus_per_node, ocfg.total_gpus()
('complementary', 4, 12)
>>> load_cluster_config(None, ["openrlhf.gpus=3"])  # doctest: +NORMALIZE_WHITESPACE
Traceback (most recent call last):
...
crl_train.config.io.ConfigError: unknown key 'openrlhf.gpus'; accepted keys: actor_gpus_per_node,
    actor_nodes, adam_offload, async_train, attn_implementation, embedder_device,
    embedding_workers, env_threads, extra_args, gradient_checkpointing, max_concurrency,
    namespace, packing_samples, ray_address, rollout_micro_batch_size, service_cpus,
    service_gpus, service_name, train_micro_batch_size, vllm_engines,
    vllm_gpu_memory_utilization, vllm_prefix_caching, vllm_tensor_parallel, zero_stage
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crl_train.config import PACKAGED_CONFIGS, TrainConfig, config_from_dict
from crl_train.config.io import ConfigError, build_dataclass, parse_override, read_yaml, set_path

SECTION = "openrlhf"
"""Top-level key of a preset that holds :class:`OpenRLHFConfig`."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,100}")


@dataclass(frozen=True)
class OpenRLHFConfig:
    """Resources and engine knobs of the ``openrlhf`` backend (the rest comes from the
    crl-train config)."""

    ray_address: str = "auto"
    """``ray.init(address=...)``: ``auto`` joins the cluster started with ``ray start`` on this
    machine; ``local`` starts a one-machine Ray (a single GPU box)."""
    namespace: str = "crl"
    """Ray namespace of the experience service's named actor."""
    service_name: str | None = None
    """Name of the detached experience-service actor; None =
    ``crl-experience-<run directory name>``. A rerun with the same name reuses a service that is
    still alive (its bank, B_φ and π_φ)."""
    actor_nodes: int = 1
    """Nodes of the actor's DeepSpeed group (``--actor.num_nodes``)."""
    actor_gpus_per_node: int = 8
    """GPUs per node of the actor's DeepSpeed group (``--actor.num_gpus_per_node``)."""
    vllm_engines: int = 6
    """vLLM engines generating the actor's rollouts (``--vllm.num_engines``)."""
    vllm_tensor_parallel: int = 1
    """GPUs per actor vLLM engine (``--vllm.tensor_parallel_size``)."""
    vllm_gpu_memory_utilization: float = 0.9
    """Share of each engine GPU's memory vLLM may take (``--vllm.gpu_memory_utilization``)."""
    vllm_prefix_caching: bool = True
    """vLLM prefix caching: every turn of an episode re-sends the conversation so far."""
    service_gpus: int = 2
    """GPUs of the experience service actor: π_φ's HF training (``extractor.device``), its vLLM
    engine (``extractor.generator: vllm`` runs on the first of them) and the embedders."""
    service_cpus: int = 8
    """CPUs reserved for the service actor (search workers, embedding, the extractor's process)."""
    max_concurrency: int = 64
    """Calls the service actor runs at once: concurrent searches reach the manager together and
    are embedded in one batch (B = ``manager.batch_size``)."""
    embedding_workers: int = 2
    """Copies of the embedder in the service; the manager's search workers encode on whichever
    is free."""
    embedder_device: str = "cuda:0"
    """Device of the service's embedders (``cpu`` for the hashing or MiniLM embedder)."""
    env_threads: int = 128
    """Threads per vLLM engine process that run env.reset / env.step (never on vLLM's
    event loop)."""
    zero_stage: int = 3
    """DeepSpeed ZeRO stage of the actor (``--ds.zero_stage``)."""
    adam_offload: bool = False
    """Keep AdamW's states in CPU memory (``--ds.adam_offload``)."""
    gradient_checkpointing: bool = True
    """Recompute activations in the backward pass (``--actor.gradient_checkpointing_enable``)."""
    packing_samples: bool = True
    """Pack sequences without padding (``--ds.packing_samples``; needs flash attention)."""
    attn_implementation: str = "flash_attention_2"
    """``--ds.attn_implementation``."""
    train_micro_batch_size: int = 2
    """Sequences per GPU per forward/backward of the actor (``--train.micro_batch_size``)."""
    rollout_micro_batch_size: int = 4
    """Sequences per GPU per log-prob forward (``--rollout.micro_batch_size``)."""
    async_train: bool = False
    """OpenRLHF's asynchronous mode (``--train.async_enable``): the next batch is generated while
    the actor trains on this one, with weights one update behind."""
    extra_args: tuple[str, ...] = ()
    """More OpenRLHF flags passed as they are (each checked against OpenRLHF's parser by the tests
    of the flags this project emits; these are the user's responsibility)."""

    def __post_init__(self) -> None:
        for name in (
            "actor_nodes",
            "actor_gpus_per_node",
            "vllm_engines",
            "vllm_tensor_parallel",
            "service_cpus",
            "max_concurrency",
            "embedding_workers",
            "env_threads",
            "train_micro_batch_size",
            "rollout_micro_batch_size",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"openrlhf.{name} must be >= 1, got {getattr(self, name)}")
        if self.service_gpus < 0:
            raise ConfigError(f"openrlhf.service_gpus must be >= 0, got {self.service_gpus}")
        if self.max_concurrency < 2:
            raise ConfigError(
                f"openrlhf.max_concurrency must be >= 2 (concurrent searches are batched), "
                f"got {self.max_concurrency}"
            )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"openrlhf.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ConfigError(
                f"openrlhf.vllm_gpu_memory_utilization must be in (0, 1], got "
                f"{self.vllm_gpu_memory_utilization}"
            )
        if not _NAME.fullmatch(self.namespace):
            raise ConfigError(
                f"openrlhf.namespace {self.namespace!r}: use letters, digits, '_', '-', '.'"
            )
        if self.service_name is not None and not _NAME.fullmatch(self.service_name):
            raise ConfigError(
                f"openrlhf.service_name {self.service_name!r}: use letters, digits, '_', '-', '.'"
            )
        if self.packing_samples and "flash_attention" not in self.attn_implementation:
            raise ConfigError(
                f"openrlhf.packing_samples needs a flash attention implementation, got "
                f"attn_implementation={self.attn_implementation!r}"
            )
        for i, arg in enumerate(self.extra_args):
            if i == 0 and not arg.startswith("--"):
                raise ConfigError(
                    f"openrlhf.extra_args must start with a flag (--...), got {arg!r}"
                )

    def actor_gpus(self) -> int:
        return self.actor_nodes * self.actor_gpus_per_node

    def vllm_gpus(self) -> int:
        return self.vllm_engines * self.vllm_tensor_parallel

    def total_gpus(self) -> int:
        """GPUs the whole run reserves: actor training, actor generation, the experience service."""
        return self.actor_gpus() + self.vllm_gpus() + self.service_gpus


def split_sections(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(crl-train part, ``openrlhf`` part) of a preset's mapping (neither is modified)."""
    rest = {k: v for k, v in data.items() if k != SECTION}
    section = data.get(SECTION) or {}
    if not isinstance(section, dict):
        raise ConfigError(f"{SECTION}: expected a mapping, got {type(section).__name__}")
    return rest, dict(section)


def load_cluster_config(
    path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()
) -> tuple[TrainConfig, OpenRLHFConfig]:
    """A preset (default: the packaged tiny preset, which has no ``openrlhf`` section) and its
    ``--set`` overrides, as the crl-train config and the backend's own section."""
    data = read_yaml(path if path is not None else PACKAGED_CONFIGS / "tiny.yaml")
    for text in overrides:
        key, value = parse_override(text)
        set_path(data, key, value)
    rest, section = split_sections(data)
    cfg = config_from_dict(rest)
    ocfg: OpenRLHFConfig = build_dataclass(OpenRLHFConfig, section, SECTION)
    return cfg, ocfg


__all__ = ["SECTION", "OpenRLHFConfig", "load_cluster_config", "split_sections"]
