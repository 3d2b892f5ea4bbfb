"""A batch's common prompt prefix encoded once (``crl_train.policy.generate``, ``HFPolicy.share_prefix``).

Sharing must change nothing but the work done: the same greedy tokens, the same recorded per-token
log-probs (the extractor's CISPO weighs by them, so they must be the sampling distribution's), the
same grammar masks and the same kept keys/values, for prompts that share a prefix and end in
suffixes of different lengths.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from crl_gym.experience.schemas import max_answer_chars, ops_schema  # noqa: E402
from crl_train.policy.base import Generation, SamplingConfig, TokenSequence, TrainBatch  # noqa: E402
from crl_train.policy.generate import shared_prefix_len  # noqa: E402
from crl_train.policy.grammar import JsonGrammar  # noqa: E402
from crl_train.policy.hf import SHARE_PREFIX_TOKENS, HFPolicy  # noqa: E402
from crl_train.policy.tiny import train_tiny_tokenizer  # noqa: E402

INSTRUCTIONS = ("You read an episode and write advice for the next one. Answer with JSON ops only: "
                "add an entry, update one, or return when the episode teaches nothing. ")
SUFFIXES = ["Episode: east. Won.", "Episode: west, then a wall. Lost after a long and winding walk.", "x",
            "Episode: north north north. Lost."]


def test_shared_prefix_len_by_hand() -> None:
    # common prefix [1, 2, 3]; the shortest prompt (3 tokens) caps it at 2 so it keeps a token of its own
    assert shared_prefix_len([[1, 2, 3, 4], [1, 2, 3, 9, 9], [1, 2, 3]], min_tokens=1) == 2
    assert shared_prefix_len([[1, 2, 3, 4], [1, 2, 3, 9, 9]], min_tokens=3) == 3
    assert shared_prefix_len([[1, 2, 3, 4], [1, 2, 3, 9, 9]], min_tokens=4) == 0  # too short to share
    assert shared_prefix_len([[5, 6, 7], [5, 6, 7]], min_tokens=1) == 2  # identical prompts: all but the last token
    assert shared_prefix_len([[1, 2, 3, 4]], min_tokens=1) == 0  # one prompt: nothing to share
    assert shared_prefix_len([[1, 2], [1, 2, 3]], min_tokens=0) == 0  # 0 = off
    assert shared_prefix_len([[1, 2, 3], [2, 2, 3]], min_tokens=1) == 0


def _llama_policy(seed: int = 0) -> HFPolicy:
    """A tiny random-initialised Llama (the architecture SmolLM2 has) with a byte-level tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = train_tiny_tokenizer([INSTRUCTIONS, *SUFFIXES, '{"op":"add","text":"return"}'], vocab_size=400)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return HFPolicy(model, tok, name="tiny-llama (random)", sampling=SamplingConfig(temperature=0.7, seed=0))


@pytest.fixture(scope="module")
def llama() -> HFPolicy:
    return _llama_policy()


def _prompts(policy: HFPolicy) -> list[list[int]]:
    return [policy.apply_chat([{"role": "user", "content": INSTRUCTIONS + s}]) for s in SUFFIXES]


class _Fed:
    """Records the shape of every ``input_ids`` the model is called with."""

    def __init__(self, policy: HFPolicy) -> None:
        self.policy, self.shapes = policy, []
        self._forward = policy.model.forward

    def __enter__(self) -> _Fed:
        @functools.wraps(self._forward)  # keeps the signature generate.py reads its cache argument from
        def spy(*a: Any, **kw: Any) -> Any:
            self.shapes.append(tuple(kw["input_ids"].shape))
            return self._forward(*a, **kw)
        self.policy.model.forward = spy  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.policy.model.forward = self._forward  # type: ignore[method-assign]


def _both(policy: HFPolicy, prompts: list[list[int]], new: int, **kw: Any) -> Iterator[tuple[list[Generation], _Fed]]:
    """Generations without, then with, prefix sharing (each from a fresh seeded RNG stream)."""
    for share in (0, SHARE_PREFIX_TOKENS):
        policy.share_prefix = share
        policy._generators.clear()
        with _Fed(policy) as fed:
            gens = policy.generate(prompts, new, **kw)
        yield gens, fed
    policy.share_prefix = SHARE_PREFIX_TOKENS


def _assert_same(plain: list[Generation], shared: list[Generation]) -> None:
    for x, y in zip(plain, shared, strict=True):
        assert x.token_ids == y.token_ids and x.text == y.text and x.finish_reason == y.finish_reason
        assert x.allowed == y.allowed
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)


def test_sharing_encodes_the_prefix_once_and_changes_nothing(llama: HFPolicy) -> None:
    prompts = _prompts(llama)
    n = shared_prefix_len(prompts, 1)
    lengths = [len(p) for p in prompts]
    assert n >= 20 and len(set(lengths)) == len(lengths)  # a real prefix, and suffixes of four lengths
    greedy = SamplingConfig(temperature=0.7, greedy=True)
    (plain, fed_plain), (shared, fed_shared) = _both(llama, prompts, 12, sampling=greedy)
    _assert_same(plain, shared)
    assert fed_plain.shapes[0] == (4, max(lengths))  # every prompt left-padded in full
    # the prefix once at batch 1, then only the suffixes (left-padded after it)
    assert fed_shared.shapes[:2] == [(1, n), (4, max(lengths) - n)]


def test_sampled_logprobs_are_the_ones_training_recomputes(llama: HFPolicy) -> None:
    """Sampling (temperature 0.7, seeded): the same draws with and without sharing, and each recorded
    log-prob equals the training path's recomputation over the whole sequence (what CISPO uses)."""
    prompts = _prompts(llama)
    (plain, _), (shared, _) = _both(llama, prompts, 10)
    _assert_same(plain, shared)
    seqs = []
    for p, g in zip(prompts, shared, strict=True):
        s = TokenSequence()
        s.append_context(p)
        s.append_generation(g)
        seqs.append(s)
    batch = TrainBatch.from_sequences(seqs, [1.0, -1.0, 0.5, 0.0], llama.pad_token_id)
    mask = batch.loss_mask.bool()
    assert torch.allclose(llama.logprobs(batch)[mask], batch.old_logprobs[mask], atol=1e-4, rtol=0)


def test_grammar_rows_and_free_rows_share_a_prefix(llama: HFPolicy) -> None:
    prompts = _prompts(llama)
    grammar = JsonGrammar.from_schema(ops_schema((), max_ops=2, max_text=24))
    rows: list[Any] = [grammar, None, grammar, None]
    greedy = SamplingConfig(temperature=0.7, greedy=True)
    (plain, _), (shared, _) = _both(llama, prompts, 40, allowed=rows, sampling=greedy)
    _assert_same(plain, shared)
    for g, a in zip(shared, rows, strict=True):
        assert (g.allowed is not None) == (a is not None)
    assert any(a is not None for a in shared[0].allowed or [])  # the grammar masked its tokens
    # the masks recorded are the grammar's own: replaying it over the tokens gives them back
    assert shared[0].allowed == llama.replay_allowed(grammar, shared[0].token_ids)


def test_kept_keys_values_are_the_same_with_a_shared_prefix() -> None:
    """The actor's prefix cache (``keep_kv``) after a shared-prefix first turn holds the same keys/values."""
    policy = _llama_policy()
    policy.prefix_cache = True
    prompts = _prompts(policy)
    greedy = SamplingConfig(temperature=0.7, greedy=True)
    kept = []
    for share in (0, SHARE_PREFIX_TOKENS):
        policy.share_prefix = share
        policy.release_cache()
        gens = policy.generate(prompts, 6, sampling=greedy, cache_keys=list(range(4)))
        kept.append((gens, dict(policy._kv)))
    (g0, kv0), (g1, kv1) = kept
    _assert_same(g0, g1)
    for key in range(4):
        assert kv0[key].ids == kv1[key].ids == tuple(prompts[key]) + tuple(g1[key].token_ids[:-1])
        for (k0, v0), (k1, v1) in zip(kv0[key].layers, kv1[key].layers, strict=True):
            assert k0.shape == k1.shape and torch.allclose(k0, k1, atol=1e-5) and torch.allclose(v0, v1, atol=1e-5)


def test_no_sharing_below_the_threshold(llama: HFPolicy) -> None:
    short = [llama.tokenizer.encode("ab"), llama.tokenizer.encode("ab cd")]
    greedy = SamplingConfig(temperature=0.7, greedy=True)
    with _Fed(llama) as fed:
        llama.generate(short, 2, sampling=greedy)
    assert fed.shapes[0][0] == 2  # a 1-token common prefix is not worth its own pass


@pytest.mark.slow
def test_the_packaged_smollm2_gives_the_same_answers_with_a_shared_prefix() -> None:
    """SmolLM2's real chat template (its system part) and a distillation-like instruction, free and
    grammar rows: the same greedy tokens and log-probs within 1e-4 in float32. In bf16 the shared
    pass rounds apart (up to 0.07 in a log-prob on a CPU with AMX), which is why a 16-bit policy
    recomputes π_old (``Policy.sampled_logprobs_exact``)."""
    from crl_train.policy.packaged import resolve_model

    policy = HFPolicy.from_pretrained(resolve_model("smollm2-135m"), dtype="float32",
                                      sampling=SamplingConfig(temperature=0.7))
    prompts = [policy.apply_chat([{"role": "user", "content": INSTRUCTIONS + s}]) for s in SUFFIXES[:3]]
    assert shared_prefix_len(prompts, 1) >= 40
    grammar = JsonGrammar.from_schema(ops_schema((), max_ops=1, max_text=40))
    greedy = SamplingConfig(temperature=0.7, greedy=True)
    (plain, _), (shared, _) = _both(policy, prompts, 10, allowed=[grammar, None, grammar], sampling=greedy)
    _assert_same(plain, shared)


def test_the_config_switch_turns_sharing_off() -> None:
    from crl_train.config import ModelConfig
    from crl_train.policy.factory import build_policy

    texts = [INSTRUCTIONS, *SUFFIXES]
    on = build_policy(ModelConfig(model="tiny", tiny_vocab_size=300), texts, loss_scale="tokens", seed=0, checkpoint=None)
    off = build_policy(ModelConfig(model="tiny", tiny_vocab_size=300, share_prefix=False), texts, loss_scale="tokens",
                       seed=0, checkpoint=None)
    assert isinstance(on, HFPolicy) and isinstance(off, HFPolicy)
    assert (on.share_prefix, off.share_prefix) == (SHARE_PREFIX_TOKENS, 0)


def test_stopped_rows_leave_the_batch_and_each_row_is_what_it_would_be_alone(llama: HFPolicy) -> None:
    """Grammar rows close their JSON and stop while free rows run to the budget: the batch shrinks
    (later steps feed only the rows still writing), and every row's tokens and log-probs are those
    of the same prompt generated on its own."""
    prompts = _prompts(llama)
    schema = ops_schema((), max_ops=1, max_text=4)
    grammar = JsonGrammar.from_schema(schema)
    rows: list[Any] = [grammar, None, grammar, None]
    greedy = SamplingConfig(temperature=0.7, greedy=True)
    new = max_answer_chars(schema) + 8  # a token is at least a character: the grammar rows stop before the end
    llama.prefix_cache = True  # each row's keys/values are kept as it leaves the batch
    try:
        with _Fed(llama) as fed:
            batched = llama.generate(prompts, new, allowed=rows, sampling=greedy, cache_keys=list(range(4)))
        kv = dict(llama._kv)
        assert [g.finish_reason for g in batched] == ["stop", "length", "stop", "length"]
        steps = [shape[0] for shape in fed.shapes[2:]]  # after the shared prefix and the suffixes' prefill
        assert steps == sorted(steps, reverse=True) and steps[0] == 4 and steps[-1] == 2
        # the budget's last token is never fed: prefix + prefill + (new - 1) decoding steps
        assert len(fed.shapes) == 2 + new - 1
        for key, (p, a, g) in enumerate(zip(prompts, rows, batched, strict=True)):
            llama.release_cache()
            (alone,) = llama.generate([p], new, allowed=[a], sampling=greedy, cache_keys=["alone"])
            _assert_same([alone], [g])
            assert kv[key].ids == llama._kv["alone"].ids == tuple(p) + tuple(g.token_ids[:-1])
            for (k0, v0), (k1, v1) in zip(kv[key].layers, llama._kv["alone"].layers, strict=True):
                assert torch.allclose(k0, k1, atol=1e-5) and torch.allclose(v0, v1, atol=1e-5)
    finally:
        llama.prefix_cache = False
        llama.release_cache()
