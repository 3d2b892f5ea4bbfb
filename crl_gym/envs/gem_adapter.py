"""Any ``gem-llm`` environment (``gem.make(env_id)``) as a ``crl/`` text env.

GEM envs already speak text (``reset(seed) -> (obs, info)``, ``step(action) -> (obs, reward,
terminated, truncated, info)``); this adapter adds what every ``crl/`` env has: Text spaces,
``info["task"]`` (the episode's first observation), ``info["success"]`` (reward of at least
``success_reward`` on the terminating turn, GEM's convention), a turn limit, ``ansi`` rendering,
seeding that reproduces an episode, and an invalid action that is a turn rather than an exception.
GEM is an optional extra: ``pip install 'complementary-rl[gem]'``.

>>> from crl_gym.envs.gem_adapter import GEMEnv
>>> env = GEMEnv("game:GuessTheNumber-v0-easy")      # doctest: +SKIP
>>> obs, info = env.reset(seed=0)                    # doctest: +SKIP
>>> obs, r, term, trunc, info = env.step("\\\\boxed{10}")  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from typing import Any

from crl_gym.envs.base import MAX_TEXT, TextEnv, to_charset
from crl_gym.envs.registry import GEM_USAGE, MissingEnvArgumentError
from crl_gym.json_types import EnvInfo, EnvOptions, JSONDict

log = logging.getLogger(__name__)

EXTRA = "gem"
INSTALL_HINT = f"pip install 'complementary-rl[{EXTRA}]'"


class GEMMissingError(ImportError):
    """``gem-llm`` is not installed."""


def _gem_make(env_id: str, **kwargs: object) -> Any:
    try:
        import gem
    except ImportError as exc:
        raise GEMMissingError(
            f"crl/GEM-v0 with env_id={env_id!r} needs the optional package 'gem-llm' ({exc}). "
            f"Install the extra: {INSTALL_HINT}"
        ) from exc
    return gem.make(env_id, **kwargs)


class GEMEnv(TextEnv):
    """Adapter from a GEM env to the ``crl/`` text-env conventions.

    Args:
        env_id: a GEM registry id such as ``"game:GuessTheNumber-v0-easy"``.
        env: an already-built object with GEM's interface (used instead of ``env_id``).
        max_turns: the adapter's own turn limit (GEM envs may end earlier by themselves).
        success_reward: a terminating turn with at least this reward counts as success
            (GEM's ``LanguageGameReward.success_reward`` is 1.0).
        **env_kwargs: passed to ``gem.make``.
    """

    def __init__(
        self,
        env_id: str | None = None,
        env: Any = None,
        max_turns: int = 30,
        render_mode: str | None = None,
        success_reward: float = 1.0,
        **env_kwargs: object,
    ) -> None:
        if env_id is None and env is None:
            raise MissingEnvArgumentError(f"GEMEnv needs {GEM_USAGE}")
        if env_id is not None and env is not None:
            raise ValueError(
                "give exactly one of env_id (a gem-llm id) or env (a GEM-style object), not both"
            )
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        self.env_id = env_id or type(env).__name__
        self.gem_env = env if env is not None else _gem_make(env_id, **env_kwargs)  # type: ignore[arg-type]
        for method in ("reset", "step"):
            if not callable(getattr(self.gem_env, method, None)):
                raise TypeError(f"{self.env_id}: a GEM env needs a callable {method}()")
        self.success_reward = success_reward
        self.task = ""
        self._done = True
        self._success = False
        self._invalid = False
        self.errors = 0
        """Exceptions raised by the wrapped env's ``step`` (turned into invalid-action turns)."""

    def reset(
        self, *, seed: int | None = None, options: EnvOptions | None = None
    ) -> tuple[str, EnvInfo]:
        super().reset(seed=seed)
        # GEM seeds Python's and numpy's global RNGs; deriving its seed from ours makes every
        # reset after a seeded one reproducible too
        gem_seed = int(self.np_random.integers(2**31 - 1))
        obs, info = self.gem_env.reset(seed=gem_seed)
        self.turn = 0
        self._done = False
        self._success = False
        self.task = str(obs)
        self._invalid = False
        return self._emit(str(obs)), self._info(info)

    def step(self, action: str) -> tuple[str, float, bool, bool, EnvInfo]:
        if self._done:
            return (
                self._emit("The episode is over; call reset()."),
                0.0,
                True,
                False,
                self._info({}),
            )
        self.turn += 1
        self._invalid = False
        try:
            obs, reward, terminated, truncated, info = self.gem_env.step(str(action))
        except Exception as exc:  # a GEM env that raises on bad input must not kill the rollout
            self.errors += 1
            log.warning(
                "%s raised on action %r: %r (counted as an invalid turn)", self.env_id, action, exc
            )
            self._invalid = True
            obs = self.invalid_action_observation(action, self._valid_actions(), prefix=f"{exc}. ")
            obs += "\n\n" + self._last_obs  # the view is unchanged: show it again
            reward, terminated, truncated, info = 0.0, False, False, {}
        reward = float(reward)
        terminated = bool(terminated)
        truncated = bool(truncated) or (not terminated and self.turn >= self.max_turns)
        if terminated or truncated:
            self._done = True
            self._success = bool(info.get("success", terminated and reward >= self.success_reward))
        return self._emit(str(obs)), reward, terminated, truncated, self._info(info)

    def _valid_actions(self) -> list[str]:
        getter = getattr(self.gem_env, "get_valid_actions", None)
        if callable(getter):
            try:
                return [str(a) for a in getter()]
            except Exception:  # optional GEM hook; absence of a list is not an error
                return []
        return []

    def _emit(self, obs: str) -> str:
        self._last_obs = to_charset(obs)[:MAX_TEXT]
        return self._last_obs

    def _info(self, gem_info: EnvInfo) -> JSONDict:
        info = dict(gem_info or {})
        info.update(
            task=self.task,
            turn=self.turn,
            success=self._success,
            gem_env_id=self.env_id,
            invalid_action=self._invalid,
        )
        valid = self._valid_actions()
        if valid:
            info["admissible_actions"] = valid
        return info

    def close(self) -> None:
        close = getattr(self.gem_env, "close", None)
        if callable(close):
            close()
