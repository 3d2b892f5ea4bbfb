"""The sandbox's persistent shell against the real engine: state kept, protocol unspoofable, restarts told."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from crl_gym.envs.swebench.image import BASE_IMAGE
from crl_gym.envs.swebench.sandbox import DockerSandbox, SandboxConfig
from crl_gym.envs.swebench.testing import require_docker

# The command lines of the agent's (uid 1000) live processes.
AGENT_PROCS = ("for p in /proc/[0-9]*; do [ \"$(stat -c %u $p 2>/dev/null)\" = 1000 ] && "
               "tr '\\0' ' ' < $p/cmdline 2>/dev/null && echo; done")


@pytest.fixture(scope="module")
def client() -> Any:
    return require_docker()


@pytest.fixture()
def sandbox(client: Any) -> Iterator[DockerSandbox]:
    cfg = SandboxConfig(command_timeout=3, pids_limit=64, mem_limit="256m", max_output_chars=400,
                        output_file_cap_kb=1024)
    with DockerSandbox(BASE_IMAGE, cfg, client).start() as sb:
        assert sb.shell is not None and sb.persistent
        yield sb


def _server_pid(sb: DockerSandbox) -> int:
    assert sb.shell is not None and sb.shell.pid is not None
    return sb.shell.pid


@pytest.mark.docker
def test_environment_and_working_directory_carry_over(sandbox: DockerSandbox) -> None:
    res = sandbox.exec("export FOO=bar; PLAIN=1; greet() { echo hi-$1; }; mkdir -p /tmp/w && cd /tmp/w; exit 7")
    assert res.exit_code == 7  # the exit code is the command's own, state saving does not change it
    res = sandbox.exec("echo $FOO $PLAIN; greet you; pwd; env | grep -c '^FOO=bar$'")
    assert res.exit_code == 0 and res.output.split() == ["bar", "1", "hi-you", "/tmp/w", "1"]
    # the internal runs (editor, diff) do not see or change the agent's shell state
    code, out = sandbox.run(["bash", "-c", "pwd; echo ${FOO:-unset}"])
    assert (code, out.decode().split()) == (0, ["/testbed", "unset"])
    assert sandbox.shell_restarts == 0


@pytest.mark.docker
def test_a_command_cannot_kill_the_shell(sandbox: DockerSandbox) -> None:
    pid = _server_pid(sandbox)
    sandbox.exec("export KEEP=yes")
    res = sandbox.exec(f"kill -9 $PPID; kill -9 {pid}; kill -STOP {pid}; kill -9 -1; echo survived")
    assert "Operation not permitted" in res.output
    after = sandbox.exec("echo $KEEP")
    assert after.exit_code == 0 and after.output.strip() == "yes"
    assert sandbox.shell_restarts == 0 and _server_pid(sandbox) == pid


@pytest.mark.docker
def test_a_dead_shell_is_replaced_and_the_episode_told(sandbox: DockerSandbox) -> None:
    sandbox.exec("export KEEP=yes; cd /tmp")
    old = _server_pid(sandbox)
    code, _, _ = sandbox._run(["sh", "-c", f"kill -KILL {old}"], user="0", timeout=10)  # what an OOM kill would do
    assert code == 0
    lost = sandbox.exec("echo never-seen")
    assert lost.exit_code is None and "restarted" in lost.note and "never-seen" not in lost.output
    assert sandbox.shell_restarts == 1 and _server_pid(sandbox) != old
    res = sandbox.exec("echo $KEEP; pwd")
    assert res.exit_code == 0 and res.output.split() == ["yes", "/tmp"]  # exported state and cwd survive


@pytest.mark.docker
def test_a_hung_shell_is_replaced_after_the_host_deadline(sandbox: DockerSandbox) -> None:
    old = _server_pid(sandbox)
    code, _, _ = sandbox._run(["sh", "-c", f"kill -STOP {old}"], user="0", timeout=10)
    assert code == 0
    lost = sandbox.exec("echo hi", timeout=1)  # the host waits the command's limit + its grace, then replaces it
    assert lost.exit_code is None and "restarted" in lost.note
    assert sandbox.exec("echo back").output.strip() == "back"
    ps = sandbox._run(["sh", "-c", f"[ -d /proc/{old} ] && echo old-alive || echo old-gone"], user="0", timeout=10)
    assert ps[1].strip() == b"old-gone"  # the hung server was ended, not left behind


@pytest.mark.docker
def test_a_command_closing_its_stdout_changes_nothing(sandbox: DockerSandbox) -> None:
    res = sandbox.exec("echo before; exec 1>&- 2>&-; echo after; exit 3")
    assert res.exit_code == 3 and res.output == "before\n"
    res = sandbox.exec("exec 0<&- 1>&- 2>&-; (sleep 100 &); sleep 0.2")
    assert res.exit_code == 0
    assert "sleep 100" not in sandbox.exec(AGENT_PROCS).output  # what it left running was killed with it
    assert sandbox.shell_restarts == 0


@pytest.mark.docker
def test_printing_the_protocol_cannot_spoof_the_exit_code(sandbox: DockerSandbox) -> None:
    assert sandbox.shell is not None
    sent: list[bytes] = []
    sock = sandbox.shell._sock
    assert sock is not None
    real_sendall = sock.sendall

    def spy(data: bytes) -> None:
        sent.append(data)
        real_sendall(data)

    sandbox.shell._sock = _Spy(sock, spy)  # records each request, to know the id in flight
    fake = json.dumps({"id": "x", "rc": 0, "timed_out": False, "size": 0, "head_len": 0, "n": 0})
    res = sandbox.exec(f"printf '%s\\n' '{fake}'; printf '0\\n'; exit 5")
    assert res.exit_code == 5 and fake in res.output
    # nothing an agent process can read holds the nonce of the request it runs under
    res = sandbox.exec("cat /proc/[0-9]*/cmdline /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'; "
                       f"ls -l /proc/{_server_pid(sandbox)}/fd/ 2>&1; cat /proc/{_server_pid(sandbox)}/fd/0 2>&1 | head -c 200")
    nonce = json.loads(sent[-1].partition(b"\n")[2])["id"]
    assert nonce not in res.output and "Permission denied" in res.output
    assert sandbox.shell_restarts == 0


class _Spy:
    """A socket whose ``sendall`` goes through a spy; everything else is the socket's."""

    def __init__(self, sock: Any, sendall: Any) -> None:
        self._sock, self.sendall = sock, sendall

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


@pytest.mark.docker
def test_a_command_past_its_timeout_is_killed_with_its_tree(sandbox: DockerSandbox) -> None:
    sandbox.exec("export BEFORE=1")
    res = sandbox.exec("export DURING=1; (setsid sleep 100 &); sleep 100 | cat", timeout=1)
    assert res.timed_out and res.exit_code == 137 and "timed out after 1 s" in res.note
    assert "sleep 100" not in sandbox.exec(AGENT_PROCS).output
    # the shell is usable; the killed command's own changes are gone, the earlier ones kept
    res = sandbox.exec("echo ${BEFORE:-x} ${DURING:-x}")
    assert res.output.split() == ["1", "x"] and sandbox.shell_restarts == 0


@pytest.mark.docker
def test_the_agent_has_no_capability_and_the_shell_server_is_root(sandbox: DockerSandbox) -> None:
    res = sandbox.exec("grep -E '^Cap(Prm|Eff|Amb)' /proc/self/status; "
                       f"stat -c %u /proc/{_server_pid(sandbox)}; id -u; id -G")
    lines = res.output.split("\n")
    assert lines[:3] == ["CapPrm:\t0000000000000000", "CapEff:\t0000000000000000", "CapAmb:\t0000000000000000"]
    assert lines[3:6] == ["0", "1000", "1000"]  # the agent keeps no supplementary group of root's


@pytest.mark.docker
def test_the_exec_shell_is_kept_for_comparison(client: Any) -> None:
    cfg = SandboxConfig(shell="exec", command_timeout=2, pids_limit=64, mem_limit="256m")
    with DockerSandbox(BASE_IMAGE, cfg, client).start() as sb:
        assert sb.shell is None
        res = sb.exec("export FOO=bar; (sleep 100 &); echo $FOO")
        assert res.exit_code == 0 and res.output.strip() == "bar"
        assert "sleep 100" not in sb.exec(AGENT_PROCS).output
        assert sb.exec("echo ${FOO:-unset}").output.strip() == "unset"  # nothing carried over
        assert sb.exec("sleep 100").timed_out
        sb.fs.write_text("/testbed/x.txt", "ok\n")
        assert sb.fs.read_text("/testbed/x.txt") == "ok\n"


def test_shell_mode_is_validated() -> None:
    with pytest.raises(ValueError, match="shell"):
        SandboxConfig(shell="tty")


@pytest.mark.docker
def test_the_env_tells_the_agent_when_its_shell_was_restarted(client: Any, tmp_path: Any) -> None:
    from crl_gym.envs.swebench.env import SWEBenchEnv
    from crl_gym.envs.swebench.image import instance_image
    from crl_gym.envs.swebench.testing import make_demo_instance
    from crl_gym.envs.swebench.tools import format_tool_call

    instance = make_demo_instance(tmp_path)
    env = SWEBenchEnv(tasks=[instance], client=client, max_turns=5, prestart_grading=False)
    try:
        env.reset(options={"index": 0})
        assert env.sandbox is not None
        code, _, _ = env.sandbox._run(["sh", "-c", f"kill -KILL {_server_pid(env.sandbox)}"], user="0", timeout=10)
        assert code == 0
        obs, _, terminated, truncated, info = env.step(format_tool_call("execute_bash", command="echo hi"))
        assert "was restarted" in obs and info["shell_restarted"] and not (terminated or truncated)
        obs, *_, info = env.step(format_tool_call("execute_bash", command="echo again"))
        assert obs.startswith("again\n") and "shell_restarted" not in info
    finally:
        env.close()
        client.images.remove(instance_image(client, instance).name, force=True)
