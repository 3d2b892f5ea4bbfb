"""Which (env id, seed) tasks a rollout step or an evaluation runs: the one place seeds are made.

Training step t runs ``env.tasks_per_step`` groups, group g on seed
``env.seed + t × tasks_per_step + g`` with the env ids taken round-robin; held-out evaluation uses
seeds from ``env.seed + env.eval_seed_offset``.

>>> from crl_train.config import EnvConfig
>>> env = EnvConfig(ids=("a", "b"), tasks_per_step=2)
>>> task_seeds(env, 3)
[('a', 6), ('b', 7)]
>>> eval_task_seeds(env, 3)
[('a', 1000000), ('b', 1000001), ('a', 1000002)]
"""

from __future__ import annotations

from crl_train.config import EnvConfig


def task_seeds(env: EnvConfig, step: int) -> list[tuple[str, int]]:
    """The task groups of training step ``step``."""
    first = step * env.tasks_per_step
    return [
        (env.ids[(first + g) % len(env.ids)], env.seed + first + g)
        for g in range(env.tasks_per_step)
    ]


def eval_task_seeds(env: EnvConfig, groups: int) -> list[tuple[str, int]]:
    """``groups`` held-out task groups (never used for training)."""
    return [(env.ids[g % len(env.ids)], env.seed + env.eval_seed_offset + g) for g in range(groups)]
