"""Gymnasium wrappers that make any text env experience-augmented.

* :class:`ExperienceWrapper` — guided/free episodes, trajectory recording, distillation requests.
* :class:`SearchAndAskWrapper` — the agent's ``search_and_ask[<query>]`` tool.
* :func:`wrap` — both, in the order that records the tool calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, Unpack

import gymnasium as gym

from crl_gym.clients.keeping import KeepingClient
from crl_gym.wrappers.experience import DEFAULT_TEMPLATE, ExperienceWrapper
from crl_gym.wrappers.search_and_ask import DEFAULT_PATTERN, SearchAndAskWrapper
from crl_gym.wrappers.success import SuccessRule

if TYPE_CHECKING:
    from crl_gym.clients import ExperienceClient


class ExperienceOptions(TypedDict, total=False):
    """:class:`ExperienceWrapper`'s keyword arguments besides the env and the client."""

    template: str
    task_key: str
    default_condition: str
    env_id: str | None
    spill_path: str | Path | None  # deprecated: a KeepingClient as the client
    max_unsent: int | None  # deprecated: a KeepingClient as the client
    success_reward: float | None
    success_rule: SuccessRule | None
    max_entry_chars: int


def wrap(
    env: gym.Env,
    client: ExperienceClient | KeepingClient[ExperienceClient],
    *,
    search_and_ask: bool = True,
    max_calls: int = 2,
    **experience_kwargs: Unpack[ExperienceOptions],
) -> ExperienceWrapper:
    """``ExperienceWrapper(SearchAndAskWrapper(env, client, max_calls), client,
    **experience_kwargs)``.

    The recorder goes outside so that it sees (and records) every ``search_and_ask`` turn. A
    :class:`~crl_gym.clients.keeping.KeepingClient` as ``client`` is the recorder's outbox; the
    tool asks the client inside it.

    >>> from crl_gym.wrappers.examples import CorridorEnv
    >>> class NoBank:  # any object with the ExperienceClient methods will do
    ...     def search(self, query): return None
    ...     def search_many(self, queries): return [None] * len(queries)
    ...     def ask(self, query, entry, context): return entry.text, None
    ...     def submit(self, request): pass
    >>> env = wrap(CorridorEnv(length=1), NoBank())
    >>> _ = env.reset(seed=0)
    >>> env.step("east")[4]["distillation_request"].success
    True
    """
    asker = client.client if isinstance(client, KeepingClient) else client
    inner = SearchAndAskWrapper(env, asker, max_calls=max_calls) if search_and_ask else env
    return ExperienceWrapper(inner, client, **experience_kwargs)


__all__ = [
    "DEFAULT_PATTERN",
    "DEFAULT_TEMPLATE",
    "ExperienceWrapper",
    "SearchAndAskWrapper",
    "wrap",
]
