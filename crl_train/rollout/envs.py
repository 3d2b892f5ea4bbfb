"""The actor's envs as a run builds them, and the tiny tokenizer's corpus read from them.

``make_raw_env(env, env_id)`` is ``crl_gym.envs.make`` with the run's ``env.kwargs`` (and the id's
``env.id_kwargs``); the
experience wrappers go around it where the method is guided (``crl_train.run.build``).
:func:`tokenizer_texts` is what the tiny preset's tokenizer is trained on: what the envs show and
every prompt the models read (the actor's own texts, the extractor's templates and
answer skeletons).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from crl_gym.experience.schemas import example_answers
from crl_gym.templates import (
    DISTILLATION_TEMPLATE,
    GUIDED_OBSERVATION_TEMPLATE,
    MERGE_TEMPLATE,
    REFINEMENT_TEMPLATE,
)
from crl_train.config import EnvConfig, TrainConfig

RawEnvFactory = Callable[[str], Any]
"""``env_id -> env``: a gymnasium env without the experience wrappers (``crl_gym.envs.make`` or a
test's own)."""

CARRIED_TEXT_WEIGHT = 8
"""How many times the tiny tokenizer's corpus repeats the texts guided prompts carry."""


def make_raw_env(env: EnvConfig, env_id: str) -> Any:
    """``crl_gym.envs.make(env_id, **env.kwargs_for(env_id))``: any Gymnasium id
    (``crl_gym.envs.ids``)."""
    from crl_gym.envs import make

    return make(env_id, **env.kwargs_for(env_id))


def raw_env_factory(env: EnvConfig) -> RawEnvFactory:
    """:func:`make_raw_env` of the section ``env``, as an ``env_id -> env`` factory."""
    return partial(make_raw_env, env)


def seed_texts(cfg: TrainConfig) -> tuple[str, ...]:
    """The texts of the seed entries that a run of ``cfg`` puts in its bank (those of its envs)."""
    return tuple(text for text, _ in cfg.experience.seeds_for(cfg.env.ids))


def tokenizer_texts(
    env: EnvConfig,
    raw_env: RawEnvFactory,
    actor_texts: tuple[str, ...] = (),
    *,
    seed_entries: tuple[str, ...] = (),
) -> list[str]:
    """The tiny preset's tokenizer corpus: what the envs of ``env.ids`` show, and every prompt the
    models read (``actor_texts``, the extractor's templates, ``experience.seed_entries``)."""
    from crl_train.policy.tiny import gather_env_texts

    envs = [raw_env(env_id) for env_id in env.ids]
    try:
        texts = gather_env_texts(envs, [], seeds=(0, 1), steps=4)
    finally:
        for e in envs:
            e.close()
    # What every guided prompt carries (the wrapper's header, the seed entries) and the JSON the
    # extractor's schemas force (op, advice and Merge skeletons): BPE merges the most
    # frequent pairs, so these are weighed like the observations they ride with. Seen once, they
    # would stay near one token per character, and a prompt or a structured answer would take far
    # more tokens than a real tokenizer gives the same text.
    carried = [
        GUIDED_OBSERVATION_TEMPLATE.format(experience="", observation=""),
        *example_answers(),
        *seed_entries,
    ]
    return (
        texts
        + [
            *actor_texts,
            DISTILLATION_TEMPLATE,
            REFINEMENT_TEMPLATE,
            MERGE_TEMPLATE,
            "accept refine reject",
        ]
        + carried * CARRIED_TEXT_WEIGHT
    )


__all__ = [
    "CARRIED_TEXT_WEIGHT",
    "RawEnvFactory",
    "make_raw_env",
    "raw_env_factory",
    "seed_texts",
    "tokenizer_texts",
]
