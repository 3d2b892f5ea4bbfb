"""SandboxPool against the real engine: warm hand-outs are fresh, refills happen behind, close removes all."""

from __future__ import annotations

from typing import Any

import pytest

from crl_gym.envs.swebench.image import BASE_IMAGE
from crl_gym.envs.swebench.pool import SandboxPool
from crl_gym.envs.swebench.sandbox import LABEL, SandboxConfig
from crl_gym.envs.swebench.testing import require_docker


def _ours(client: Any) -> set[str]:
    return {c.id for c in client.containers.list(all=True, filters={"label": f"{LABEL}=1"})}


def test_pool_validates_spares() -> None:
    with pytest.raises(ValueError, match="spares"):
        SandboxPool(client=None, spares=-1)


@pytest.mark.docker
def test_pool_hands_out_fresh_started_sandboxes_and_refills() -> None:
    client = require_docker()
    cfg = SandboxConfig(mem_limit="256m", pids_limit=64)
    before = _ours(client)
    with SandboxPool(client, spares=2) as pool:
        assert pool.prewarm(BASE_IMAGE, cfg) == 2 and len(pool.boot_latencies) == 2
        first = pool.acquire(BASE_IMAGE, cfg)
        second = pool.acquire(BASE_IMAGE, cfg)
        assert pool.stats == {"warm": 2, "cold": 0, "boot_failures": 0}
        assert first.container.id != second.container.id
        # fresh: nothing of an agent ran there, and its episode budget starts at the hand-out
        res = first.exec("ls -A /tmp; echo ${SEEN:-fresh}")
        assert res.exit_code == 0 and res.output.split() == ["fresh"]
        assert first.remaining_time() > cfg.episode_timeout - 60
        first.exec("export SEEN=1; touch /tmp/mark")
        first.close()
        second.close()
        # two replacements were booted behind the hand-outs; a different config gets its own boot
        assert pool.prewarm(BASE_IMAGE, cfg) == 2
        other = pool.acquire(BASE_IMAGE, SandboxConfig(mem_limit="512m", pids_limit=64))
        assert pool.stats["cold"] == 1
        other.close()
        pool.prewarm(BASE_IMAGE, SandboxConfig(mem_limit="512m", pids_limit=64))
    assert _ours(client) == before  # close removed every ready container
