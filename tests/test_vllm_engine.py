"""The pure parts of the vLLM path, with stand-in objects (vLLM has no CPU wheel)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from crl_train.policy.base import SamplingConfig
from crl_train.policy.vllm_engine import (
    RequestSeeds,
    VLLMGenerator,
    WorkerExtension,
    _local_model,
    normalise_name,
    sampling_params_kwargs,
    to_generation,
    token_prompts,
    weight_chunks,
)


def test_sampling_params_kwargs() -> None:
    kw = sampling_params_kwargs(SamplingConfig(temperature=0.7, top_p=0.9, stop=("</action>",), seed=5), 64, [2])
    assert kw["temperature"] == 0.7 and kw["top_p"] == 0.9 and kw["max_tokens"] == 64
    assert kw["logprobs"] == 0 and kw["stop_token_ids"] == [2] and kw["stop"] == ["</action>"] and kw["seed"] == 5
    assert sampling_params_kwargs(SamplingConfig(greedy=True), 8)["temperature"] == 0.0
    assert "stop" not in sampling_params_kwargs(SamplingConfig(), 8)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sampling_params_kwargs(SamplingConfig(), 0)


def test_token_prompts() -> None:
    assert token_prompts([[1, 2], (3,)]) == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        token_prompts([[1], []])


def _output(ids: list[int], lps: list[dict[int, Any]] | None, reason: str = "stop") -> SimpleNamespace:
    comp = SimpleNamespace(token_ids=ids, logprobs=lps, text="go north", finish_reason=reason)
    return SimpleNamespace(request_id="r1", outputs=[comp])


def test_to_generation_reads_sampled_token_logprobs() -> None:
    lp = SimpleNamespace  # vLLM's Logprob has a .logprob field
    out = _output([5, 9, 2], [{5: lp(logprob=-0.5)}, {9: lp(logprob=-1.25), 4: lp(logprob=-0.1)}, {2: -0.01}])
    g = to_generation(out, [1, 2, 3])
    assert g.prompt_ids == [1, 2, 3] and g.token_ids == [5, 9, 2]
    assert g.logprobs == [-0.5, -1.25, -0.01] and g.text == "go north" and g.finish_reason == "stop"
    assert to_generation(_output([5], [{5: -0.2}], "length"), [1]).finish_reason == "length"
    assert to_generation(_output([5], [{5: -0.2}], "abort"), [1]).finish_reason == "stop"


def test_to_generation_bad_outputs() -> None:
    with pytest.raises(ValueError, match="no completion"):
        to_generation(SimpleNamespace(request_id="x", outputs=[]), [1])
    with pytest.raises(ValueError, match="SamplingParams.logprobs"):
        to_generation(_output([5, 6], None), [1])
    with pytest.raises(ValueError, match="token 6 at position 1"):
        to_generation(_output([5, 6], [{5: -0.1}, {7: -0.2}]), [1])


def test_weight_chunks_bound_size_and_normalise_names() -> None:
    named = [("module.a", torch.zeros(2)), ("_orig_mod.module.b", torch.zeros(2)), ("c", torch.zeros(8))]
    # float32: a, b = 8 bytes each, c = 32 bytes. Limit 16: [a, b], then c alone (bigger than the limit).
    chunks = list(weight_chunks(named, max_bytes=16))
    assert [[n for n, _ in c] for c in chunks] == [["a", "b"], ["c"]]
    p = torch.nn.Parameter(torch.ones(2))
    (chunk,) = list(weight_chunks([("w", p)]))
    assert not chunk[0][1].requires_grad and chunk[0][1].data_ptr() == p.data_ptr()  # no copy
    assert normalise_name("module._orig_mod.model.embed_tokens.weight") == "model.embed_tokens.weight"


class FakeModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2))
        self.loaded: list[str] = []

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            self.loaded.append(name)
            if name == "w":
                self.w.data.copy_(t)


def _llm_v1(model: FakeModel) -> SimpleNamespace:
    runner = SimpleNamespace(model=model)
    worker = SimpleNamespace(model_runner=runner)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(model_executor=SimpleNamespace(
        driver_worker=SimpleNamespace(worker=worker))))
    llm.resets = 0

    def reset_prefix_cache() -> None:
        llm.resets += 1

    llm.reset_prefix_cache = reset_prefix_cache
    return llm


def _generator(llm: Any) -> VLLMGenerator:
    gen = VLLMGenerator.__new__(VLLMGenerator)  # skip __init__: it needs vLLM and a GPU
    gen.llm, gen.sync_chunk_bytes, gen.syncs = llm, 8, 0
    gen.sampling, gen.device = SamplingConfig(), "cuda"
    gen.processed_logprobs = True
    return gen


def test_sync_weights_in_process() -> None:
    model = FakeModel()
    llm = _llm_v1(model)
    assert _local_model(llm) is model
    gen = _generator(llm)
    sent = gen.sync_weights([("module.w", torch.tensor([1.0, 2.0])), ("b", torch.ones(3))])
    assert sent == 2 and model.loaded == ["w", "b"] and model.w.tolist() == [1.0, 2.0]
    assert llm.resets == 1 and gen.syncs == 1


def test_sync_weights_over_collective_rpc() -> None:
    calls: list[tuple[str, Any]] = []
    llm = SimpleNamespace(collective_rpc=lambda method, args: calls.append((method, args)))
    assert _local_model(llm) is None
    gen = _generator(llm)
    assert gen.sync_weights([("a", torch.ones(2)), ("b", torch.ones(2)), ("c", torch.ones(2))]) == 3
    # 8-byte chunks: one float32 pair each.
    assert [m for m, _ in calls] == ["crl_load_weights"] * 3
    assert [a[0][0][0] for _, a in calls] == ["a", "b", "c"]
    # The worker side applies a chunk to its model.
    worker = WorkerExtension()
    model = FakeModel()
    worker.model_runner = SimpleNamespace(model=model)  # type: ignore[attr-defined]
    assert worker.crl_load_weights([("w", torch.tensor([3.0, 4.0]))]) == 1 and model.w.tolist() == [3.0, 4.0]


def test_sync_weights_on_cpu_reloads_all_at_once() -> None:
    received: list[dict[str, torch.Tensor]] = []
    model = FakeModel()
    worker = WorkerExtension()
    worker.model_runner = SimpleNamespace(  # type: ignore[attr-defined]
        reload_weights=lambda weights_iterator, is_checkpoint_format: received.append(dict(weights_iterator)))

    def rpc(method: str, args: tuple[str]) -> list[int]:
        assert method == "crl_reload_weights"
        return [getattr(worker, method)(*args)]  # the engine's worker reads the file

    llm = SimpleNamespace(collective_rpc=rpc, resets=0)
    llm.reset_prefix_cache = lambda: setattr(llm, "resets", llm.resets + 1)
    gen = _generator(llm)
    gen.device = "cpu"
    w = torch.arange(6.0).reshape(2, 3).t()  # not contiguous: safetensors needs contiguous tensors
    tied = torch.ones(2)
    assert gen.sync_weights([("module.a", w), ("b", tied), ("tied_b", tied)]) == 2  # safetensors refuses aliases
    (got,) = received  # one reload: vLLM processes a model's weights layer by layer
    assert sorted(got) == ["a", "b"] and torch.equal(got["a"], w) and model.loaded == []
    assert llm.resets == 1 and gen.syncs == 1


def test_request_seeds_follow_the_config_seed() -> None:
    seeds = RequestSeeds()
    first, again = seeds.draw(3, 4), seeds.draw(3, 4)
    assert len(set(first + again)) == 8  # every request its own seed, one stream per config seed
    assert RequestSeeds().draw(3, 8) == first + again  # and a run is reproducible
    assert seeds.draw(None, 2) == [None, None]


def test_logprobs_exact_flag() -> None:
    gen = _generator(SimpleNamespace())
    assert gen.logprobs_exact
    gen.sampling = SamplingConfig(top_p=0.9)
    assert not gen.logprobs_exact
    gen.sampling, gen.processed_logprobs = SamplingConfig(), False
    assert not gen.logprobs_exact


def test_constrained_requests_are_refused() -> None:
    with pytest.raises(ValueError, match="hf backend only"):
        _generator(SimpleNamespace()).generate([[1]], 4, allowed=[["north"]])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_missing_vllm_names_the_extra() -> None:
    with pytest.raises(ImportError, match=r"complementary-rl\[vllm\]"):
        VLLMGenerator("some/model", tokenizer=None)
