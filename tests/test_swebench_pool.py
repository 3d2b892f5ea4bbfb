"""SandboxPool against the real engine: warm hand-outs are fresh, refills happen behind, close removes all."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from crl_gym.envs.swebench.image import BASE_IMAGE
from crl_gym.envs.swebench.pool import SandboxPool
from crl_gym.envs.swebench.sandbox import LABEL, SandboxConfig
from crl_gym.envs.swebench.testing import require_docker


def _ours(client: Any, tag: str) -> set[str]:
    return {c.id for c in client.containers.list(all=True, filters={"label": [f"{LABEL}=1", f"crl.test={tag}"]})}


def test_pool_validates_spares() -> None:
    with pytest.raises(ValueError, match="spares"):
        SandboxPool(client=None, spares=-1)


@pytest.mark.docker
def test_pool_hands_out_fresh_started_sandboxes_and_refills() -> None:
    client = require_docker()
    tag = uuid.uuid4().hex  # this test's containers only
    cfg = SandboxConfig(mem_limit="256m", pids_limit=64, extra_labels={"crl.test": tag})
    other_cfg = SandboxConfig(mem_limit="512m", pids_limit=64, extra_labels={"crl.test": tag})
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
        assert len(_ours(client, tag)) == 2  # the two spares; the handed-out ones are removed
        other = pool.acquire(BASE_IMAGE, other_cfg)
        assert pool.stats["cold"] == 1
        other.close()
        pool.prewarm(BASE_IMAGE, other_cfg)
    assert _ours(client, tag) == set()  # close removed every ready container
    with SandboxPool(client, spares=1, refill=False) as manual:  # filled by prewarm only
        assert manual.prewarm(BASE_IMAGE, cfg) == 1
        manual.acquire(BASE_IMAGE, cfg).close()
        assert sum(manual._booting.values()) == 0 and not any(manual._ready.values())  # nothing booted behind
    assert _ours(client, tag) == set()


@pytest.mark.docker
def test_env_takes_episode_and_grading_containers_from_the_pool(tmp_path: Any) -> None:
    from crl_gym.envs.swebench.env import SWEBenchEnv
    from crl_gym.envs.swebench.image import instance_image
    from crl_gym.envs.swebench.testing import fixing_agent, make_demo_instance

    client = require_docker()
    instance = make_demo_instance(tmp_path)
    image = instance_image(client, instance).name
    try:
        with SandboxPool(client, spares=1) as pool:
            env = SWEBenchEnv(tasks=[instance], client=client, pool=pool, max_turns=5)
            messages: list[dict[str, str]] = [{"role": "user", "content": env.reset(options={"index": 0})[0]}]
            terminated = truncated = False
            while not (terminated or truncated):
                action = fixing_agent(messages)
                messages.append({"role": "assistant", "content": action})
                obs, reward, terminated, truncated, info = env.step(action)
                messages.append({"role": "user", "content": obs})
            env.close()
            assert terminated and reward == 1.0 and info["grading"]["resolved"]
            # one hand-out for the episode, one (fresh) for its grading; the first boots cold
            assert pool.stats["warm"] + pool.stats["cold"] == 2 and pool.stats["boot_failures"] == 0
    finally:
        client.images.remove(image, force=True)
