"""One dataset row = one task; guided or free decided per sample (OpenRLHF-free, for the
launcher too).

The launcher writes one row per task group of the run (``task_seeds`` of each step, the ``hf``
backend's seeds); the row's label is a :class:`TaskLabel`. All K samples of a row share that label,
so :class:`ConditionAssigner` tells them apart by the order they start in.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from crl_gym.protocol import Condition
from crl_train.rollout.contract import condition_of


@dataclass(frozen=True)
class TaskLabel:
    """What one dataset row asks for: an env id and a seed (``index`` keeps rows distinct).

    >>> TaskLabel.parse(TaskLabel("crl/MiniHack-Room-5x5-v0", 7, 3).encode())
    TaskLabel(env_id='crl/MiniHack-Room-5x5-v0', seed=7, index=3)
    """

    env_id: str
    seed: int
    index: int = 0

    def encode(self) -> str:
        return json.dumps(
            {"env_id": self.env_id, "seed": self.seed, "index": self.index}, sort_keys=True
        )

    @classmethod
    def parse(cls, label: Any) -> TaskLabel:
        try:
            d = json.loads(label) if isinstance(label, str) else dict(label)
            return cls(str(d["env_id"]), int(d["seed"]), int(d.get("index", 0)))
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(
                f'label {label!r} is not a task label ({{"env_id": ..., "seed": ...}}): {exc}'
            ) from None


class ConditionAssigner:
    """Guided for the first K/2 executions of a label, free for the next K/2, and so on.

    OpenRLHF starts the K samples of a prompt as K coroutines, in order, on one loop; each calls
    :meth:`assign` before its first ``await``, so the counts follow the sample order exactly. A
    label seen again (a second epoch) starts a new group of K.

    >>> a = ConditionAssigner(4)
    >>> [a.assign("task") for _ in range(6)]
    ['guided', 'guided', 'free', 'free', 'guided', 'guided']
    """

    def __init__(self, group_size: int, guided: bool = True) -> None:
        if group_size < 2 or group_size % 2:
            raise ValueError(f"group_size must be even and >= 2, got {group_size}")
        self.group_size, self.guided = group_size, guided
        self._seen: defaultdict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def assign(self, label: object) -> Condition:
        key = label if isinstance(label, str) else json.dumps(label, sort_keys=True, default=str)
        with self._lock:
            n = self._seen[key]
            self._seen[key] = n + 1
        return condition_of(n, self.group_size, guided=self.guided)


__all__ = ["ConditionAssigner", "TaskLabel"]
