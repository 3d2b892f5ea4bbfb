"""The policy data contract: TokenSequence, TrainBatch, Generation, SamplingConfig, OptimConfig."""

from __future__ import annotations

import pytest
import torch

from crl_train.policy.base import Generation, OptimConfig, SamplingConfig, TokenSequence, TrainBatch


def _seq(prompt: list[int], resp: list[int], lps: list[float], allowed=None) -> TokenSequence:
    s = TokenSequence()
    s.append_context(prompt)
    s.append_generation(Generation(prompt_ids=prompt, token_ids=resp, logprobs=lps, text="", allowed=allowed))
    return s


def test_token_sequence_masks_and_constraints() -> None:
    s = _seq([1, 2], [3, 4], [-0.3, -0.4], allowed=[(3, 5), None])
    s.append_context([9])
    s.append_generation(Generation(prompt_ids=[], token_ids=[6], logprobs=[-0.6], text="", allowed=[(6,)]))
    assert s.input_ids == [1, 2, 3, 4, 9, 6]
    assert s.loss_mask == [0, 0, 1, 1, 0, 1]
    assert s.old_logprobs == [0.0, 0.0, -0.3, -0.4, 0.0, -0.6]
    assert s.constraints == {2: (3, 5), 5: (6,)}
    t = s.truncated_left(3)  # keeps positions 3..5
    assert t.input_ids == [4, 9, 6] and t.loss_mask == [1, 0, 1] and t.constraints == {2: (6,)}


def test_from_sequences_right_pads() -> None:
    a = _seq([1, 2], [3], [-0.5])
    b = _seq([1], [3, 4, 5], [-0.1, -0.2, -0.3], allowed=[(3,), (4,), (5,)])
    batch = TrainBatch.from_sequences([a, b], [1.0, -1.0], pad_token_id=0, group_ids=[0, 0],
                                      condition_ids=[0, 1], extra={"w": [0.5, 2.0]})
    assert batch.input_ids.tolist() == [[1, 2, 3, 0], [1, 3, 4, 5]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 0], [0, 1, 1, 1]]
    assert batch.old_logprobs[1].tolist() == pytest.approx([0.0, -0.1, -0.2, -0.3])
    assert batch.num_tokens == 4 and batch.batch_size == 2
    assert batch.constraints == [{}, {1: (3,), 2: (4,), 3: (5,)}]
    sub = batch.select(slice(1, 2))
    assert sub.input_ids.tolist() == [[1, 3, 4, 5]] and sub.extra["w"].tolist() == [2.0]
    assert sub.condition_ids.tolist() == [1] and sub.constraints == [{1: (3,), 2: (4,), 3: (5,)}]


def test_position_zero_is_never_trained() -> None:
    s = TokenSequence()
    s.append_generation(Generation(prompt_ids=[], token_ids=[7, 8], logprobs=[-1.0, -2.0], text=""))
    batch = TrainBatch.from_sequences([s], [1.0], pad_token_id=0)
    assert batch.loss_mask.tolist() == [[0.0, 1.0]]


def test_trainbatch_shape_errors_name_the_field() -> None:
    ids = torch.zeros(2, 3, dtype=torch.long)
    ok = dict(input_ids=ids, attention_mask=ids.clone(), loss_mask=torch.zeros(2, 3),
              old_logprobs=torch.zeros(2, 3), advantages=torch.zeros(2))
    TrainBatch(**ok)
    TrainBatch(**{**ok, "advantages": torch.zeros(2, 3)})  # per-token advantages
    with pytest.raises(ValueError, match="loss_mask"):
        TrainBatch(**{**ok, "loss_mask": torch.zeros(2, 4)})
    with pytest.raises(ValueError, match="advantages"):
        TrainBatch(**{**ok, "advantages": torch.zeros(3)})
    with pytest.raises(ValueError, match="condition_ids"):
        TrainBatch(**ok, condition_ids=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="extra\\['w'\\]"):
        TrainBatch(**ok, extra={"w": torch.zeros(5)})
    with pytest.raises(ValueError, match="empty sequence"):
        TrainBatch.from_sequences([TokenSequence()], [0.0], pad_token_id=0)


def test_generation_and_config_validation() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        Generation(prompt_ids=[], token_ids=[1, 2], logprobs=[0.0], text="")
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(TypeError, match="stop"):
        SamplingConfig(stop="</action>")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="micro_batch_size"):
        OptimConfig(micro_batch_size=0)
    with pytest.raises(ValueError, match="loss_scale"):
        OptimConfig(loss_scale="mean")  # type: ignore[arg-type]
    assert OptimConfig().lr == 1e-6  # the paper's default


def test_trimmed_drops_only_columns_no_row_uses() -> None:
    short, long = TokenSequence(), TokenSequence()
    short.append_context([5, 6])
    short.append_generation(Generation(prompt_ids=[5, 6], token_ids=[7], logprobs=[-0.5], text="a"))
    long.append_context([5, 6, 8])
    long.append_generation(Generation(prompt_ids=[5, 6, 8], token_ids=[9, 10], logprobs=[-0.1, -0.2], text="b"))
    batch = TrainBatch.from_sequences([short, long], [1.0, 2.0], pad_token_id=0,
                                      extra={"w": torch.tensor([0.5, 0.25]), "per_token": torch.ones(2, 5)})
    assert batch.input_ids.shape == (2, 5) and batch.trimmed() is batch  # the long row uses every column
    one = batch.select(torch.tensor([0])).trimmed()
    assert one.input_ids.tolist() == [[5, 6, 7]] and one.loss_mask.tolist() == [[0.0, 0.0, 1.0]]
    assert one.old_logprobs.tolist() == [[0.0, 0.0, -0.5]] and one.extra["per_token"].shape == (1, 3)
    assert one.extra["w"].tolist() == [0.5] and one.advantages.tolist() == [1.0]
    token_adv = TrainBatch(input_ids=batch.input_ids[:1], attention_mask=batch.attention_mask[:1],
                           loss_mask=batch.loss_mask[:1], old_logprobs=batch.old_logprobs[:1],
                           advantages=torch.arange(5.0)[None])
    assert token_adv.trimmed().advantages.tolist() == [[0.0, 1.0, 2.0]]
