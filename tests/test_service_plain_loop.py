"""A plain Gymnasium loop that imports nothing from crl_train drives ``crl-experience serve --extractor``.

The README's "Any RL library" section shows the same loop: wrapped MiniHack envs and a
RemoteClient; the server runs the extractor's whole loop (distil → ops → bank → credit → CISPO),
and each rollout step is closed with ``end_step``.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import gymnasium as gym
import pytest
from _servers import start_extractor_server, stop_server
from _waiting import settle

import crl_gym  # noqa: F401  (registers the crl/ envs)
from crl_gym.protocol import AddOp
from crl_gym.wrappers.experience import ExperienceWrapper

pytestmark = pytest.mark.slow


def test_plain_gym_loop_drives_the_served_extractor(tmp_path: Path) -> None:
    # the tiny preset, with a small B_φ so that a few steps reach a CISPO update
    proc, client = start_extractor_server(tmp_path)
    try:
        client.apply_ops([AddOp("Find the staircase down (>) on the map and walk towards it.")])
        size0 = client.stats().bank_size
        envs = [ExperienceWrapper(gym.make("crl/MiniHack-Room-5x5-v0", max_turns=8), client) for _ in range(4)]
        rng = random.Random(0)
        stats = client.stats()
        for step in range(12):
            for i, env in enumerate(envs):
                condition = "guided" if i < 2 else "free"
                _, info = env.reset(seed=step, options={"experience": condition, "rollout_step": step})
                done = False
                while not done:
                    _, _, terminated, truncated, info = env.step(rng.choice(info["admissible_actions"]))
                    done = terminated or truncated
            client.end_step(step)
            stats = client.stats()
            if stats.extractor_updates > 0:
                break
            time.sleep(1.0)  # the extractor distils in the background; give it time between steps
        stats = settle(client, lambda s: s.extractor_updates > 0, "an extractor update", timeout=120.0, poll=1.0)
        assert stats.distilled > 0 and stats.credited > 0, stats
        assert stats.bank_size != size0 or stats.get("updated") > 0  # type: ignore[operator]
        for env in envs:
            env.close()
    finally:
        err = stop_server(proc, client)
    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
