"""Rollouts: groups of episodes run by one policy over wrapped envs (``runner``), and which tasks
and seeds a step runs (``tasks``)."""

from crl_train.rollout.runner import Episode, RolloutRunner, Turn, swap_prompt
from crl_train.rollout.tasks import eval_task_seeds, task_seeds

__all__ = ["Episode", "RolloutRunner", "Turn", "eval_task_seeds", "swap_prompt", "task_seeds"]
