"""Tests of crl_gym.envs.swebench.docker_engine: owner labels and the reaping of stale containers.

The engine itself is exercised for real in test_swebench_sandbox.py; here the owner logic runs
against real processes and a container list that records what ``reap`` removes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

from crl_gym.envs.swebench.docker_engine import LABEL, OWNER_LABEL, _owner_alive, owner_id, reap


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_owner_id_and_liveness() -> None:
    host = socket.gethostname()
    assert owner_id() == f"{host}:{os.getpid()}"
    assert _owner_alive(owner_id())
    assert not _owner_alive(f"{host}:{_dead_pid()}")
    assert not _owner_alive(f"{host}:not-a-pid")
    assert _owner_alive(f"another-{host}:1")  # other machines' containers are left alone


class _Container:
    def __init__(self, name: str, owner: str, removed: list[str], fail: bool = False) -> None:
        self.name, self.labels, self._removed, self._fail = name, {LABEL: "1", OWNER_LABEL: owner}, removed, fail

    def remove(self, force: bool, v: bool = False) -> None:
        assert force and v  # v: the container's tmpfs volumes go with it
        if self._fail:
            raise RuntimeError("removal already in progress")
        self._removed.append(self.name)


class _Volume(_Container):
    """A labelled volume left without its container; the owner label sits in its attrs."""

    def __init__(self, name: str, owner: str, removed: list[str]) -> None:
        super().__init__(name, owner, removed)
        self.attrs = {"Labels": self.labels}

    def remove(self, force: bool, v: bool = True) -> None:
        super().remove(force, v)


def test_reap_removes_only_orphans() -> None:
    removed: list[str] = []
    dead = f"{socket.gethostname()}:{_dead_pid()}"
    containers = [
        _Container("mine", owner_id(), removed),
        _Container("orphan", dead, removed),
        _Container("busy-orphan", dead, removed, fail=True),  # counted as not removed, no crash
    ]
    seen_filters: list[Any] = []

    volumes = [_Volume("my-volume", owner_id(), removed), _Volume("orphan-volume", dead, removed)]

    def list_(all: bool, filters: dict[str, str]) -> list[_Container]:
        seen_filters.append(filters)
        return containers

    def list_volumes(filters: dict[str, Any]) -> list[_Volume]:
        seen_filters.append(filters)
        return volumes

    client = SimpleNamespace(containers=SimpleNamespace(list=list_), volumes=SimpleNamespace(list=list_volumes))
    assert reap(client) == 1 and removed == ["orphan", "orphan-volume"]
    # only sandbox containers and dangling sandbox volumes are listed
    assert seen_filters == [{"label": f"{LABEL}=1"}, {"label": f"{LABEL}=1", "dangling": True}]
    removed.clear()
    assert reap(client, everything=True) == 2 and removed == ["mine", "orphan", "my-volume", "orphan-volume"]
