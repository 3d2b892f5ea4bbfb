"""Tests of crl_train.policy.checkpoint: atomic checkpoint files, strict weight loading, dtypes."""

from __future__ import annotations

import doctest
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import crl_train.policy.checkpoint as checkpoint  # noqa: E402
from crl_train.policy.checkpoint import (  # noqa: E402
    MANIFEST_FILE,
    MODEL_DIR,
    STATE_FILE,
    CheckpointError,
    load_weights,
    read_state,
    resolve_dtype,
    verify_checkpoint,
    write_checkpoint,
)


class _Model(torch.nn.Module):
    """Just enough of a HF model: ``save_pretrained`` (safetensors) and ``config``."""

    def __init__(self, fill: float, extra: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        torch.nn.init.constant_(self.lin.weight, fill)
        if extra:
            self.more = torch.nn.Linear(2, 1)
        self.config = type("Cfg", (), {"tie_word_embeddings": False})()

    def save_pretrained(self, path: Path) -> None:
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(path / "model.safetensors"))


class _Tokenizer:
    def save_pretrained(self, path: Path) -> None:
        (path / "tokenizer.json").write_text("{}")


def test_round_trip_replaces_the_previous_checkpoint(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    write_checkpoint(d, _Model(1.0), _Tokenizer(), {"step": 1})
    write_checkpoint(d, _Model(2.0), _Tokenizer(), {"step": 2})
    assert read_state(d) == {"step": 2}
    model = _Model(0.0)
    load_weights(model, d, "cpu")
    assert torch.equal(model.lin.weight, torch.full((2, 2), 2.0))
    # no temporary or .old directory is left next to it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_failed_save_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    write_checkpoint(d, _Model(1.0), _Tokenizer(), {"step": 1})

    class Broken(_Tokenizer):
        def save_pretrained(self, path: Path) -> None:
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(d, _Model(5.0), Broken(), {"step": 5})
    assert read_state(d) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=STATE_FILE):
        read_state(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a policy checkpoint"):
        load_weights(_Model(0.0), tmp_path, "cpu")
    write_checkpoint(tmp_path / "small", _Model(1.0), _Tokenizer(), {})
    with pytest.raises(ValueError, match="lacks parameters.*more"):
        load_weights(_Model(0.0, extra=True), tmp_path / "small", "cpu")
    write_checkpoint(tmp_path / "big", _Model(1.0, extra=True), _Tokenizer(), {})
    with pytest.raises(ValueError, match=r"model\.safetensors: keys not in the model"):
        load_weights(_Model(0.0), tmp_path / "big", "cpu")
    assert (tmp_path / "big" / MODEL_DIR / "tokenizer.json").exists()


def test_resolve_dtype_rejects_unknown_names() -> None:
    assert resolve_dtype(torch.float16, "cuda") is torch.float16
    with pytest.raises(ValueError, match="float99"):
        resolve_dtype("float99", "cpu")
    with pytest.raises(ValueError):
        resolve_dtype("Tensor", "cpu")  # a torch attribute that is not a dtype


def test_docstring_examples_run() -> None:
    result: Any = doctest.testmod(checkpoint)
    assert result.attempted > 0 and result.failed == 0


_STATE = {"step": 3, "name": "tiny", "sampling": {}, "optim": {}, "chat_kwargs": {}, "optimizer": None}


def _cut(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("damage", ["truncate", "garbage", "delete"])
def test_a_damaged_state_file_names_the_file(tmp_path: Path, damage: str) -> None:
    d = tmp_path / "ckpt"
    write_checkpoint(d, _Model(1.0), _Tokenizer(), dict(_STATE))
    f = d / STATE_FILE
    if damage == "truncate":
        _cut(f)
    elif damage == "garbage":
        f.write_bytes(b"\x00 not a torch file " * 50)
    else:
        f.unlink()
    with pytest.raises((ValueError, FileNotFoundError), match=rf"{STATE_FILE}"):
        read_state(d)
    with pytest.raises(CheckpointError, match=rf"ckpt/{STATE_FILE}"):
        verify_checkpoint(d)


def test_truncated_weights_name_the_file_before_anything_loads_them(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    write_checkpoint(d, _Model(1.0), _Tokenizer(), dict(_STATE))
    verify_checkpoint(d)  # a whole checkpoint passes
    weights = d / MODEL_DIR / "model.safetensors"
    _cut(weights, 0.9)
    with pytest.raises(CheckpointError, match=r"model/model.safetensors: .* bytes, but .* were written"):
        verify_checkpoint(d)
    with pytest.raises(CheckpointError, match=r"model/model.safetensors: unreadable weights"):
        load_weights(_Model(0.0), d, "cpu")
    (d / MANIFEST_FILE).unlink()  # a checkpoint of an older version: the header still tells
    with pytest.raises(CheckpointError, match=r"model/model.safetensors: truncated"):
        verify_checkpoint(d)


def test_verify_names_a_missing_file_and_missing_state_keys(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    write_checkpoint(d, _Model(1.0), _Tokenizer(), {"step": 1})
    with pytest.raises(CheckpointError, match=rf"{STATE_FILE}: lacks name, sampling, optim, chat_kwargs"):
        verify_checkpoint(d)
    write_checkpoint(d, _Model(1.0), _Tokenizer(), dict(_STATE))
    (d / MODEL_DIR / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"model/tokenizer.json is missing \(listed in files.json\)"):
        verify_checkpoint(d)
    with pytest.raises(CheckpointError, match="nowhere is missing"):
        verify_checkpoint(tmp_path / "nowhere")
