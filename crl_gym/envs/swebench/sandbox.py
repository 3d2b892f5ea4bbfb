"""A locked-down Docker container per episode, driven through the ``docker`` SDK.

Hardening (all in :meth:`DockerSandbox.start`): no network (``network_mode="none"``), memory,
CPU and pids limits, a non-root user, all capabilities dropped except the few the root-side
house-keeping needs (the agent's uid has none), ``no-new-privileges``, no host mounts (files
travel with ``put_archive``), and a wall-clock limit per command and per episode. Every
container carries the label ``crl.sandbox=1`` plus its owner (``host:pid``) and is removed on
:meth:`close`, when :meth:`start` fails, and by :func:`reap` (run once per process at the first
start) when its owner process is gone.

A command runs as ``timeout -k 2 T bash -c CMD`` inside the container with its output sent to
a size-capped file, so a hang, a flood of output or a fork bomb ends at its limit; if even that
fails, the host-side deadline kills the agent's processes and, as the last resort, restarts the
container (its files survive, so the episode can go on).

The engine client and reaping live in :mod:`~crl_gym.envs.swebench.docker_engine`, the editor's
file system in :mod:`~crl_gym.envs.swebench.container_fs`; both are re-exported here.
"""

from __future__ import annotations

import io
import logging
import os
import tarfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

# The engine helpers and ContainerFS are re-exported: callers import them from here.
from crl_gym.envs.swebench.container_fs import ContainerFS
from crl_gym.envs.swebench.docker_engine import (
    HOW_TO_START,
    LABEL,
    OWNER_LABEL,
    DockerUnavailableError,
    docker_client,
    owner_id,
    reap,
    reap_once,
)
from crl_gym.envs.swebench.tools import truncate_output

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class EpisodeTimeoutError(RuntimeError):
    """The episode's wall-clock budget is spent."""


@dataclass
class SandboxConfig:
    """Limits of one episode's container."""

    mem_limit: str = "2g"
    """Memory (and memory+swap) limit, Docker syntax."""
    cpus: float = 1.0
    """CPU quota in cores."""
    pids_limit: int = 256
    """Maximum number of processes; what stops a fork bomb."""
    user: str = "1000:1000"
    """uid:gid the agent's commands run as (never root)."""
    keeper_user: str = "65534:65534"
    """uid:gid of the container's idle main process: another non-root uid, so that killing every
    process of the agent's uid (the last-resort clean-up) leaves the container running."""
    chown_workdir: bool = False
    """chown the work tree to ``user`` at start (images whose repository belongs to root)."""
    workdir: str = "/testbed"
    """The repository inside the container; the editor refuses paths outside it."""
    command_timeout: float = 60.0
    """Default wall-clock limit of one ``execute_bash`` command, seconds."""
    max_command_timeout: float = 600.0
    """Cap on a timeout the agent asks for."""
    episode_timeout: float = 3600.0
    """Wall-clock budget of a whole episode, seconds."""
    max_output_chars: int = 10_000
    """Characters of a command's output shown to the agent (head + tail)."""
    output_file_cap_kb: int = 64 * 1024
    """Size cap of the file a command's output goes to (``ulimit -f``): a flood ends there."""
    env_setup: str = ""
    """Shell prefix run before each command (e.g. activating a conda env of a sweb.eval image)."""
    extra_labels: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("user", "keeper_user"):
            if getattr(self, name).split(":")[0] in ("0", "root"):
                raise ValueError(f"SandboxConfig.{name} must not be root")
        if self.user.split(":")[0] == self.keeper_user.split(":")[0]:
            raise ValueError("SandboxConfig.user and keeper_user must be different uids")
        for name in ("cpus", "command_timeout", "max_command_timeout", "episode_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.pids_limit < 16:
            raise ValueError(f"SandboxConfig.pids_limit must be >= 16, got {self.pids_limit}")
        if self.max_output_chars < 100:
            raise ValueError(f"SandboxConfig.max_output_chars must be >= 100, got {self.max_output_chars}")


@dataclass
class ExecResult:
    """What one command did."""

    exit_code: int | None
    output: str
    """Output shown to the agent, already truncated with a note saying how much was cut."""
    timed_out: bool = False
    output_bytes: int = 0
    """Size of the full output (before truncation)."""
    duration: float = 0.0
    note: str = ""
    """How the limits intervened, if they did."""


def _call_with_deadline(fn: Callable[[], _T], seconds: float) -> tuple[bool, _T | None]:
    """Run ``fn`` in a daemon thread; ``(finished, result)``. Exceptions propagate."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        return False, None
    if "error" in box:
        raise box["error"]
    return True, box.get("result")


_WRAPPER = r"""
exec 2>/dev/null  # the wrapper's own job reports ("File size limit exceeded") stay out of the output
ulimit -f "$CRL_FSIZE_KB" 2>/dev/null
out=/tmp/.crl_out_$CRL_ID
cd "$CRL_WORKDIR" 2>/dev/null
timeout -k 2 "$CRL_TIMEOUT" bash -c "$CRL_SETUP$CRL_CMD" >"$out" 2>&1 </dev/null &
tpid=$!
wait "$tpid"
rc=$?
# `timeout` leads its own process group: whatever the command left behind (background jobs,
# a fork bomb whose first shell already returned) dies with it. `kill` is a builtin: no fork.
kill -KILL -- "-$tpid" 2>/dev/null; kill -KILL -- "-$tpid" 2>/dev/null
n=$(stat -c %s "$out" 2>/dev/null || echo 0)
printf '%s %s\n' "$rc" "$n"
if [ "$n" -le "$CRL_LIMIT" ]; then cat "$out"; else head -c "$CRL_HEAD" "$out"; printf '\n\x01CRL_CUT\x01\n'; tail -c "$CRL_TAIL" "$out"; fi
rm -f "$out"
"""


class DockerSandbox:
    """One container for one episode; use as a context manager or call :meth:`close`."""

    def __init__(self, image: str, config: SandboxConfig | None = None, client: Any = None) -> None:
        self.image = image
        self.config = config or SandboxConfig()
        self.client = client if client is not None else docker_client()
        self.container: Any = None
        self.started_at = 0.0
        self.start_latency = 0.0

    # -- life cycle ----------------------------------------------------------------------
    def start(self) -> DockerSandbox:
        from docker.types import Ulimit

        reap_once(self.client)
        cfg = self.config
        t0 = time.monotonic()
        labels = {LABEL: "1", OWNER_LABEL: owner_id(), **cfg.extra_labels}
        try:
            self.container = self.client.containers.create(
                self.image,
                command=["sleep", "infinity"],
                name=f"crl-sandbox-{uuid.uuid4().hex[:12]}",
                labels=labels,
                user=cfg.keeper_user,
                working_dir=cfg.workdir,
                environment={"HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"},
                hostname="sandbox",
                network_mode="none",
                mem_limit=cfg.mem_limit,
                memswap_limit=cfg.mem_limit,
                nano_cpus=int(cfg.cpus * 1e9),
                pids_limit=cfg.pids_limit,
                cap_drop=["ALL"],
                # only for the root-side chown of a root-owned work tree (sweb.eval images);
                # the agent's non-root uid gets no capabilities at all.
                cap_add=["CHOWN", "DAC_READ_SEARCH", "FOWNER"],
                security_opt=["no-new-privileges"],
                ulimits=[Ulimit(name="nofile", soft=4096, hard=4096)],
                init=True,
            )
            self.container.start()
            if cfg.chown_workdir:
                code, out = self.run(["chown", "-R", cfg.user, cfg.workdir], user="root", timeout=300.0)
                if code != 0:
                    raise RuntimeError(f"chown of {cfg.workdir} failed: {out.decode('utf-8', 'replace')[:300]}")
        except Exception:
            self.close()
            raise
        self.started_at = time.monotonic()
        self.start_latency = self.started_at - t0
        return self

    def __enter__(self) -> DockerSandbox:
        return self.start() if self.container is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the container (idempotent)."""
        if self.container is not None:
            try:
                self.container.remove(force=True)
            except Exception as exc:  # already gone
                log.debug("close: %s", exc)
            self.container = None

    def remaining_time(self) -> float:
        """Seconds left of the episode's wall-clock budget."""
        return self.config.episode_timeout - (time.monotonic() - self.started_at)

    # -- running commands ----------------------------------------------------------------
    def run(self, argv: list[str], *, user: str | None = None, timeout: float = 60.0,
            environment: dict[str, str] | None = None, workdir: str | None = None) -> tuple[int | None, bytes]:
        """Run a short internal command; ``(exit_code, output)``, exit code None on timeout."""
        if self.container is None:
            raise RuntimeError("sandbox is not started")
        container = self.container

        def call() -> Any:
            return container.exec_run(argv, user=user or self.config.user, environment=environment,
                                      workdir=workdir or self.config.workdir)

        finished, res = _call_with_deadline(call, timeout)
        if not finished or res is None:
            self._kill_agent_processes()
            return None, b""
        return res.exit_code, res.output or b""

    def exec(self, command: str, timeout: float | None = None) -> ExecResult:
        """Run an agent's bash command within its limits; the output is truncated for display."""
        cfg = self.config
        remaining = self.remaining_time()
        if remaining <= 0:
            raise EpisodeTimeoutError(f"episode wall-clock limit of {cfg.episode_timeout:.0f} s reached")
        limit = max(1.0, min(timeout or cfg.command_timeout, cfg.max_command_timeout, remaining))
        head = cfg.max_output_chars // 2
        env = {
            "CRL_CMD": command, "CRL_TIMEOUT": f"{limit:.1f}", "CRL_ID": uuid.uuid4().hex[:8],
            "CRL_WORKDIR": cfg.workdir, "CRL_SETUP": cfg.env_setup, "CRL_FSIZE_KB": str(cfg.output_file_cap_kb),
            "CRL_LIMIT": str(cfg.max_output_chars), "CRL_HEAD": str(head), "CRL_TAIL": str(cfg.max_output_chars - head),
        }
        t0 = time.monotonic()
        # Host-side deadline: the in-container `timeout` should fire first; this is the backstop.
        code, raw = self.run(["bash", "-c", _WRAPPER], timeout=limit + 15.0, environment=env)
        duration = time.monotonic() - t0
        if code is None:
            return ExecResult(None, f"The command was stopped after {limit:.0f} s (killed by the sandbox).",
                              timed_out=True, duration=duration, note="host deadline: processes killed")
        first, _, body = raw.partition(b"\n")
        try:
            rc_s, n_s = first.decode().split()
            rc, total = int(rc_s), int(n_s)
        except ValueError:  # the wrapper itself failed (e.g. no process slot left)
            return ExecResult(code, truncate_output(raw.decode("utf-8", "replace"), cfg.max_output_chars),
                              duration=duration, note="wrapper failed")
        text = body.decode("utf-8", "replace")
        if "\x01CRL_CUT\x01" in text:
            shown_head, _, shown_tail = text.partition("\n\x01CRL_CUT\x01\n")
            cut = total - len(shown_head.encode()) - len(shown_tail.encode())
            text = f"{shown_head}\n[... output truncated: {cut} of {total} bytes cut ...]\n{shown_tail}"
        notes = []
        timed_out = rc in (124, 137) and duration >= limit - 0.5
        if timed_out:
            notes.append(f"The command timed out after {limit:.0f} s and was killed.")
        if total >= cfg.output_file_cap_kb * 1024 or rc == 153:  # 128 + SIGXFSZ
            notes.append(f"Output reached the {cfg.output_file_cap_kb} KiB cap; the command was stopped there.")
        return ExecResult(rc, text, timed_out=timed_out, output_bytes=total, duration=duration, note=" ".join(notes))

    def _kill_agent_processes(self) -> None:
        """Last-resort kill of everything the agent's uid runs; restart the container if that fails."""
        container = self.container
        if container is None:
            return
        def kill_all() -> Any:
            # kill(-1) as the agent's uid reaches every process of that uid and nothing else
            # (the keeper process belongs to another uid).
            return container.exec_run(["bash", "-c", "kill -KILL -1"], user=self.config.user)

        finished, res = _call_with_deadline(kill_all, 10.0)
        if not finished or res is None or res.exit_code not in (0, 1, 137):
            log.warning("sandbox %s: could not kill the agent's processes; restarting the container", container.name)
            container.restart(timeout=0)

    # -- files ---------------------------------------------------------------------------
    def put_file(self, path: str, data: bytes, mode: int = 0o644, *, as_root: bool = False) -> None:
        """Write a file into the container (parent directory must exist); owned by the agent."""
        if self.container is None:
            raise RuntimeError("sandbox is not started")
        uid, _, gid = self.config.user.partition(":")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(os.path.basename(path))
            info.size, info.mode, info.mtime = len(data), mode, int(time.time())
            info.uid, info.gid = (0, 0) if as_root else (int(uid), int(gid or uid))
            tar.addfile(info, io.BytesIO(data))
        if not self.container.put_archive(os.path.dirname(path) or "/", buf.getvalue()):
            raise OSError(f"could not write {path} into the sandbox")

    def put_tree(self, dest: str, tar_bytes: bytes) -> None:
        """Extract a tar archive (already owned by the agent's uid) under ``dest``."""
        if not self.container.put_archive(dest, tar_bytes):
            raise OSError(f"could not copy the archive into {dest}")

    def diff(self) -> str:
        """``git diff`` of the work tree against HEAD, new files included."""
        code, out = self.run(["bash", "-c", "git add -A >/dev/null 2>&1; git -c core.fileMode=false diff --cached --no-color HEAD"],
                             timeout=60.0)
        if code != 0:
            raise RuntimeError(f"git diff failed in the sandbox (exit {code}): {out.decode('utf-8', 'replace')[:500]}")
        return out.decode("utf-8", "replace")

    @property
    def fs(self) -> ContainerFS:
        return ContainerFS(self)


__all__ = [
    "HOW_TO_START", "LABEL", "OWNER_LABEL", "ContainerFS", "DockerSandbox", "DockerUnavailableError",
    "EpisodeTimeoutError", "ExecResult", "SandboxConfig", "docker_client", "reap",
]
