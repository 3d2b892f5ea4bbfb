"""What a copy of a vector env keeps from its last explicit reset for the episodes it autoresets.

Gymnasium's vector envs reset a finished copy themselves, with ``reset()``: no seed, no options
(sync and async, ``NEXT_STEP`` and ``SAME_STEP``). Without a carry, every later episode of that
copy would run free, unseeded and outside the rollout step it was started for. The
:class:`~crl_gym.wrappers.ExperienceWrapper` therefore treats a reset with neither seed nor
options as the next episode of the last explicit one: it keeps that reset's condition
(``options["experience"]``; the copy's ``default_condition`` when it gave none), its
``rollout_step`` and ``meta``, and seeds the episode with :func:`episode_seed` of the explicit
seed and the episode's number, so a copy's autoreset episodes are the same on every run. A
prefetched entry and the env's own options are not kept (an autoreset episode searches for its
own task). An episode that ends after its rollout step was closed is late for the service,
which never credits it.

>>> carry = AutoresetCarry.after(7, {"experience": "guided", "rollout_step": 3, "prefetched": None})
>>> seed, options = carry.next_episode()
>>> seed == episode_seed(7, 1), options
(True, {'experience': 'guided', 'rollout_step': 3})
>>> carry.next_episode()[0] == episode_seed(7, 2) != seed
True
>>> AutoresetCarry.after(None, None).next_episode()
(None, None)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from crl_gym.json_types import EnvOptions

CARRIED_OPTIONS = ("experience", "rollout_step", "meta")
"""The wrapper's own reset options an autoreset episode keeps."""


def episode_seed(seed: int, episode: int) -> int:
    """The seed of the ``episode``-th autoreset episode after an explicit ``reset(seed=seed)``: a
    hash of both (``numpy.random.SeedSequence``), in ``[0, 2**31)``; different copies (seeds) and
    episodes get unrelated seeds."""
    state = np.random.SeedSequence([int(seed) % 2**63, int(episode)]).generate_state(
        1, dtype=np.uint32
    )
    return int(state[0]) >> 1


@dataclass
class AutoresetCarry:
    """The seed and the carried options of one explicit reset, and how many episodes followed it."""

    seed: int | None
    options: EnvOptions | None
    episodes: int = 0

    @classmethod
    def after(cls, seed: int | None, options: EnvOptions | None) -> AutoresetCarry:
        """The carry of an explicit ``reset(seed=seed, options=options)`` (options
        already checked)."""
        kept = {k: options[k] for k in CARRIED_OPTIONS if k in options} if options else {}
        return cls(seed, kept or None)

    def next_episode(self) -> tuple[int | None, EnvOptions | None]:
        """``(seed, options)`` of the next autoreset episode."""
        self.episodes += 1
        seed = None if self.seed is None else episode_seed(self.seed, self.episodes)
        return seed, dict(self.options) if self.options else None


__all__ = ["CARRIED_OPTIONS", "AutoresetCarry", "episode_seed"]
