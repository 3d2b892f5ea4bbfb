"""Keep an actor on one node when the code that creates it only calls ``cls.remote(...)``.

OpenRLHF creates its trainer actors with ``PPOTrainer.remote(...)`` (no options). The trainer
reads the prompt dataset the launcher wrote on the head node, so the launcher hands OpenRLHF an
:class:`OnNode` instead: the same ``.remote`` call, with a hard node affinity.
"""

from __future__ import annotations

from typing import Any


class OnNode:
    """``actor_cls.remote(...)`` scheduled on ``node_id`` (hard affinity)."""

    def __init__(self, actor_cls: Any, node_id: str) -> None:
        self.actor_cls = actor_cls
        self.node_id = node_id

    def options(self, **kwargs: object) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        kwargs.setdefault(
            "scheduling_strategy", NodeAffinitySchedulingStrategy(node_id=self.node_id, soft=False)
        )
        return self.actor_cls.options(**kwargs)

    def remote(self, *args: object, **kwargs: object) -> Any:
        return self.options().remote(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # everything else is the actor class's
        if name in ("actor_cls", "node_id"):  # not set yet (copy / pickle probe a bare instance)
            raise AttributeError(name)
        return getattr(self.actor_cls, name)


__all__ = ["OnNode"]
