"""LoRA adapters for an :class:`~crl_train.policy.hf.HFPolicy`'s model, through peft.

Why peft: it is the maintained implementation transformers itself integrates with; its
``inject_adapter_in_model`` puts low-rank adapters into the model's linear layers **in place**,
so the model keeps its class, its ``forward`` signature (the KV-cache argument ``generate.py``
passes) and its output embeddings, and every path of the policy (sampling, log-prob recomputation,
EDGE's top-k support, ``train_objective``) runs on it unchanged. Only the adapters have
``requires_grad``: the AdamW the policy creates holds just them.

Dropout is 0 (not configurable): the policy's convention is that sampling and recomputation see
the same function, and adapter dropout in ``train`` mode would break it.

Three views of an adapted model's weights:

* :func:`base_state_dict` — the frozen base under its own names (what ``save_pretrained`` of an
  unadapted model writes): a checkpoint's ``model/`` directory, loadable by any HF loader;
* :func:`adapter_state_dict` — only the adapters (peft's names): a checkpoint's ``adapter/``;
* :func:`merged_state_dict` — base + scaling · B·A per adapted layer, under the base's names:
  what a vLLM engine gets (``VLLMGenerator.sync_weights``), since it serves merged weights.

>>> spec = LoraSpec(rank=4, alpha=8.0)
>>> spec.scaling, spec.enabled, LoraSpec(rank=0).enabled
(2.0, True, False)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from crl_gym.json_types import JSONDict

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ADAPTER_DIR = "adapter"
"""A LoRA checkpoint's adapter directory (beside ``model/``, which holds the base)."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_SPEC = "lora.json"
ADAPTER_NAME = "default"
DEFAULT_TARGETS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
"""Every projection of a Llama / Qwen2 block (SmolLM2 and the tiny model are both of these)."""


@dataclass(frozen=True)
class LoraSpec:
    """Rank, scale and target layers of the adapters; ``rank`` 0 = full fine-tuning
    (no adapters)."""

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"lora rank must be >= 0, got {self.rank}")
        if self.rank and not self.alpha > 0:
            raise ValueError(f"lora alpha must be > 0, got {self.alpha}")
        if self.rank and not self.targets:
            raise ValueError("lora targets must name at least one module")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """alpha / rank: peft's scale of B·A."""
        return self.alpha / self.rank if self.rank else 0.0

    def to_dict(self) -> JSONDict:
        d = asdict(self)
        d["targets"] = list(self.targets)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoraSpec:
        return cls(int(d["rank"]), float(d["alpha"]), tuple(str(t) for t in d["targets"]))


def _peft() -> ModuleType:
    try:
        import peft
    except ImportError as exc:
        raise ImportError(
            "LoRA (lora_rank > 0) needs peft: pip install peft==0.21.2 (make install does)"
        ) from exc
    return peft


def _lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def apply_lora(model: Any, spec: LoraSpec) -> Any:
    """Put ``spec``'s adapters into ``model`` in place (B = 0: the function is unchanged) and
    freeze everything else; returns ``model``. A target that matches no layer is an error."""
    if not spec.enabled:
        return model
    if is_lora(model):
        raise ValueError("apply_lora: the model already has adapters")
    peft = _peft()
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in spec.targets if t not in present]
    if missing:
        raise ValueError(
            f"lora targets {missing} name no module of {type(model).__name__} "
            f"(its linear layers include: {sorted(n for n in present if n.endswith('proj'))})"
        )
    config = peft.LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), lora_dropout=0.0
    )
    peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    model._crl_lora = spec  # read back by lora_spec(); peft keeps its config too, in another shape
    return model


def is_lora(model: torch.nn.Module) -> bool:
    """True when ``apply_lora`` put adapters into ``model``."""
    return lora_spec(model) is not None


def lora_spec(model: torch.nn.Module) -> LoraSpec | None:
    """The spec ``apply_lora`` gave ``model`` (None when it has no adapters)."""
    spec = getattr(model, "_crl_lora", None)
    return spec if isinstance(spec, LoraSpec) else None


def _base_name(name: str) -> str:
    return name.replace(".base_layer.", ".")


def base_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's tensors under its own names (adapters left out)."""
    return {_base_name(k): v for k, v in model.state_dict().items() if "lora_" not in k}


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapters' tensors (peft's names, adapter name removed)."""
    from peft import get_peft_model_state_dict

    return {
        k: v.detach().contiguous()
        for k, v in get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME).items()
    }


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Base + adapter deltas under the base's names, computed without touching the model."""
    out = base_state_dict(model)
    for name, layer in _lora_layers(model):
        if ADAPTER_NAME not in layer.lora_A:
            continue
        key = f"{name}.weight"
        out[key] = out[key] + layer.get_delta_weight(ADAPTER_NAME).to(out[key].dtype)
    return out


def named_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a generator serving ``model`` loads: its merged weights when it has adapters, else
    its state dict."""
    return list((merged_state_dict(model) if is_lora(model) else model.state_dict()).items())


def save_adapter(model: torch.nn.Module, directory: str | Path) -> None:
    """Write the adapters (safetensors) and their spec (JSON) into ``directory``."""
    from safetensors.torch import save_file

    spec = lora_spec(model)
    if spec is None:
        raise ValueError("save_adapter: the model has no adapters applied by apply_lora")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state_dict(model), str(d / ADAPTER_WEIGHTS))
    (d / ADAPTER_SPEC).write_text(json.dumps(spec.to_dict()), encoding="utf-8")


def read_adapter_spec(directory: str | Path) -> LoraSpec:
    path = Path(directory) / ADAPTER_SPEC
    try:
        return LoraSpec.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a LoRA spec ({type(exc).__name__}: {exc})") from exc


def load_adapter(
    model: torch.nn.Module, directory: str | Path, device: str | torch.device = "cpu"
) -> None:
    """Load ``save_adapter``'s tensors into ``model`` (which has the same spec
    applied), strictly."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(directory) / ADAPTER_WEIGHTS
    sd = load_file(str(path), device=str(device))
    expected = set(adapter_state_dict(model))
    if set(sd) != expected:
        extra, lacking = sorted(set(sd) - expected), sorted(expected - set(sd))
        raise ValueError(
            f"{path}: adapters do not match the model's (unexpected {extra[:3]}, missing "
            f"{lacking[:3]})"
        )
    result: Any = set_peft_model_state_dict(model, sd, adapter_name=ADAPTER_NAME)
    unexpected = [k for k in getattr(result, "unexpected_keys", ()) if "lora_" in k]
    if unexpected:
        raise ValueError(f"{path}: keys not in the model: {unexpected[:5]}")


class CheckpointView:
    """What a checkpoint writer's ``save_pretrained(dir/model)`` call writes for an adapted model:
    the base alone in ``model/`` (the HF layout any loader reads, as if the adapters were not there)
    and the adapters in the sibling ``adapter/``, both inside the writer's temporary directory, so
    the checkpoint stays atomic."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model

    def save_pretrained(self, directory: str | Path) -> None:
        self.model.save_pretrained(str(directory), state_dict=base_state_dict(self.model))
        save_adapter(self.model, Path(directory).parent / ADAPTER_DIR)


def checkpoint_adapter_spec(directory: str | Path) -> LoraSpec | None:
    """The LoRA spec of a policy checkpoint ``directory`` (None: a fully fine-tuned one)."""
    d = Path(directory) / ADAPTER_DIR
    return read_adapter_spec(d) if d.is_dir() else None


def load_checkpoint_weights(
    model: torch.nn.Module, directory: str | Path, device: str | torch.device
) -> None:
    """Load a LoRA checkpoint (``model/`` base, ``adapter/``) into an adapted ``model``, strictly:
    a base tensor the model lacks, or a base parameter the files lack (tied ``lm_head``
    excepted), is an error."""
    from safetensors.torch import load_file

    directory = Path(directory)
    files = sorted((directory / "model").glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{directory / 'model'} holds no *.safetensors weights: not a policy checkpoint"
        )
    spec = checkpoint_adapter_spec(directory)
    if spec is None or lora_spec(model) != spec:
        raise ValueError(
            f"{directory}: its adapters ({spec}) are not the model's ({lora_spec(model)})"
        )
    names = {_base_name(k): k for k in model.state_dict() if "lora_" not in k}
    found: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(str(f), device=str(device)).items():
            if k not in names:
                raise ValueError(f"{f}: key {k!r} is not in the model")
            found[names[k]] = v
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    lacking = [
        b for b, k in names.items() if k not in found and not (tied and b.startswith("lm_head"))
    ]
    if lacking:
        raise ValueError(f"{directory}: checkpoint lacks base parameters {lacking[:5]}")
    model.load_state_dict(found, strict=False)
    load_adapter(model, directory / ADAPTER_DIR, device)


__all__ = [
    "ADAPTER_DIR",
    "DEFAULT_TARGETS",
    "CheckpointView",
    "LoraSpec",
    "checkpoint_adapter_spec",
    "load_checkpoint_weights",
    "adapter_state_dict",
    "apply_lora",
    "base_state_dict",
    "is_lora",
    "load_adapter",
    "lora_spec",
    "merged_state_dict",
    "named_weights",
    "read_adapter_spec",
    "save_adapter",
]
