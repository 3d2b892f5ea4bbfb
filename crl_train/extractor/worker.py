"""The extractor's model work in its own process: :class:`ExtractorWorker`.

Why a process: the actor's primary loop and the background track both spend much of their time
in Python (per-token sampling loops of small models), so as two threads of one process they
take turns on the GIL. The worker owns π_φ (a :class:`~crl_train.extractor.Extractor` built in
the child from an :class:`ExtractorSpec`) and runs every piece of extractor model work there:
distillation (prompt building, generation, op parsing), search_and_ask refinement, merge
generation, CISPO updates, checkpoint save/load. The background track in the trainer process
keeps only the bank/manager work and, while the child computes, blocks on the pipe (which
releases the GIL for the actor).

Interface: the same methods as ``Extractor`` — ``distill``, ``refine`` (the manager's
``refiner``), ``merge_generate``, ``generate``, ``update(items, bank, step)`` (bank counts read
and written here, ``train`` in the child), ``save``/``load``, ``get_state``/``set_state``,
``count_tokens``, ``close`` and ``alive`` — so :class:`~crl_train.service.track.BackgroundTrack`
takes either. Calls are synchronous request/response over one ``multiprocessing`` pipe, serialised
by a lock (refinements from the rollout thread and the track's work queue up, as they did on
``Extractor.lock``).

Failures:

* a call that raises in the child → :class:`ExtractorError` (with the child's traceback) in the
  caller; the child keeps serving;
* the child dies (killed, out of memory, segfault) → one ERROR log line with its exit code, then
  :class:`ExtractorUnavailable` for every call; ``alive`` is False and the track counts the work
  it skips (the run goes on without extractor updates);
* cleanup: ``close()`` (graceful, then terminate, then kill), also run at interpreter exit and
  when the worker is garbage-collected. The child ignores SIGINT (Ctrl-C reaches the whole
  process group; the trainer handles it and still checkpoints π_φ through the worker) and exits
  by itself when the trainer's end of the pipe closes (trainer killed).

>>> from crl_train.config import ExtractorSettings, ModelConfig
>>> spec = ExtractorSpec(ModelConfig(tiny_vocab_size=300, tiny_hidden=32, tiny_layers=1),
...                      texts=("RETURN: nothing new", "ADD: walk east"), seed=1,
...                      settings=ExtractorSettings(max_new_tokens=8, max_context_tokens=256,
...                                                 constrained=True))
>>> w = ExtractorWorker(spec)
>>> [s.response for s in w.generate(["advice?"], [["ADD: walk east"]])]
['ADD: walk east']
>>> w.close(); w.alive
False
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import threading
import traceback
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from crl_gym.json_types import JSONDict
from crl_gym.protocol import DistillationRequest, ExperienceOp, ExperienceRef, ExtractorSample
from crl_train.config import ModelConfig
from crl_train.config.extractor import TINY_ENTRY_CHARS as TINY_ENTRY_CHARS  # its old home
from crl_train.config.extractor import ExtractorSettings
from crl_train.config.names import ModelKind
from crl_train.extractor.model import BufferItem, Extractor, cispo_update
from crl_train.extractor.oracle import OracleExtractor
from crl_train.policy.base import AllowedRow

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

    from crl_gym.experience.bank import ExperienceBank

log = logging.getLogger(__name__)


class ExtractorError(RuntimeError):
    """A call failed inside the worker (the child's traceback is in the message); the worker
    goes on."""


class ExtractorUnavailable(RuntimeError):
    """The worker process is gone; no extractor model work can run any more."""


@dataclass(frozen=True)
class ExtractorSpec:
    """Everything the child needs to build π_φ (picklable: it crosses the process boundary)."""

    model: ModelConfig
    """The extractor's model config (``tiny`` or an HF id / path)."""
    texts: tuple[str, ...] | None = None
    """Tokenizer training texts of the tiny preset (None when loading a checkpoint or a
    real model)."""
    seed: int = 0
    """Seed of the tiny model's init and of torch in the child."""
    checkpoint: str | None = None
    """A ``Policy.save`` directory to rebuild π_φ from (resume)."""
    settings: ExtractorSettings | None = None
    """The Extractor's settings; None: :meth:`ExtractorSettings.for_model` of ``model`` (its
    budgets and answer form, short entries for the tiny preset)."""
    options: dict[str, Any] | None = None
    """Deprecated (use ``settings``): the Extractor's keyword arguments, over the model's defaults;
    read into ``settings`` with a ``DeprecationWarning``."""
    num_threads: int = 1
    """torch intra-op threads of the child (its share of the cores)."""
    cpus: tuple[int, ...] | None = None
    """Cores the child is pinned to (``os.sched_setaffinity``, before torch starts threads); None =
    not pinned. See :func:`crl_train.policy.affinity.split_cpus`."""
    nice: int = 0
    """Added to the child's scheduling niceness: when cores are oversubscribed the actor's process
    runs first (the extractor is off the critical path; on free cores it changes nothing)."""

    def __post_init__(self) -> None:
        if self.options is not None:
            warnings.warn(
                "ExtractorSpec(options={...}) is deprecated: pass settings=ExtractorSettings(...)",
                DeprecationWarning,
                stacklevel=3,
            )
            base = self.settings or ExtractorSettings.for_model(self.model)
            object.__setattr__(self, "settings", replace(base, **self.options))
            object.__setattr__(self, "options", None)

    @property
    def extractor_settings(self) -> ExtractorSettings:
        """``settings``, or the model's defaults."""
        return self.settings or ExtractorSettings.for_model(self.model)


def extractor_options(spec: ExtractorSpec) -> dict[str, object]:
    """Deprecated: the Extractor's settings as keyword arguments; use
    ``spec.extractor_settings``."""
    warnings.warn(
        "extractor_options(spec) is deprecated: use spec.extractor_settings",
        DeprecationWarning,
        stacklevel=2,
    )
    return dataclasses.asdict(spec.extractor_settings)


def build_extractor(spec: ExtractorSpec) -> Extractor | OracleExtractor:
    """π_φ as the spec says (used in the child, and in process for
    ``experience.extractor_process=false``); the weightless oracle for ``model: oracle``."""
    if spec.model.kind is ModelKind.ORACLE:
        return OracleExtractor()
    from crl_train.policy.factory import build_policy

    policy = build_policy(
        spec.model,
        list(spec.texts) if spec.texts is not None else None,
        loss_scale="tokens",
        seed=spec.seed,
        checkpoint=Path(spec.checkpoint) if spec.checkpoint else None,
        role="extractor",
    )
    return Extractor(policy, spec.extractor_settings)


# ------------------------------------------------------------------------------------ the child


def _train(
    ext: Extractor, items: list[BufferItem], counts: list[int], lasts: list[int], step: int
) -> tuple[dict[str, float], int]:
    return ext.train(items, counts, lasts, step), ext.version


def _get_state(ext: Extractor | OracleExtractor) -> JSONDict:
    """The extractor's state and this process's generators (π_φ samples with them: a resume
    draws on)."""
    from crl_train.policy import rng_state

    return {**ext.get_state(), "rng": rng_state.capture()}


def _set_state(ext: Extractor | OracleExtractor, d: dict[str, Any]) -> None:
    from crl_train.policy import rng_state

    d = dict(d)
    rng = d.pop("rng", None)
    ext.set_state(d)
    if rng is not None:
        rng_state.restore(rng, "extractor.rng")


_HANDLERS: dict[str, Callable[..., object]] = {
    "distill": lambda ext, reqs: ext.distill(reqs),
    "refine": lambda ext, q, entry, ctx: ext.refine(q, entry, ctx),
    "reflect": lambda ext, category, failures, successes, n: ext.reflect(
        category, failures, successes, n
    ),
    "generate": lambda ext, prompts, allowed: ext.generate(prompts, allowed),
    "merge_generate": lambda ext, prompts: ext.merge_generate(prompts),
    "train": _train,
    "save": lambda ext, d: ext.save(d),
    "load": lambda ext, d: ext.load(d),
    "get_state": lambda ext: _get_state(ext),
    "set_state": lambda ext, d: _set_state(ext, d),
    "count_tokens": lambda ext, texts: [ext.count_tokens(t) for t in texts],
    "ping": lambda ext: os.getpid(),
    "affinity": lambda ext: (
        sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    ),
}


def _serve(conn: Connection, spec: ExtractorSpec) -> None:
    """Child main loop: build π_φ, then answer ``(op, args)`` with ``("ok", result)`` /
    ``("error", tb)``."""
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # Ctrl-C is the trainer's to handle (it checkpoints through us)
    from crl_train.policy.affinity import pin_process

    pin_process(spec.cpus)  # first: threads torch starts later inherit the extractor's cores
    import torch

    if spec.nice > 0:
        os.nice(spec.nice)
    torch.set_num_threads(max(1, spec.num_threads))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (forkserver inherits a started pool): harmless
        pass
    torch.manual_seed(spec.seed)
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s %(levelname)s [extractor worker] %(name)s: %(message)s",
    )
    try:
        ext = build_extractor(spec)
    except BaseException:  # noqa: BLE001 - reported to the trainer, which raises it with this traceback
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", os.getpid()))
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):  # the trainer is gone: nothing left to serve
            return
        if op == "close":
            conn.send(("ok", None))
            return
        try:
            reply: tuple[str, Any] = ("ok", _HANDLERS[op](ext, *args))
        except Exception:  # noqa: BLE001 - one failed call must not take π_φ down
            reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return
        except Exception:  # noqa: BLE001 - an unpicklable result: say so instead of hanging the caller
            conn.send(("error", traceback.format_exc()))


# ------------------------------------------------------------------------------------ the parent


def _shutdown(proc: BaseProcess, conn: Connection, timeout: float = 10.0) -> None:
    """Stop the child: ask, then terminate, then kill. Safe to call twice (atexit + close)."""
    if proc.is_alive():
        try:
            conn.send(("close", ()))
        except (OSError, ValueError):
            pass
        proc.join(timeout)
    if proc.is_alive():
        proc.terminate()
        proc.join(5.0)
    if proc.is_alive():
        proc.kill()
        proc.join(5.0)
    try:
        conn.close()
    except OSError:
        pass


class ExtractorWorker:
    """π_φ in a child process (see the module docstring).

    Args:
        spec: how the child builds π_φ.
        start_method: ``spawn`` (default; a fresh interpreter) or ``forkserver``.
        start_timeout: seconds to wait for the child to build π_φ (large models load slowly).
        poll_s: how often a waiting call checks that the child is still alive.
    """

    def __init__(
        self,
        spec: ExtractorSpec,
        *,
        start_method: str = "spawn",
        start_timeout: float = 1800.0,
        poll_s: float = 0.5,
    ) -> None:
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(
                "start_method must be 'spawn' or 'forkserver' (fork is unsafe with torch "
                f"threads), got {start_method!r}"
            )
        self.spec = spec
        self.start_timeout = start_timeout
        self.poll_s = poll_s
        self.version = 0
        """π_φ's version as of the last update / state call (the child holds the truth)."""
        self.trainable = spec.model.kind is not ModelKind.ORACLE
        """Whether the child's extractor has weights to train (the oracle has none)."""
        self._lock = threading.Lock()
        self._ready = False
        self._dead_reason: str | None = None
        self._stale = 0  # replies of calls interrupted by an exception (Ctrl-C) still in the pipe
        self._token_cache: dict[str, int] = {}
        ctx = mp.get_context(start_method)
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(  # type: ignore[attr-defined]
            target=_serve, args=(child, spec), name="crl-extractor", daemon=True
        )
        self.process.start()
        child.close()  # our copy of the child's end: without closing it a dead child gives no EOF
        self._finalizer = weakref.finalize(self, _shutdown, self.process, self._conn)
        # the child builds π_φ while the trainer builds the actor; the first call waits for it

    # ---------------------------------------------------------------- plumbing
    @property
    def alive(self) -> bool:
        """False once the child is gone (found dead here: logged like a failed call) or closed."""
        if self._dead_reason is None and not self.process.is_alive():
            self._mark_dead("liveness check")
        return self._dead_reason is None

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def _recv(self, op: str, timeout: float | None) -> object:
        waited = 0.0
        while not self._conn.poll(self.poll_s):
            waited += self.poll_s
            if not self.process.is_alive():
                self._die(op)
            if timeout is not None and waited >= timeout:
                self._die(op, f"no answer within {timeout:.0f} s")
        try:
            status, payload = self._conn.recv()
        except (EOFError, OSError):
            self._die(op)
        if status == "error":
            if op == "start":
                self._die(op, f"building the extractor failed:\n{payload}")
            raise ExtractorError(
                f"extractor worker: {op!r} failed in the worker process:\n{payload}"
            )
        return payload

    def _die(self, op: str, why: str | None = None) -> NoReturn:
        self._mark_dead(op, why)
        raise ExtractorUnavailable(f"extractor worker is gone ({self._dead_reason})")

    def _mark_dead(self, op: str, why: str | None = None) -> None:
        """Record the death once, with one ERROR line, and release what is left of the child."""
        if self._dead_reason is None:
            self.process.join(1.0)
            code = self.process.exitcode
            self._dead_reason = why or f"process {self.process.pid} exited with code {code}"
            if op == "start" and why is None:  # the classic spawn pitfall, named
                self._dead_reason += (
                    " before building the extractor; if the main script starts training at import "
                    "time, guard it with `if __name__ == '__main__':` (spawn re-imports it), or "
                    "set experience.extractor_process=false"
                )
            log.error(
                "extractor worker died during %r (%s): the run continues WITHOUT extractor model "
                "work — distillation, refinement, merges and CISPO updates are skipped and counted",
                op,
                self._dead_reason,
            )
            _shutdown(self.process, self._conn, timeout=1.0)

    def _call(self, op: str, *args: object) -> Any:
        with self._lock:
            if self._dead_reason is not None:
                raise ExtractorUnavailable(f"extractor worker is gone ({self._dead_reason})")
            if not self._ready:
                self._recv("start", self.start_timeout)
                self._ready = True
            while (
                self._stale
            ):  # a Ctrl-C left an answer in the pipe: read it so replies stay paired
                self._recv(op, None)
                self._stale -= 1
            try:
                self._conn.send((op, args))
            except (BrokenPipeError, OSError):
                self._die(op)
            try:
                return self._recv(op, None)
            except (ExtractorError, ExtractorUnavailable):
                raise
            except BaseException:
                self._stale += 1  # interrupted while the child still works on it
                raise

    def affinity(self) -> list[int] | None:
        """The cores the child may run on (None where the platform has no affinity)."""
        cpus: list[int] | None = self._call("affinity")
        return cpus

    def wait_ready(self) -> int:
        """Block until the child has built π_φ; returns its pid."""
        pid: int = self._call("ping")
        return pid

    # ---------------------------------------------------------------- extractor interface
    def generate(
        self, prompts: Sequence[str], allowed: Sequence[AllowedRow] | None = None
    ) -> list[ExtractorSample]:
        out: list[ExtractorSample] = self._call(
            "generate", list(prompts), None if allowed is None else list(allowed)
        )
        return out

    def distill(
        self, requests: Sequence[DistillationRequest]
    ) -> list[tuple[ExtractorSample, list[ExperienceOp]]]:
        out: list[tuple[ExtractorSample, list[ExperienceOp]]] = self._call(
            "distill", list(requests)
        )
        return out

    def refine(
        self, query: str, entry: ExperienceRef, context: str
    ) -> tuple[str, ExtractorSample | None]:
        out: tuple[str, ExtractorSample | None] = self._call("refine", query, entry, context)
        return out

    def reflect(
        self,
        category: str,
        failures: Sequence[DistillationRequest],
        successes: Sequence[DistillationRequest],
        max_entries: int = 3,
    ) -> tuple[ExtractorSample, list[ExperienceOp]]:
        out: tuple[ExtractorSample, list[ExperienceOp]] = self._call(
            "reflect", category, list(failures), list(successes), max_entries
        )
        return out

    def merge_generate(self, prompts: list[str]) -> list[ExtractorSample]:
        """``merge_bank``'s callback; each ``MergePrompt`` keeps its labels through the pipe
        (its schema's)."""
        out: list[ExtractorSample] = self._call("merge_generate", list(prompts))
        return out

    def train(
        self, items: Sequence[BufferItem], counts: Sequence[int], lasts: Sequence[int], step: int
    ) -> dict[str, float]:
        metrics, self.version = self._call("train", list(items), list(counts), list(lasts), step)
        return dict(metrics)

    def update(
        self, items: Sequence[BufferItem], bank: ExperienceBank, step: int
    ) -> dict[str, float]:
        """CISPO in the child; training counts read from and recorded in ``bank`` here."""
        return cispo_update(self.train, items, bank, step)

    def count_tokens(self, text: str) -> int:
        n = self._token_cache.get(text)
        if n is None:
            (n,) = self._call("count_tokens", [text])
            if len(self._token_cache) > 4096:
                self._token_cache.clear()
            self._token_cache[text] = n
        return n

    def save(self, directory: str | Path) -> None:
        self._call("save", str(directory))

    def load(self, directory: str | Path) -> None:
        self._call("load", str(directory))

    def get_state(self) -> JSONDict:
        state: dict[str, Any] = self._call("get_state")
        self.version = int(state.get("version", self.version))
        return state

    def set_state(self, d: dict[str, Any]) -> None:
        self._call("set_state", d)
        self.version = int(d.get("version", 0))

    def close(self, timeout: float = 30.0) -> None:
        """Stop the child (graceful, then terminate, then kill); idempotent.

        A call still running in another thread gets ``timeout`` s to finish; after that the child
        is terminated under it (that caller then sees :class:`ExtractorUnavailable`).
        """
        got = self._lock.acquire(timeout=timeout)
        try:
            if self._dead_reason is None:
                self._dead_reason = "closed"
            if not got:
                self.process.terminate()
            self._finalizer()
        finally:
            if got:
                self._lock.release()
