"""Started sandboxes kept ready for the next episodes, so a reset does not wait for a
container's boot.

A container's boot (create, start, the work tree's copy, the shell) costs about 0.3 s on an idle
machine and several seconds when a batch of episodes boots at once on a loaded one; almost all of
it is the engine's and the runtime's own work, which no lock of ours serialises. A
:class:`SandboxPool` moves that work off the episode's critical path: it keeps ``spares`` started
sandboxes per (image, config), hands one out at :meth:`~SandboxPool.acquire` and boots its
replacement in the background while the episode runs. Sandboxes that differ only in the limits
the host applies per call (:data:`HOST_SIDE`) share spares, so an episode's and its grading's
containers come from one supply. A pooled sandbox is fresh: no agent command
has run in it, and its episode budget starts when it is handed out. Boots run concurrently, each
in a thread of its own.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import TYPE_CHECKING

from crl_gym.envs.swebench.sandbox import DockerSandbox, SandboxConfig

if TYPE_CHECKING:
    from docker import DockerClient

log = logging.getLogger(__name__)


HOST_SIDE = ("command_timeout", "max_command_timeout", "episode_timeout", "max_output_chars")
"""Limits the host applies per call: sandboxes that differ only in these are interchangeable."""


def _key(image: str, config: SandboxConfig) -> str:
    fields = {k: v for k, v in config.__dict__.items() if k not in HOST_SIDE}
    return json.dumps([image, fields], sort_keys=True, default=str)


class SandboxPool:
    """Up to ``spares`` started sandboxes per (image, config), refilled in the background.

    ``refill=False``: no boot behind a hand-out; the caller fills the pool with :meth:`prewarm`
    when boots cost least, e.g. a trainer booting the next batch's containers during its update
    step, so that no boot competes with the episodes' tool calls.
    """

    def __init__(self, client: DockerClient, spares: int = 1, *, refill: bool = True) -> None:
        if spares < 0:
            raise ValueError(f"SandboxPool spares must be >= 0, got {spares}")
        self.client = client
        self.spares = spares
        self.refill = refill
        self._ready: dict[str, list[DockerSandbox]] = {}
        self._booting: dict[str, int] = {}
        self._cond = threading.Condition()
        self._closed = False
        self.stats = {"warm": 0, "cold": 0, "boot_failures": 0}
        self.boot_latencies: list[float] = []
        """Each boot's own duration (what a reset without the pool would wait), seconds."""

    def acquire(self, image: str, config: SandboxConfig) -> DockerSandbox:
        """A started sandbox: a ready one if the pool has it, else one booted now;
        refills behind."""
        key = _key(image, config)
        t0 = time.monotonic()
        with self._cond:
            if self._closed:
                raise RuntimeError("the sandbox pool is closed")
            ready = self._ready.get(key)
            sandbox = ready.pop() if ready else None
        if sandbox is None:
            sandbox = DockerSandbox(image, config, self.client).start()
            self.stats["cold"] += 1
            with self._cond:
                self.boot_latencies.append(sandbox.start_latency)
        else:
            self.stats["warm"] += 1
        sandbox.config = config  # the same container; the caller's per-call limits
        sandbox.started_at = time.monotonic()  # the episode's budget starts now
        sandbox.start_latency = sandbox.started_at - t0  # what the episode waited
        if self.refill:
            self._refill(image, config)
        return sandbox

    def prewarm(
        self,
        image: str,
        config: SandboxConfig,
        n: int | None = None,
        *,
        wait: bool = True,
        timeout: float = 600.0,
    ) -> int:
        """Boot sandboxes until ``n`` (default ``spares``) are ready or booting; with ``wait``,
        until ready."""
        key = _key(image, config)
        want = self.spares if n is None else n
        self._refill(image, config, want)
        if wait:
            deadline = time.monotonic() + timeout
            with self._cond:
                while (
                    len(self._ready.get(key, [])) < want
                    and self._booting.get(key, 0) > 0
                    and time.monotonic() < deadline
                ):
                    self._cond.wait(deadline - time.monotonic())
        with self._cond:
            return len(self._ready.get(key, []))

    def _refill(self, image: str, config: SandboxConfig, want: int | None = None) -> None:
        key = _key(image, config)
        target = self.spares if want is None else want
        with self._cond:
            if self._closed:
                return
            missing = target - len(self._ready.get(key, [])) - self._booting.get(key, 0)
            self._booting[key] = self._booting.get(key, 0) + max(0, missing)
        for _ in range(max(0, missing)):
            threading.Thread(
                target=self._boot, args=(image, config, key), name="crl-sandbox-pool", daemon=True
            ).start()

    def _boot(self, image: str, config: SandboxConfig, key: str) -> None:
        sandbox: DockerSandbox | None = None
        try:
            sandbox = DockerSandbox(image, config, self.client).start()
        except Exception as exc:  # counted; the next acquire boots one itself
            self.stats["boot_failures"] += 1
            log.warning("sandbox pool: a boot of %s failed: %s", image, exc)
        with self._cond:
            self._booting[key] -= 1
            if sandbox is not None:
                self.boot_latencies.append(sandbox.start_latency)
                if self._closed:
                    sandbox.close()
                else:
                    self._ready.setdefault(key, []).append(sandbox)
            self._cond.notify_all()

    def close(self) -> None:
        """Remove every ready sandbox; boots still running remove theirs when they finish."""
        with self._cond:
            self._closed = True
            ready = [sb for sbs in self._ready.values() for sb in sbs]
            self._ready.clear()
        for sandbox in ready:
            sandbox.close()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
