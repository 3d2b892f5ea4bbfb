"""The limits of one episode's sandbox (:class:`SandboxConfig`) and what one command did
(:class:`ExecResult`).

Checked when built, so a :class:`~crl_gym.envs.swebench.sandbox.DockerSandbox` never starts with a
root agent, a shell it does not know or a size Docker would read otherwise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from crl_gym.envs.swebench.container_fs import STAGE_DIR

_SIZE_RE = re.compile(r"^[1-9][0-9]*[kmgKMG]?$")
SHELL_MODES = ("persistent", "exec")


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
    disk_quota: bool = True
    """Read-only root file system, with the work tree and ``/tmp`` on size-capped tmpfs volumes:
    what the agent writes never reaches the host's disk. ``False`` keeps the image's writable
    layer (only for root-side image builds that ``commit`` it; never for an agent)."""
    workdir_size: str = "4g"
    """Cap of the work tree's tmpfs (the repository copied in from the image included)."""
    tmp_size: str = "512m"
    """Cap of ``/tmp``'s tmpfs. Both count against ``mem_limit`` as they fill."""
    shell: str = "persistent"
    """How commands reach the container. ``"persistent"``: one shell server per container, started
    with it and kept for the episode (:mod:`~crl_gym.envs.swebench.shell`); each command costs a few
    milliseconds plus its own time, and exported variables and the working directory carry over
    from one command to the next. ``"exec"``: a fresh ``docker exec`` per command (tens to hundreds
    of milliseconds each, nothing carried over); kept for comparison and for images
    without Python."""
    extra_labels: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.shell not in SHELL_MODES:
            raise ValueError(
                f"SandboxConfig.shell must be one of {', '.join(SHELL_MODES)}, got {self.shell!r}"
            )
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
            raise ValueError(
                f"SandboxConfig.max_output_chars must be >= 100, got {self.max_output_chars}"
            )
        for name in ("workdir_size", "tmp_size"):
            if not _SIZE_RE.match(getattr(self, name)):
                raise ValueError(
                    f"SandboxConfig.{name} must look like 512m or 4g, got {getattr(self, name)!r}"
                )
        if not self.workdir.startswith("/") or self.workdir.rstrip("/") in ("", STAGE_DIR):
            raise ValueError(
                f"SandboxConfig.workdir must be an absolute directory other than / and {STAGE_DIR}"
            )


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
