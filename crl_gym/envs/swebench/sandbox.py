"""A locked-down Docker container per episode, driven through the ``docker`` SDK.

Hardening (all in :meth:`DockerSandbox.start`): no network (``network_mode="none"``), memory,
CPU and pids limits, a non-root user, all capabilities dropped except the few the root-side
house-keeping needs (the agent's uid has none), ``no-new-privileges``, no host mounts (files
travel with ``put_archive``), and a wall-clock limit per command and per episode. Every
container carries the label ``crl.sandbox=1`` plus its owner (``host:pid``) and is removed on
:meth:`close`, when :meth:`start` fails, and by :func:`reap` (run once per process at the first
start) when its owner process is gone.

Disk: the root file system is read-only; the work tree, ``/tmp``, the editor's staging directory
and the directory of the commands' output files are size-capped tmpfs volumes (the work tree is
copied in from the image at start), so nothing a command writes reaches the host's disk.
Container logs are off and core dumps are 0.

Commands reach the container through one persistent shell per container (``shell="persistent"``,
the default; :mod:`~crl_gym.envs.swebench.shell`): a root server started with the container runs
each command as the agent's uid with its output in a size-capped file and its time limit, then
kills every process of the agent's uid, so nothing a command started outlives it, whether it left
the process group (``setsid``, a double fork) or not. A dead or hung server is replaced and the
episode told. ``shell="exec"`` keeps the former path: ``timeout -k 2 T bash -c CMD`` in a fresh
``docker exec`` per command, then ``kill -KILL -1`` as the agent's uid. If even that fails, the
host-side deadline kills the agent's processes and, as the last resort, restarts the container
(its work tree is copied in again from the image).

The engine client, reaping and the tmpfs volumes live in
:mod:`~crl_gym.envs.swebench.docker_engine`, the editor's file system in
:mod:`~crl_gym.envs.swebench.container_fs`, the limits (:class:`SandboxConfig`) and a command's
result in :mod:`~crl_gym.envs.swebench.sandbox_config`; all are re-exported here.
"""

from __future__ import annotations

import io
import logging
import os
import tarfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

# The engine helpers and ContainerFS are re-exported: callers import them from here.
from crl_gym.envs.swebench.container_fs import STAGE_DIR, ContainerFS
from crl_gym.envs.swebench.docker_engine import (
    HOW_TO_START,
    LABEL,
    OWNER_LABEL,
    DockerUnavailableError,
    docker_client,
    owner_id,
    reap,
    reap_once,
    remove_quietly,
    tmpfs_volume,
)
from crl_gym.envs.swebench.sandbox_config import (
    EpisodeTimeoutError,
    ExecResult,
    SandboxConfig,
)
from crl_gym.envs.swebench.shell import _PYTHON, PersistentShell, ShellDiedError
from crl_gym.envs.swebench.tools import truncate_output
from crl_gym.envs.swebench.worktree import image_tree

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

_T = TypeVar("_T")
STAGE_FILE = f"{STAGE_DIR}/edit"
"""Where :meth:`DockerSandbox.stage` puts the editor's next write (a root-only tmpfs)."""
OUT_DIR = "/run/crl-out"
"""Where a command's output file goes (``exec`` shell; the persistent shell writes it to the
root-only staging tmpfs) and where the persistent shell keeps the agent's environment and working
directory between commands: a tmpfs of its own, so a full ``/tmp`` hides no output."""
STATE_FILE = f"{OUT_DIR}/.shell-state"
PRELUDE_NAME = "prelude.sh"
# Sourced by every command's bash (BASH_ENV) in the persistent shell: the previous command's shell
# variables (exported or not), functions and working directory come back (the image's env_setup runs
# once, before the first command), and they are saved again when this one exits, as a terminal keeps
# them. Builtins only (no fork per call); bash's own read-only variables fail to restore, quietly.
# Only the agent's own next command reads what it saved.
_PRELUDE = """unset BASH_ENV
if [ -f {state} ]; then . {state} 2>/dev/null; else {setup}:; fi
__crl_save() {{ {{ declare -p; declare -f; printf 'cd -- %q 2>/dev/null\\n' "$PWD"; }} \
> {state} 2>/dev/null; }}
trap __crl_save EXIT
"""


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


_WRAPPER = (
    r"""
exec 2>/dev/null  # the wrapper's own job reports ("File size limit exceeded") stay out of the"""
    r""" output
ulimit -f "$CRL_FSIZE_KB" 2>/dev/null
out=$CRL_OUTDIR/.crl_out_$CRL_ID
cd "$CRL_WORKDIR" 2>/dev/null
timeout -k 2 "$CRL_TIMEOUT" bash -c "$CRL_SETUP$CRL_CMD" >"$out" 2>&1 </dev/null &
tpid=$!
wait "$tpid"
rc=$?
# Whatever the command left behind dies now: kill(-1) as the agent's uid reaches every process of
# that uid in the container (background jobs, setsid'd or double-forked daemons, a fork bomb)
# except this shell; the keeper and init belong to other uids. A process that has a SIGKILL
# pending cannot fork, so one pass leaves none; `kill` is a builtin, so no process slot is needed.
kill -KILL -1 2>/dev/null; kill -KILL -1 2>/dev/null
n=$(stat -c %s "$out" 2>/dev/null || echo 0)
printf '%s %s\n' "$rc" "$n"
if [ "$n" -le "$CRL_LIMIT" ]; then cat "$out"; else head -c "$CRL_HEAD" "$out";"""
    r""" printf '\n\x01CRL_CUT\x01\n'; tail -c "$CRL_TAIL" "$out"; fi
rm -f "$out"
"""
)

# The same clean-up after an internal command run as the agent (grading runs the agent's code).
_AGENT_RUN = '"$@"; rc=$?; kill -KILL -1 2>/dev/null; exit "$rc"'


class DockerSandbox:
    """One container for one episode; use as a context manager or call :meth:`close`."""

    def __init__(self, image: str, config: SandboxConfig | None = None, client: Any = None) -> None:
        self.image = image
        self.config = config or SandboxConfig()
        self.client = client if client is not None else docker_client()
        self.container: Any = None
        self.started_at = 0.0
        self.start_latency = 0.0
        # One command at a time: the clean-up after each kills every process of the agent's uid.
        self._lock = threading.RLock()
        self.shell: PersistentShell | None = None
        self.shell_restarts = 0
        self._notices: list[str] = []

    @property
    def persistent(self) -> bool:
        return self.config.shell == "persistent"

    # -- life cycle ----------------------------------------------------------------------
    def start(self) -> DockerSandbox:
        from docker.types import LogConfig, Ulimit

        reap_once(self.client)
        cfg = self.config
        t0 = time.monotonic()
        labels = {LABEL: "1", OWNER_LABEL: owner_id(), **cfg.extra_labels}
        source: Any = None
        try:
            tree: Iterator[bytes] | None = None
            uid, _, gid = cfg.user.partition(":")
            agent = (
                (int(uid), int(gid or uid), 0o700) if f"{uid}{gid}".isdigit() else (0, 0, 0o1777)
            )
            mounts = [
                tmpfs_volume(STAGE_DIR, cfg.workdir_size, labels, (0, 0, 0o755), noexec=True),
                tmpfs_volume(
                    OUT_DIR, f"{cfg.output_file_cap_kb + 1024}k", labels, agent, noexec=True
                ),
            ]
            if cfg.disk_quota:
                source, info, tree = self._image_tree(labels)
                owner = (
                    (info.uid, info.gid, info.mode & 0o7777)
                    if info is not None and info.isdir()
                    else (0, 0, 0o1777)
                )
                mounts.append(tmpfs_volume(cfg.workdir, cfg.workdir_size, labels, owner))
                if cfg.workdir.rstrip("/") != "/tmp":
                    mounts.append(tmpfs_volume("/tmp", cfg.tmp_size, labels))
            self.container = self.client.containers.create(
                self.image,
                command=["sleep", "infinity"],
                name=f"crl-sandbox-{uuid.uuid4().hex[:12]}",
                labels=labels,
                # The persistent shell's server is a root exec: Docker gives an exec the
                # capability sets of the container's main user, none at all when that user is
                # not root.
                user="0:0" if self.persistent else cfg.keeper_user,
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
                # SETUID/SETGID: the persistent shell's server (root) drops each command to the
                # agent's uid.
                cap_add=["CHOWN", "DAC_READ_SEARCH", "FOWNER"]
                + (["SETUID", "SETGID"] if self.persistent else []),
                security_opt=["no-new-privileges"],
                # no core files (a crash could hand one to the host's core handler) and no logs on
                # the host
                ulimits=[
                    Ulimit(name="nofile", soft=4096, hard=4096),
                    Ulimit(name="core", soft=0, hard=0),
                ],
                log_config=LogConfig(type=LogConfig.types.NONE),
                read_only=cfg.disk_quota,
                mounts=mounts,
                init=True,
            )
            self.container.start()
            if tree is not None:
                self._fill_workdir(tree)
            if cfg.chown_workdir:
                code, out = self.run(
                    ["chown", "-R", cfg.user, cfg.workdir], user="root", timeout=300.0
                )
                if code != 0:
                    raise RuntimeError(
                        f"chown of {cfg.workdir} failed: {out.decode('utf-8', 'replace')[:300]}"
                    )
            if self.persistent:
                self._start_shell()
        except Exception:
            self.close()
            raise
        finally:
            if (
                source is not None
            ):  # off the start's critical path; a non-daemon thread, so exit waits for it
                threading.Thread(
                    target=remove_quietly, args=(source,), name="crl-sandbox-src-rm"
                ).start()
        self.started_at = time.monotonic()
        self.start_latency = self.started_at - t0
        return self

    def _image_tree(
        self, labels: dict[str, str]
    ) -> tuple[Any, tarfile.TarInfo | None, Iterator[bytes] | None]:
        """The image's work tree (:func:`~crl_gym.envs.swebench.worktree.image_tree`; the caller
        removes the container)."""
        return image_tree(self.client, self.image, self.config.workdir, labels)

    def _fill_workdir(self, tree: Iterator[bytes]) -> None:
        """Copy the image's work tree into its tmpfs (root-side, before any agent process runs)."""
        if not self.container.put_archive(self.config.workdir, tree):
            raise OSError(f"could not copy the image's {self.config.workdir} into the sandbox")

    def __enter__(self) -> DockerSandbox:
        return self.start() if self.container is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_shell(self) -> None:
        """Start the shell's server and stage the commands' prelude (root-side, before any
        agent command)."""
        uid, _, gid = self.config.user.partition(":")
        shell = PersistentShell(
            self.client, self.container.id, int(uid), int(gid or uid), STAGE_DIR
        ).start()
        setup = self.config.env_setup.strip()
        if setup and not setup.endswith(";"):
            setup += ";"
        shell.stage(
            PRELUDE_NAME,
            _PRELUDE.format(state=STATE_FILE, setup=f"{setup} " if setup else "").encode(),
        )
        self.shell = shell

    def _restart_shell(self, why: str) -> str:
        """Replace a dead or hung shell server; what the episode is told."""
        old, self.shell = self.shell, None
        self.shell_restarts += 1
        log.warning("sandbox %s: shell restarted (%s)", getattr(self.container, "name", "?"), why)
        done = ""
        if old is not None:
            old.close()
            if old.pid is not None:  # a hung server: end it (same uid, so root needs no capability)
                self._run(["sh", "-c", f"kill -KILL {old.pid}"], user="0", timeout=10.0)
        try:
            done = self._kill_agent_processes()
            if self.shell is None:
                self._start_shell()
        except Exception as exc:  # a shell that cannot start: the next call tries again
            log.warning("sandbox: the shell could not be restarted: %s", exc)
            return f"The sandbox's shell stopped ({why}) and could not be restarted yet: {exc}."
        restarted = "the container was restarted" in done
        return (
            f"The sandbox's shell stopped ({why}) and was restarted; every process it ran "
            "was stopped"
            + (
                "; the container was restarted and the work tree reset to the image's."
                if restarted
                else "; exported variables and the working directory are kept."
            )
        )

    def take_notices(self) -> list[str]:
        """What happened to the shell since the last call (restarts), for the episode's
        next observation."""
        out, self._notices = self._notices, []
        return out

    def _shell_request(
        self, req: dict[str, Any], timeout: float
    ) -> tuple[dict[str, Any], bytes] | None:
        """One request to the shell under the sandbox's lock; None (and a notice) when the
        shell died."""
        with self._lock:
            if self.shell is None:
                if self.container is None:
                    raise RuntimeError("sandbox is not started")
                self._notices.append(self._restart_shell("it was not running"))
                if self.shell is None:
                    return None
            try:
                return self.shell.request(req, timeout)
            except ShellDiedError as exc:
                self._notices.append(self._restart_shell(str(exc)))
                return None

    def close(self) -> None:
        """Remove the container (idempotent)."""
        if self.shell is not None:
            self.shell.close()
            self.shell = None
        if self.container is not None:
            try:
                self.container.remove(force=True, v=True)  # v: its tmpfs volumes too
            except Exception as exc:  # already gone
                log.debug("close: %s", exc)
            self.container = None

    def remaining_time(self) -> float:
        """Seconds left of the episode's wall-clock budget."""
        return self.config.episode_timeout - (time.monotonic() - self.started_at)

    # -- running commands ----------------------------------------------------------------
    def run(
        self,
        argv: list[str],
        *,
        user: str | None = None,
        timeout: float = 60.0,
        environment: dict[str, str] | None = None,
        workdir: str | None = None,
    ) -> tuple[int | None, bytes]:
        """Run a short internal command; ``(exit_code, output)``, exit code None on timeout.

        Run as the agent's uid (the default), every process of that uid is killed when it returns.
        """
        if (user or self.config.user).split(":")[0] == self.config.user.split(":")[0]:
            if self.persistent:
                return self._shell_run(
                    {"op": "run", "argv": argv, "env": environment or {}}, timeout, workdir
                )
            argv = ["bash", "-c", _AGENT_RUN, "crl-run", *argv]
        return self._run(
            argv, user=user, timeout=timeout, environment=environment, workdir=workdir
        )[:2]

    def run_python(
        self, source: str, args: list[str], *, timeout: float = 30.0
    ) -> tuple[int | None, bytes]:
        """Run Python ``source`` as the agent with ``sys.argv[1:] = args``: ``(exit_code, output)``.

        The persistent shell runs it in a forked child of its server (no interpreter start);
        the ``exec`` shell starts the container's Python for it.
        """
        if self.persistent:
            return self._shell_run({"op": "py", "code": source, "args": args}, timeout, None)
        return self.run(["sh", "-c", _PYTHON, source, *args], timeout=timeout)

    def _shell_run(
        self, req: dict[str, Any], timeout: float, workdir: str | None
    ) -> tuple[int | None, bytes]:
        """``run`` / ``run_python`` through the persistent shell; exit code None on timeout or
        a restart."""
        req = {**req, "cwd": workdir or self.config.workdir, "timeout": timeout, "limit": -1}
        answer = self._shell_request(req, timeout + 15.0)
        if (
            answer is None
        ):  # internal calls are reads or whole-file writes: one more try on the new shell
            answer = self._shell_request(req, timeout + 15.0)
        if answer is None:
            return None, b""
        head, payload = answer
        return (None if head["timed_out"] else int(head["rc"])), payload

    def _run(
        self,
        argv: list[str],
        *,
        user: str | None = None,
        timeout: float = 60.0,
        environment: dict[str, str] | None = None,
        workdir: str | None = None,
    ) -> tuple[int | None, bytes, str]:
        """``exec_run`` under a host-side deadline: ``(exit_code, output, note)``."""
        if self.container is None:
            raise RuntimeError("sandbox is not started")
        container = self.container

        def call() -> Any:
            return container.exec_run(
                argv,
                user=user or self.config.user,
                environment=environment,
                workdir=workdir or self.config.workdir,
            )

        with self._lock:
            finished, res = _call_with_deadline(call, timeout)
            if not finished or res is None:
                return None, b"", self._kill_agent_processes()
        return res.exit_code, res.output or b"", ""

    def exec(self, command: str, timeout: float | None = None) -> ExecResult:
        """Run an agent's bash command within its limits; the output is truncated for display."""
        cfg = self.config
        remaining = self.remaining_time()
        if remaining <= 0:
            raise EpisodeTimeoutError(
                f"episode wall-clock limit of {cfg.episode_timeout:.0f} s reached"
            )
        limit = max(1.0, min(timeout or cfg.command_timeout, cfg.max_command_timeout, remaining))
        head = cfg.max_output_chars // 2
        env = {
            "CRL_CMD": command,
            "CRL_TIMEOUT": f"{limit:.1f}",
            "CRL_ID": uuid.uuid4().hex[:8],
            "CRL_WORKDIR": cfg.workdir,
            "CRL_SETUP": cfg.env_setup,
            "CRL_FSIZE_KB": str(cfg.output_file_cap_kb),
            "CRL_OUTDIR": OUT_DIR,
            "CRL_LIMIT": str(cfg.max_output_chars),
            "CRL_HEAD": str(head),
            "CRL_TAIL": str(cfg.max_output_chars - head),
        }
        if self.persistent:
            return self._shell_exec(command, limit)
        t0 = time.monotonic()
        # Host-side deadline: the in-container `timeout` should fire first; this is the backstop.
        code, raw, killed = self._run(
            ["bash", "-c", _WRAPPER], timeout=limit + 15.0, environment=env
        )
        duration = time.monotonic() - t0
        if code is None:
            return ExecResult(
                None,
                f"The command was stopped after {limit:.0f} s (killed by the sandbox).",
                timed_out=True,
                duration=duration,
                note=killed,
            )
        first, _, body = raw.partition(b"\n")
        try:
            rc_s, n_s = first.decode().split()
            rc, total = int(rc_s), int(n_s)
        except ValueError:  # the wrapper itself failed (e.g. no process slot left)
            return ExecResult(
                code,
                truncate_output(raw.decode("utf-8", "replace"), cfg.max_output_chars),
                duration=duration,
                note="wrapper failed",
            )
        text = body.decode("utf-8", "replace")
        if "\x01CRL_CUT\x01" in text:
            shown_head, _, shown_tail = text.partition("\n\x01CRL_CUT\x01\n")
            cut = total - len(shown_head.encode()) - len(shown_tail.encode())
            text = (
                f"{shown_head}\n[... output truncated: {cut} of {total} bytes cut "
                f"...]\n{shown_tail}"
            )
        timed_out = rc in (124, 137) and duration >= limit - 0.5
        return _exec_result(rc, text, total, duration, limit, timed_out, cfg.output_file_cap_kb)

    def _shell_exec(self, command: str, limit: float) -> ExecResult:
        """:meth:`exec` through the persistent shell (same limits, same output format)."""
        cfg = self.config
        head_chars = cfg.max_output_chars // 2
        req = {
            "op": "exec",
            "argv": ["bash", "-c", command],
            "env": {"BASH_ENV": f"{STAGE_DIR}/{PRELUDE_NAME}"},
            "cwd": cfg.workdir,
            "timeout": limit,
            "fsize": cfg.output_file_cap_kb * 1024,
            "limit": cfg.max_output_chars,
            "head": head_chars,
        }
        t0 = time.monotonic()
        answer = self._shell_request(req, limit + 15.0)  # the host's deadline backs the server's
        duration = time.monotonic() - t0
        if answer is None:
            return ExecResult(
                None,
                "The command's result was lost: the sandbox's shell stopped while it ran.",
                duration=duration,
                note=" ".join(self.take_notices()),
            )
        head, payload = answer
        rc, total, timed_out = int(head["rc"]), int(head["size"]), bool(head["timed_out"])
        shown_head, shown_tail = payload[: head["head_len"]], payload[head["head_len"] :]
        text = shown_head.decode("utf-8", "replace")
        if total > len(payload):
            cut = total - len(payload)
            text += (
                f"\n[... output truncated: {cut} of {total} bytes cut ...]\n"
                + shown_tail.decode("utf-8", "replace")
            )
        return _exec_result(rc, text, total, duration, limit, timed_out, cfg.output_file_cap_kb)

    def _kill_agent_processes(self) -> str:
        """Last-resort kill of everything the agent's uid runs; restart the container if that fails.

        Returns what was done, for the agent's note. A restart empties the tmpfs volumes, so the
        work tree is copied in from the image again: the agent's edits are lost, the episode
        goes on.
        """
        container = self.container
        if container is None:
            return ""

        def kill_all() -> Any:
            # kill(-1) as the agent's uid reaches every process of that uid and nothing else
            # (the keeper process belongs to another uid).
            return container.exec_run(["bash", "-c", "kill -KILL -1"], user=self.config.user)

        finished, res = _call_with_deadline(kill_all, 10.0)
        if finished and res is not None and res.exit_code in (0, 1, 137):
            return "host deadline: processes killed"
        log.warning(
            "sandbox %s: could not kill the agent's processes; restarting the container",
            container.name,
        )
        container.restart(timeout=0)
        if self.config.disk_quota:
            source, _, tree = self._image_tree(dict(container.labels))
            try:
                if tree is not None:
                    self._fill_workdir(tree)
            finally:
                if source is not None:
                    source.remove(force=True)
        if self.config.chown_workdir:
            container.exec_run(["chown", "-R", self.config.user, self.config.workdir], user="root")
        if self.persistent:  # the restart ended the shell's server too
            if self.shell is not None:
                self.shell.close()
                self.shell = None
            self._start_shell()
        if not self.config.disk_quota:
            return "host deadline: the container was restarted"
        return "host deadline: the container was restarted and its work tree reset to the image's"

    # -- files ---------------------------------------------------------------------------
    def put_file(self, path: str, data: bytes, mode: int = 0o644, *, as_root: bool = False) -> None:
        """Write a file into the container (parent directory must exist); owned by the agent.

        The engine writes as root and follows symlinks in ``path``: only for paths no agent process
        can have touched (a fresh container, e.g. grading's). The editor writes through
        :meth:`stage` and :class:`ContainerFS`, as the agent.
        """
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

    def stage(self, data: bytes) -> str:
        """Put the editor's next write where only root can write (a tmpfs of its own); its path.

        :class:`ContainerFS` then copies it to its target as the agent's uid, so the engine's
        root-side ``put_archive`` never meets a path the agent controls.
        """
        if self.persistent:
            with self._lock:
                if self.shell is not None:
                    try:
                        return self.shell.stage(os.path.basename(STAGE_FILE), data)
                    except ShellDiedError as exc:
                        self._notices.append(self._restart_shell(str(exc)))
        self.put_file(STAGE_FILE, data, 0o644, as_root=True)
        return STAGE_FILE

    def put_tree(self, dest: str, tar_bytes: bytes) -> None:
        """Extract a tar archive (already owned by the agent's uid) under ``dest``."""
        if not self.container.put_archive(dest, tar_bytes):
            raise OSError(f"could not copy the archive into {dest}")

    def diff(self) -> str:
        """``git diff`` of the work tree against HEAD, new files included."""
        code, out = self.run(
            [
                "bash",
                "-c",
                "git add -A >/dev/null 2>&1; git -c core.fileMode=false diff --cached "
                "--no-color HEAD",
            ],
            timeout=60.0,
        )
        if code != 0:
            raise RuntimeError(
                f"git diff failed in the sandbox (exit {code}): "
                f"{out.decode('utf-8', 'replace')[:500]}"
            )
        return out.decode("utf-8", "replace")

    @property
    def fs(self) -> ContainerFS:
        return ContainerFS(self)


def _exec_result(
    rc: int,
    text: str,
    total: int,
    duration: float,
    limit: float,
    timed_out: bool,
    cap_kb: int,
) -> ExecResult:
    """A finished command's result, with the notes the agent reads: killed at the time limit, or
    stopped at the output cap (``rc`` 153 = 128 + SIGXFSZ)."""
    notes = []
    if timed_out:
        notes.append(f"The command timed out after {limit:.0f} s and was killed.")
    if total >= cap_kb * 1024 or rc == 153:
        notes.append(f"Output reached the {cap_kb} KiB cap; the command was stopped there.")
    return ExecResult(
        rc, text, timed_out=timed_out, output_bytes=total, duration=duration, note=" ".join(notes)
    )


__all__ = [
    "HOW_TO_START",
    "LABEL",
    "OWNER_LABEL",
    "ContainerFS",
    "DockerSandbox",
    "DockerUnavailableError",
    "EpisodeTimeoutError",
    "ExecResult",
    "SandboxConfig",
    "docker_client",
    "reap",
]
