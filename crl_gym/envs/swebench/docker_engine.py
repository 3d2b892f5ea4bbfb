"""The Docker engine side of the sandbox: a checked client, the reaping of stale containers and
the size-capped tmpfs volumes a container's writable directories live on.

Every sandbox container (and each of its tmpfs volumes) carries the label ``crl.sandbox=1`` and
its owner (``host:pid``); :func:`reap` removes those whose owner process is gone (a crashed
trainer leaves no container running for long: the next process reaps it at its first start).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from docker import DockerClient
    from docker.models.containers import Container

log = logging.getLogger(__name__)

LABEL = "crl.sandbox"
OWNER_LABEL = "crl.sandbox.owner"
HOW_TO_START = (
    "Start a Docker engine first: `sudo dockerd > /tmp/dockerd.log 2>&1 &` (or `bash "
    ".ci/docker.sh`, which also installs docker.io and builds the base image), then check with "
    "`docker info`."
)

_REAPED = False  # reap_once has run in this process
_REAP_LOCK = threading.Lock()


class DockerUnavailableError(RuntimeError):
    """No Docker engine answers; the message says how to start one."""


def docker_client(timeout: int = 120) -> DockerClient:
    """A ``docker.DockerClient`` that answered a ping, or :class:`DockerUnavailableError`."""
    import docker

    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except Exception as exc:  # the SDK raises several types for "no engine"
        raise DockerUnavailableError(f"Docker is not reachable ({exc}). {HOW_TO_START}") from exc
    return client


def owner_id() -> str:
    """This process as a container owner label: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _owner_alive(owner: str) -> bool:
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname():
        return True  # another machine's container: not ours to judge
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True
    return True


def reap(client: DockerClient, *, everything: bool = False) -> int:
    """Remove sandbox containers whose owner process is gone (all of them with ``everything``).

    Their tmpfs volumes go with them; a labelled volume left without a container (its owner died
    between the two removals) is removed as well. Returns the number of containers removed.
    """
    removed = 0
    for c in client.containers.list(all=True, filters={"label": f"{LABEL}=1"}):
        owner = c.labels.get(OWNER_LABEL, "")
        if everything or not _owner_alive(owner):
            try:
                c.remove(force=True, v=True)
                removed += 1
            except Exception as exc:  # already gone, or being removed by someone else
                log.debug("reap: could not remove %s: %s", c.name, exc)
    for v in client.volumes.list(filters={"label": f"{LABEL}=1", "dangling": True}):
        if everything or not _owner_alive((v.attrs.get("Labels") or {}).get(OWNER_LABEL, "")):
            try:
                v.remove(force=True)
            except Exception as exc:  # in use again, or already gone
                log.debug("reap: could not remove volume %s: %s", v.name, exc)
    if removed:
        log.info("reaped %d stale sandbox container(s)", removed)
    return removed


def reap_once(client: DockerClient) -> None:
    """:func:`reap` once per process (the first sandbox start pays for it)."""
    global _REAPED
    with _REAP_LOCK:
        if not _REAPED:
            reap(client)
            _REAPED = True


def tmpfs_volume(
    target: str,
    size: str,
    labels: dict[str, str],
    owner: tuple[int, int, int] = (0, 0, 0o1777),
    noexec: bool = False,
) -> Any:
    """An anonymous local volume on a size-capped tmpfs: it lives in memory, never on the
    host's disk."""
    from docker.types import DriverConfig, Mount

    uid, gid, mode = owner
    opts = f"size={size},uid={uid},gid={gid},mode={mode:o},nosuid,nodev" + (
        ",noexec" if noexec else ""
    )
    # no_copy: the engine's own copy of the image's files would land in a tmpfs it unmounts again
    return Mount(
        target,
        None,
        type="volume",
        no_copy=True,
        labels=labels,
        driver_config=DriverConfig("local", {"type": "tmpfs", "device": "tmpfs", "o": opts}),
    )


def remove_quietly(container: Container) -> None:
    """Remove a container; one already gone (or left to the reaper) is no error."""
    try:
        container.remove(force=True)
    except Exception as exc:
        log.debug("could not remove %s: %s", getattr(container, "name", container), exc)
