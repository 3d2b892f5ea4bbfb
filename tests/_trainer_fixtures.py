"""Shared builders for the trainer tests: a tiny policy, a hashing-embedder manager, corridor envs."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from crl_gym.clients import LocalClient  # noqa: E402
from crl_gym.experience.bank import ExperienceBank  # noqa: E402
from crl_gym.experience.embedders import HashingEmbedder  # noqa: E402
from crl_gym.experience.manager import ExperienceManager  # noqa: E402
from crl_gym.wrappers.examples import CorridorEnv  # noqa: E402
from crl_gym.wrappers.experience import ExperienceWrapper  # noqa: E402
from crl_train.policy.base import OptimConfig, SamplingConfig  # noqa: E402
from crl_train.policy.tiny import build_tiny_policy  # noqa: E402

TEXTS = [
    "Walk east 2 times to reach the exit of the corridor.", "You are at cell 0 of a corridor; the exit is at cell 2, to the east.",
    "east west", "RETURN: nothing new", "ADD: Start with 'east'. Moving helped reach the goal. Avoid repeating",
    "You are the experience extractor", "search_and_ask[what should I do next?]",
]


def tiny_policy(seed: int = 0, loss_scale: str = "none") -> Any:
    """A tiny random policy whose sampling has its own seeded RNG stream: tests are reproducible
    whatever else touched torch's global RNG before them."""
    return build_tiny_policy(TEXTS, vocab_size=300, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64,
                             seed=seed, sampling=SamplingConfig(seed=seed),
                             optim=OptimConfig(lr=1e-3, loss_scale=loss_scale))  # type: ignore[arg-type]


def manager(entries: tuple[str, ...] = ()) -> ExperienceManager:
    emb = HashingEmbedder(64)
    bank = ExperienceBank(None, dim=64)
    for t in entries:
        bank.add(t, emb.encode([t])[0])
    return ExperienceManager(bank, emb)


def corridor_factory(client: Any | None, length: int = 2, max_turns: int = 4) -> Any:
    def make(env_id: str) -> Any:
        env = CorridorEnv(length=length, max_turns=max_turns)
        return env if client is None else ExperienceWrapper(env, client, env_id=env_id)

    return make


__all__ = ["LocalClient", "tiny_policy", "manager", "corridor_factory", "TEXTS"]
