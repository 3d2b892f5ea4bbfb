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
    assert not host["Binds"] and host["ReadonlyRootfs"]
    # no host directory is mounted: only the sandbox's own labelled tmpfs volumes
    assert sorted(m["Destination"] for m in attrs["Mounts"]) == ["/run/crl-out", "/run/crl-stage", "/testbed", "/tmp"]
    for m in attrs["Mounts"]:
        volume = client.api.inspect_volume(m["Name"])
        assert m["Type"] == "volume" and volume["Options"]["type"] == "tmpfs" and volume["Labels"][LABEL] == "1"
    assert "no-new-privileges" in host["SecurityOpt"]
    assert host["LogConfig"]["Type"] == "none" and {"Name": "core", "Soft": 0, "Hard": 0} in host["Ulimits"]


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
    res = sandbox.exec("sleep 10000")
    assert res.timed_out and res.exit_code in (124, 137)
    # killed at its 3 s limit, not before; the bound only says it did not sleep on (10000 s)
    assert 3 <= res.duration < 1000
    assert "timed out after 3 s" in res.note
    assert sandbox.exec("echo still-here").output.strip() == "still-here"


@pytest.mark.docker
def test_fork_bomb_is_contained(sandbox: DockerSandbox) -> None:
    bomb = sandbox.exec(":(){ :|:& };:")
    assert bomb.exit_code is not None  # the command came back through the shell, not the host's last resort
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
    volumes = [m["Name"] for m in client.api.inspect_container(cid)["Mounts"]]
    sb.close()
    sb.close()  # idempotent
    assert not client.containers.list(all=True, filters={"id": cid})
    assert volumes and not {v.name for v in client.volumes.list()} & set(volumes)  # its tmpfs volumes went too
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


# -- a command's processes end with it, whichever way they left its process group ----------
ESCAPES = {
    "setsid": "setsid -f sh -c 'sleep 2; echo {tag} >> /tmp/survivors'",
    "nohup": "nohup sh -c 'sleep 2; echo {tag} >> /tmp/survivors' >/dev/null 2>&1 &",
    "nohup-setsid": "nohup setsid -f sh -c 'sleep 2; echo {tag} >> /tmp/survivors' >/dev/null 2>&1",
    "double-fork": (
        "python3 -c 'import os, time\n"
        "if os.fork(): raise SystemExit\n"
        "os.setsid()\n"
        "if os.fork(): raise SystemExit\n"
        "time.sleep(2); open(\"/tmp/survivors\", \"a\").write(\"{tag}\\n\")'"
    ),
    "setpgid": (
        "python3 -c 'import os, time; os.setpgid(0, 0); time.sleep(2); "
        "open(\"/tmp/survivors\", \"a\").write(\"{tag}\\n\")' &"
    ),
}


def _survivors(sb: DockerSandbox) -> str:
    """What escaped processes wrote, plus any agent process still sleeping for them."""
    res = sb.exec("cat /tmp/survivors 2>/dev/null; for p in /proc/[0-9]*; do "
                  "[ \"$(stat -c %u $p 2>/dev/null)\" = 1000 ] && tr '\\0' ' ' < $p/cmdline 2>/dev/null && echo; done")
    return "\n".join(line for line in res.output.splitlines() if "survivor-" in line)


@pytest.mark.docker
@pytest.mark.parametrize("how", list(ESCAPES))
def test_background_process_does_not_survive_its_command(sandbox: DockerSandbox, how: str) -> None:
    sandbox.exec("rm -f /tmp/survivors")
    res = sandbox.exec(ESCAPES[how].format(tag=f"survivor-{how}") + "\necho started")
    assert res.exit_code == 0 and "started" in res.output
    time.sleep(3.5)  # long enough for a survivor to wake up and write its marker
    assert _survivors(sandbox) == "", f"a process started with {how} outlived its command"


@pytest.mark.docker
def test_internal_commands_leave_no_process_behind(sandbox: DockerSandbox) -> None:
    # run() is what grading uses for the agent's patched code (eval script), as the agent's uid
    sandbox.exec("rm -f /tmp/survivors")
    code, _ = sandbox.run(["bash", "-c", ESCAPES["double-fork"].format(tag="survivor-run")])
    assert code == 0
    time.sleep(3.5)
    assert _survivors(sandbox) == ""


# -- nothing a command writes lands on the host's disk ----------------------------------------
def _rw_layer_bytes(client: Any, sb: DockerSandbox) -> int:
    """Size of the container's writable layer: the part of its file system on the host's disk."""
    return int(client.api.containers(all=True, filters={"id": sb.container.id}, size=True)[0].get("SizeRw") or 0)


FILL = ("find / \\( -path /proc -o -path /sys -o -path /dev \\) -prune -o -type d -writable -print 2>/dev/null "
        "| while read -r d; do echo \"dir $d\"; i=0; while [ $i -lt {n} ]; do "
        "head -c 1048576 /dev/zero > \"$d/.fill$i\" 2>/dev/null || {{ echo \"stopped $d $i\"; break; }}; i=$((i+1)); "
        "done; done")


@pytest.mark.docker
def test_agent_writes_never_reach_the_host_disk(client: Any) -> None:
    cfg = SandboxConfig(command_timeout=120, mem_limit="1g", output_file_cap_kb=2048)
    with DockerSandbox(BASE_IMAGE, cfg, client).start() as sb:
        before = _rw_layer_bytes(client, sb)
        res = sb.exec(FILL.format(n=32))  # 32 MiB into every directory the agent can write
        dirs = [line.split(" ", 1)[1] for line in res.output.splitlines() if line.startswith("dir ")]
        assert "/testbed" in dirs and "/tmp" in dirs, res.output
        grown = _rw_layer_bytes(client, sb) - before
        assert grown < 1024 * 1024, f"{grown} bytes of the agent's writes reached the host's disk ({dirs})"
        # the writes did happen (to size-limited tmpfs), and the work tree is still usable
        assert sb.exec("ls /testbed/.fill* | wc -l").output.strip() == "32"


@pytest.mark.docker
def test_a_command_filling_its_quota_stops_there(client: Any) -> None:
    cfg = SandboxConfig(command_timeout=60, mem_limit="512m", output_file_cap_kb=2048,
                        workdir_size="48m", tmp_size="16m")
    with DockerSandbox(BASE_IMAGE, cfg, client).start() as sb:
        res = sb.exec("for i in $(seq 1 200); do head -c 1048576 /dev/zero > /testbed/f$i || { echo stopped at $i; break; }; done; "
                      "for i in $(seq 1 200); do head -c 1048576 /dev/zero > /tmp/f$i 2>/dev/null || { echo tmp stopped at $i; break; }; done")
        assert "No space left on device" in res.output
        work_stop = int(re.search(r"^stopped at (\d+)", res.output, re.M).group(1))  # type: ignore[union-attr]
        tmp_stop = int(re.search(r"^tmp stopped at (\d+)", res.output, re.M).group(1))  # type: ignore[union-attr]
        assert 40 <= work_stop <= 49 and 8 <= tmp_stop <= 17
        # both full: the next command's output still comes back (it has a tmpfs of its own)
        assert sb.exec("echo still-seen").output.strip() == "still-seen"
        assert sb.exec("rm -f /testbed/f* && echo freed && df -k /testbed | tail -1").output.startswith("freed")
        assert sb.exec("echo ok > /testbed/after && cat /testbed/after").output.strip() == "ok"


@pytest.mark.docker
def test_last_resort_restart_refills_the_work_tree(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import crl_gym.envs.swebench.sandbox as sandbox_mod

    with DockerSandbox(BASE_IMAGE, SandboxConfig(), client).start() as sb:
        assert sb.exec("echo edit > /testbed/mine && echo x > /tmp/scratch && echo ok").output.strip() == "ok"
        # the kill of the agent's processes does not come back: the container is restarted instead
        monkeypatch.setattr(sandbox_mod, "_call_with_deadline", lambda fn, seconds: (False, None))
        note = sb._kill_agent_processes()
        monkeypatch.undo()
        assert "restarted" in note and "reset" in note
        res = sb.exec("ls -A /testbed /tmp; stat -c '%U %a' /testbed /tmp /run/crl-stage")
        assert res.exit_code == 0 and "mine" not in res.output and "scratch" not in res.output
        assert res.output.splitlines()[-3:] == ["agent 755", "root 1777", "root 755"]
        sb.fs.write_text("/testbed/after.py", "ok\n")  # the editor's staging works again
        assert sb.fs.read_text("/testbed/after.py") == "ok\n"
