"""ExtractorWorker: π_φ in a child process — same answers as in process, errors, crash, cleanup."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from _trainer_fixtures import TEXTS, manager

from crl_gym.clients import LocalClient
from crl_gym.experience.merge import MergePrompt
from crl_gym.experience.schemas import merge_schema, ops_schema
from crl_gym.protocol import (
    DistillationRequest,
    ExperienceRef,
    ExtractorSample,
    ReturnOp,
    Step,
    Trajectory,
)
from crl_train.config import ExtractorSettings, ModelConfig
from crl_train.extractor.model import BufferItem
from crl_train.extractor.worker import (
    TINY_ENTRY_CHARS,
    ExtractorError,
    ExtractorSpec,
    ExtractorUnavailable,
    ExtractorWorker,
    build_extractor,
)
from crl_train.policy.hf import HFPolicy
from crl_train.service.track import BackgroundTrack, Credit

SPEC = ExtractorSpec(
    ModelConfig(tiny_vocab_size=300, tiny_hidden=32, tiny_layers=1, tiny_heads=2, tiny_kv_heads=1, tiny_intermediate=64,
                lr=1e-3, micro_batch_size=4),
    texts=tuple(TEXTS), seed=1,
    settings=ExtractorSettings(max_new_tokens=40, max_context_tokens=1024, max_prompt_chars=600,
                               constrained=True, cooldown=0, max_entry_chars=TINY_ENTRY_CHARS),
)


def _request(success: bool) -> DistillationRequest:
    steps = [Step("cell 0", "east", 0.0), Step("cell 1", "west", 0.0)]
    return DistillationRequest(task="Walk east", trajectory=Trajectory(steps=steps), outcome=float(success),
                               success=success, experience=None, condition="free")


def _gone(pid: int, within: float = 30.0) -> bool:
    """True once ``pid`` no longer runs (reaped, or a zombie of a process that has exited)."""
    deadline = time.time() + within
    while time.time() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


# the module's worker is pinned to the last available core (the extractor's share on 2 cores)
WORKER_CPUS = (sorted(os.sched_getaffinity(0))[-1],) if hasattr(os, "sched_getaffinity") else None


@pytest.fixture(scope="module")
def worker() -> Any:
    w = ExtractorWorker(dataclasses.replace(SPEC, cpus=WORKER_CPUS))
    yield w
    w.close()
    assert not w.alive and not w.process.is_alive()


def test_model_work_runs_in_another_process(worker: ExtractorWorker) -> None:
    pid = worker.wait_ready()
    assert pid == worker.pid != os.getpid()
    (s,) = worker.generate(["Which advice?"], [["RETURN: nothing new", "ADD: walk east"]])
    assert s.response in ("RETURN: nothing new", "ADD: walk east")
    assert s.token_ids and len(s.logprobs) == len(s.token_ids) and all(lp <= 0 for lp in s.logprobs)
    assert s.extractor_version == 0 and s.prompt_token_ids
    # distillation: prompt building, generation under the ops schema and op parsing all happen in the child
    results = worker.distill([_request(True), _request(False)])
    assert len(results) == 2 and all(sample.token_ids and ops for sample, ops in results)
    for sample, ops in results:
        jsonschema.validate(json.loads(sample.response), ops_schema(set(), max_text=TINY_ENTRY_CHARS))
        assert not any(isinstance(op, ReturnOp) and op.malformed for op in ops)
    text, sample = worker.refine("what next?", ExperienceRef(3, "Walk east.", 0), "cell 0")
    assert sample is not None and text == json.loads(sample.response)["advice"] and 0 < len(text) <= TINY_ENTRY_CHARS
    # a merge window's labels cross the pipe with its prompt: the answer names only those
    (m,) = worker.merge_generate([MergePrompt("[E1] a\n[E2] b", ("E1", "E2"))])
    jsonschema.validate(json.loads(m.response), merge_schema(["E1", "E2"], TINY_ENTRY_CHARS))
    assert worker.count_tokens("east west") == worker.count_tokens("east west") > 0


@pytest.mark.skipif(WORKER_CPUS is None, reason="no CPU affinity on this platform")
def test_the_child_runs_on_its_own_cores(worker: ExtractorWorker) -> None:
    assert worker.affinity() == list(WORKER_CPUS or ())
    # this process keeps all its cores: only the child was pinned
    assert len(os.sched_getaffinity(0)) >= 1 and worker.pid != os.getpid()


def test_cispo_in_the_child_equals_cispo_in_process(worker: ExtractorWorker, tmp_path: Path) -> None:
    """Same spec, same samples, same counts → the worker's update, its saved weights and the bank's
    training counts are exactly what the in-process extractor produces."""
    torch.manual_seed(0)
    local = build_extractor(SPEC)  # same init seed, same tokenizer texts → same weights as the child's
    samples = local.generate(["p1", "p2", "p3"], [["RETURN: nothing new", "ADD: walk east"]] * 3)
    # constraints of these samples: the child needs them to recompute log-probs
    worker.set_state({**local.get_state(), "version": worker.version})
    mgr_w, mgr_l = manager(("a",)), manager(("a",))
    eid = mgr_w.bank.ids()[0]
    # rewards r̄ = (+1, −1, +1): Â = r̄ − mean = (2/3, −4/3, 2/3), weights w = 1 (never trained, cooldown 0)
    items = [BufferItem(samples[0], 1.0, eid, 0), BufferItem(samples[1], -1.0, None, 0), BufferItem(samples[2], 1.0, None, 0)]
    v0 = worker.version
    m_w = worker.update(items, mgr_w.bank, 1)
    m_l = local.update(items, mgr_l.bank, 1)
    assert m_w["skipped"] == m_l["skipped"] == 0.0 and worker.version == v0 + 1
    assert m_w["loss"] == pytest.approx(m_l["loss"], abs=1e-5) and m_w["weight_mean"] == pytest.approx(1.0)
    for mgr in (mgr_w, mgr_l):
        e = mgr.bank.get(eid)
        assert e is not None and e.train_count == 1 and e.last_trained_step == 1
        mgr.close()
    worker.save(tmp_path / "ext")
    saved = HFPolicy.from_checkpoint(tmp_path / "ext")
    for (name, p), q in zip(local.policy.model.named_parameters(), saved.model.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-5), name
    worker.load(tmp_path / "ext")  # and back: a checkpoint the worker wrote is one it can read


def test_a_failing_call_raises_with_the_child_traceback_and_the_worker_goes_on(worker: ExtractorWorker, tmp_path: Path) -> None:
    with pytest.raises(ExtractorError, match="FileNotFoundError"):
        worker.load(tmp_path / "no_such_checkpoint")
    assert worker.alive and worker.count_tokens("east") > 0


def test_an_interrupted_call_leaves_replies_paired(worker: ExtractorWorker) -> None:
    """Ctrl-C while waiting leaves the child's answer in the pipe; the next call must not get it."""
    real = worker._conn

    class Interrupting:
        def __init__(self) -> None:
            self.fired = False

        def poll(self, timeout: float) -> bool:
            if not self.fired:
                self.fired = True
                raise KeyboardInterrupt
            return bool(real.poll(timeout))

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    worker._conn = Interrupting()  # type: ignore[assignment]
    try:
        with pytest.raises(KeyboardInterrupt):
            worker.count_tokens("a b c d e f g h i j k")
        state = worker.get_state()  # would receive the stale [n_tokens] list if replies were not re-paired
    finally:
        worker._conn = real
    assert isinstance(state, dict) and "version" in state


def test_child_ignores_sigint(worker: ExtractorWorker) -> None:
    os.kill(worker.wait_ready(), signal.SIGINT)  # Ctrl-C reaches the whole process group
    time.sleep(0.3)
    assert worker.alive and worker.count_tokens("east") > 0


def test_a_dead_child_is_logged_counted_and_never_raises_in_the_track(caplog: pytest.LogCaptureFixture) -> None:
    w = ExtractorWorker(SPEC)
    mgr = manager(("entry one", "entry two"))
    track = BackgroundTrack(mgr, w, buffer_size=1, asynchronous=False)
    mgr.submit(_request(True))
    track.run_until_idle()
    assert track.stats.distilled == 1
    os.kill(w.wait_ready(), signal.SIGKILL)  # out of memory, segfault, …
    assert _gone(w.process.pid or 0)
    with caplog.at_level(logging.ERROR, logger="crl_train.extractor.worker"):
        for s in (True, False, True):
            mgr.submit(_request(s))
        sample = ExtractorSample(prompt="p", response="ADD: x", logprobs=[-0.5, -0.1], token_ids=[5, 2],
                                 prompt_token_ids=[7, 8], extractor_version=0)
        track.credit([Credit(0, 1.0, sample=sample)])
        track.request_merge(0)
        track.run_until_idle()  # sync mode: must not raise
    assert not w.alive and mgr.pending() == 0
    assert track.stats.skipped_distill == 3 and track.stats.skipped_updates == 1 and track.stats.skipped_merges == 1
    assert track.stats.distilled == 1 and track.stats.errors == 0
    died = [r for r in caplog.records if "extractor worker died" in r.getMessage()]
    assert len(died) == 1 and "exited with code -9" in died[0].getMessage()  # one clear line, not one per call
    with pytest.raises(ExtractorUnavailable):
        w.refine("q", ExperienceRef(1, "x", 0), "")
    # a refinement asked by a wrapper falls back to the raw entry (counted by the client), no crash
    mgr.refiner = w.refine
    assert LocalClient(mgr).ask("q", ExperienceRef(1, "raw entry", 0), "")[0] == "raw entry"
    assert "buffer" in track.state()  # checkpointing still works (without the extractor's state)
    w.close()
    mgr.close()


SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    from test_extractor_worker import SPEC
    from crl_train.extractor.worker import ExtractorWorker

    if __name__ == "__main__":
        w = ExtractorWorker(SPEC)
        print(w.wait_ready(), flush=True)
        if sys.argv[1] == "kill":
            os._exit(0)  # no atexit, no finalizers: like a SIGKILL of the trainer
        # "exit": a normal interpreter exit without close(): the atexit finalizer stops the child
""")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_the_child_never_outlives_the_trainer(how: str, tmp_path: Path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    child = int(proc.stdout.strip().splitlines()[-1])
    assert _gone(child), f"extractor process {child} still runs after its trainer ended ({how})"
