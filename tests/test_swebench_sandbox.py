"""DockerSandbox hardening, for real: no network, no host files, limits on hangs, floods and fork bombs."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crl_gym.envs.swebench.image import BASE_IMAGE
from crl_gym.envs.swebench.sandbox import (
    LABEL,
    OWNER_LABEL,
    DockerSandbox,
    DockerUnavailableError,
    EpisodeTimeoutError,
    SandboxConfig,
    docker_client,
    reap,
)
from crl_gym.envs.swebench.testing import require_docker

REPO = Path(__file__).resolve().parents[1]


def test_base_image_tag_matches_ci_script() -> None:
    script = (REPO / ".ci" / "docker.sh").read_text()
    match = re.search(r'BASE_IMAGE="\$\{CRL_SWE_BASE_IMAGE:-([^}]+)\}"', script)
    assert match, "BASE_IMAGE not found in .ci/docker.sh"
    assert match.group(1) == "crl/swe-base:bookworm-v1"
    if "CRL_SWE_BASE_IMAGE" not in os.environ:
        assert BASE_IMAGE == match.group(1)


def test_ci_script_reads_the_mirror_from_apt_sources() -> None:
    script = (REPO / ".ci" / "docker.sh").read_text()
    assert "/etc/apt/sources.list" in script
    assert "deb.debian.org" not in script and "http://" not in script.replace("https?:", "")


def test_unreachable_engine_says_how_to_start_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(DockerUnavailableError, match="dockerd"):
        docker_client(timeout=2)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="root"):
        SandboxConfig(user="0:0")
    with pytest.raises(ValueError, match="different uids"):
        SandboxConfig(user="1000:1000", keeper_user="1000:1000")
    with pytest.raises(ValueError, match="pids_limit"):
        SandboxConfig(pids_limit=1)


@pytest.fixture(scope="module")
def client() -> Any:
    return require_docker()


@pytest.fixture(scope="module")
def sandbox(client: Any) -> Iterator[DockerSandbox]:
    cfg = SandboxConfig(command_timeout=3, pids_limit=64, mem_limit="256m", max_output_chars=400,
                        output_file_cap_kb=1024)
    with DockerSandbox(BASE_IMAGE, cfg, client).start() as sb:
        yield sb


@pytest.mark.docker
def test_runs_as_non_root_with_labels(sandbox: DockerSandbox, client: Any) -> None:
    res = sandbox.exec("id -u; pwd")
    assert res.exit_code == 0 and res.output.split() == ["1000", "/testbed"]
    attrs = client.api.inspect_container(sandbox.container.id)
    assert attrs["Config"]["Labels"][LABEL] == "1"
    host = attrs["HostConfig"]
    assert host["NetworkMode"] == "none"
    assert host["PidsLimit"] == 64 and host["Memory"] == 256 * 1024 * 1024
    assert not host["Binds"] and not attrs["Mounts"]
    assert "no-new-privileges" in host["SecurityOpt"]


@pytest.mark.docker
def test_no_network(sandbox: DockerSandbox) -> None:
    res = sandbox.exec(
        "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)\" 2>&1; "
        "ls /sys/class/net")
    assert "Network is unreachable" in res.output
    assert res.output.split()[-1] == "lo"  # the loopback device is the only interface


@pytest.mark.docker
def test_cannot_see_host_files(sandbox: DockerSandbox, tmp_path: Path) -> None:
    marker = tmp_path / "host_secret.txt"
    marker.write_text("host-only")
    res = sandbox.exec(f"cat {marker} 2>&1; ls {REPO} 2>&1; grep -rl host-only /tmp /home 2>/dev/null | head -1")
    assert "host-only" not in res.output
    assert "No such file or directory" in res.output


@pytest.mark.docker
def test_sleep_is_killed_at_the_command_limit(sandbox: DockerSandbox) -> None:
    t0 = time.monotonic()
    res = sandbox.exec("sleep 10000")
    assert res.timed_out and res.exit_code in (124, 137)
    assert time.monotonic() - t0 < 15
    assert "timed out after 3 s" in res.note
    assert sandbox.exec("echo still-here").output.strip() == "still-here"


@pytest.mark.docker
def test_fork_bomb_is_contained(sandbox: DockerSandbox) -> None:
    t0 = time.monotonic()
    sandbox.exec(":(){ :|:& };:")
    assert time.monotonic() - t0 < 30
    # the bomb is gone: the container is usable and only a handful of processes remain
    res = sandbox.exec("echo alive; ls /proc | grep -c '^[0-9]'")
    lines = res.output.split()
    assert lines[0] == "alive" and int(lines[1]) < 10


@pytest.mark.docker
def test_output_flood_is_truncated_and_capped(sandbox: DockerSandbox) -> None:
    res = sandbox.exec("yes | head -c 100000")
    # limit 400 chars: 200 head + 200 tail bytes shown, 100000 - 400 = 99600 cut
    assert "[... output truncated: 99600 of 100000 bytes cut ...]" in res.output
    assert res.output_bytes == 100000
    flood = sandbox.exec("yes")  # would fill the disk: the 1 MiB file cap stops it
    assert flood.output_bytes == 1024 * 1024 and "cap" in flood.note


@pytest.mark.docker
def test_background_leftovers_are_killed(sandbox: DockerSandbox) -> None:
    sandbox.exec("(sleep 10000 &); echo started")
    res = sandbox.exec("for p in /proc/[0-9]*; do cat $p/cmdline 2>/dev/null | tr '\\0' ' '; echo; done")
    assert "sleep 10000" not in res.output


@pytest.mark.docker
def test_episode_wall_clock_limit(client: Any) -> None:
    with DockerSandbox(BASE_IMAGE, SandboxConfig(episode_timeout=2, command_timeout=30), client).start() as sb:
        res = sb.exec("sleep 10")  # clipped to what is left of the episode (about 2 s)
        assert res.timed_out
        with pytest.raises(EpisodeTimeoutError):
            sb.exec("true")


@pytest.mark.docker
def test_close_and_reaper_remove_containers(client: Any) -> None:
    sb = DockerSandbox(BASE_IMAGE, SandboxConfig(), client).start()
    cid = sb.container.id
    sb.close()
    sb.close()  # idempotent
    assert not client.containers.list(all=True, filters={"id": cid})
    # an orphan: labelled as a sandbox whose owner process no longer exists
    import socket

    orphan = client.containers.create(BASE_IMAGE, ["sleep", "infinity"], network_mode="none",
                                      labels={LABEL: "1", OWNER_LABEL: f"{socket.gethostname()}:999999999"})
    alive = DockerSandbox(BASE_IMAGE, SandboxConfig(), client).start()
    try:
        assert reap(client) >= 1
        assert not client.containers.list(all=True, filters={"id": orphan.id})
        assert client.containers.list(filters={"id": alive.container.id})  # our live one stays
    finally:
        alive.close()
