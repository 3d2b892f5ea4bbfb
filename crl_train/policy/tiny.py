"""The tiny preset: a random-initialised small Qwen2-architecture model and an on-the-fly tokenizer.

Nothing here is pretrained. The tokenizer is a byte-level BPE trained in a fraction of a second on
texts gathered from the environments (observations, task texts, action names), wrapped as a
``PreTrainedTokenizerFast`` with ChatML special tokens and chat template (the format Qwen uses), so
the same code path serves the tiny preset and real Qwen models. The model is ``Qwen2ForCausalLM``
from a small ``Qwen2Config`` with random weights; it is called :data:`TINY_MODEL_NAME` everywhere.

>>> tok = train_tiny_tokenizer(["go north", "go south", "You see a door."], vocab_size=300)
>>> tok.decode(tok.encode("go north", add_special_tokens=False))
'go north'
>>> model = build_tiny_model(tok, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
>>> type(model).__name__, model.config.vocab_size == len(tok)
('Qwen2ForCausalLM', True)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from crl_gym.json_types import EnvInfo

from .base import OptimConfig, SamplingConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    from .hf import HFPolicy

log = logging.getLogger(__name__)

TINY_MODEL_NAME = "tiny-random-qwen2 (random init, not a pretrained model)"
"""The name the tiny preset carries in logs, metrics, checkpoints and plots."""

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"

# ChatML, as Qwen renders it (without Qwen's default system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Role names and template glue, so they get merged tokens too.
_TEMPLATE_TEXTS = ("system\n", "user\n", "assistant\n", "<action>", "</action>", "search_and_ask[")


def train_tiny_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` and wrap it with ChatML special tokens and template.

    Byte-level means every string round-trips exactly, including characters never seen in
    ``texts``. ``vocab_size`` counts the 256 byte symbols and the 3 special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [t for t in texts if isinstance(t, str) and t]
    if not texts:
        raise ValueError("train_tiny_tokenizer needs at least one non-empty text")
    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(
            f"train_tiny_tokenizer: vocab_size must be >= {minimum} (bytes + specials), got "
            f"{vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*texts, *_TEMPLATE_TEXTS], trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        padding_side="left",
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.name_or_path = TINY_MODEL_NAME
    return wrapped


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    max_positions: int = 4096,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """A random-initialised ``Qwen2ForCausalLM`` sized for ``tokenizer`` (seeded, float32)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if hidden % heads:
        raise ValueError(
            f"build_tiny_model: hidden ({hidden}) must be divisible by heads ({heads})"
        )
    if heads % kv_heads:
        raise ValueError(
            f"build_tiny_model: heads ({heads}) must be divisible by kv_heads ({kv_heads})"
        )
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # Seed a private generator's worth of state without disturbing the caller's RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.config.name_or_path = TINY_MODEL_NAME
    return model


def gather_env_texts(
    envs: Iterable[Any],
    actions: Sequence[str],
    *,
    seeds: Sequence[int] = (0, 1, 2),
    steps: int = 3,
) -> list[str]:
    """Observations, task texts and action names from a few resets/steps of ``envs``.

    Each env is reset with every seed and stepped ``steps`` times, cycling through its
    ``info["admissible_actions"]`` when it gives them, else ``actions``. An env that raises is
    logged and skipped (the texts gathered so far are kept): the tokenizer still trains.
    """
    texts: list[str] = [str(a) for a in actions]
    failures = 0
    for env in envs:
        for seed in seeds:
            try:
                obs, info = env.reset(seed=seed)
                texts.extend(_info_texts(obs, info))
                for i in range(steps):
                    valid = list(info.get("admissible_actions") or actions)
                    if not valid:
                        break
                    obs, _, terminated, truncated, info = env.step(valid[i % len(valid)])
                    texts.extend(_info_texts(obs, info))
                    if terminated or truncated:
                        break
            except Exception as exc:  # an env bug must not stop the preset from building
                failures += 1
                log.warning("gather_env_texts: %r failed with seed %s: %s", env, seed, exc)
    if failures:
        log.warning("gather_env_texts: %d env resets/steps failed", failures)
    return texts


def _info_texts(obs: object, info: EnvInfo) -> list[str]:
    out = [str(obs)]
    if info.get("task"):
        out.append(str(info["task"]))
    out.extend(str(a) for a in info.get("admissible_actions") or [])
    return out


def build_tiny_policy(
    texts: Iterable[str],
    *,
    vocab_size: int = 512,
    device: str = "cpu",
    sampling: SamplingConfig | None = None,
    optim: OptimConfig | None = None,
    seed: int = 0,
    **model_kw: int,
) -> HFPolicy:
    """Tokenizer + random model + :class:`HFPolicy`, named :data:`TINY_MODEL_NAME`."""
    from .hf import HFPolicy

    tokenizer = train_tiny_tokenizer(texts, vocab_size=vocab_size)
    model = build_tiny_model(tokenizer, seed=seed, **model_kw)
    return HFPolicy(
        model,
        tokenizer,
        name=TINY_MODEL_NAME,
        device=device,
        sampling=sampling or SamplingConfig(),
        optim=optim or OptimConfig(),
    )
