"""OpenRLHF's trainer actors with our advantages and the service's ``end_step`` (cluster only).

Ray forbids subclassing a ``@ray.remote`` class, so each subclass derives from the decorated
class's ``__ray_actor_class__`` and is decorated itself:

* :class:`CRLExperienceMaker` = :class:`~crl_train.openrlhf.advantages.SplitSubgroupAdvantageMixin`
  + OpenRLHF's ``RemoteExperienceMaker``; installed by both trainers below in place of the one
  ``BasePPOTrainer.__init__`` made (same arguments).
* sync mode: :data:`CRLPPOTrainer` (``PPOTrainer`` +
  :class:`~crl_train.openrlhf.steps.ServiceStepMixin`);
* async mode (``--train.async_enable``): :data:`CRLTrainingActor` (``TrainingActor`` + the same) and
  :data:`CRLPPOTrainerAsync`, whose ``__init__`` builds a :data:`CRLTrainingActor` where
  ``PPOTrainerAsync.__init__`` builds its ``TrainingActor`` (and keeps the sample generator,
  which reads the dataset, on its own node).

The launcher (``crl_train.openrlhf.launcher``) puts :data:`CRLPPOTrainer` /
:data:`CRLPPOTrainerAsync` in place of ``openrlhf.trainer.ppo_trainer.PPOTrainer`` /
``ppo_trainer_async.PPOTrainerAsync`` before it runs ``openrlhf.cli.train_ppo_ray`` as ``__main__``;
``train()`` imports them by module attribute at call time. Importing this module needs OpenRLHF's
CUDA stack (DeepSpeed, vLLM); the logic it adds lives in the two mixins, which are tested on CPU.
"""

from __future__ import annotations

from typing import Any

import ray
from openrlhf.trainer import ppo_trainer_async
from openrlhf.trainer.ppo_trainer import PPOTrainer
from openrlhf.trainer.ppo_trainer_async import PPOTrainerAsync, TrainingActor
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

from crl_train.openrlhf.advantages import SplitSubgroupAdvantageMixin
from crl_train.openrlhf.placement import OnNode
from crl_train.openrlhf.steps import ServiceStepMixin


class CRLExperienceMaker(SplitSubgroupAdvantageMixin, RemoteExperienceMaker):
    """OpenRLHF's experience maker with split-subgroup advantages."""


def install_experience_maker(trainer: Any) -> None:
    """Replace the maker ``BasePPOTrainer.__init__`` built with a :class:`CRLExperienceMaker`
    (same arguments)."""
    trainer.experience_maker = CRLExperienceMaker(
        trainer.actor_model_group,
        trainer.critic_model_group,
        trainer.reward_model_group,
        trainer.reference_model_group,
        trainer.kl_ctl,
        trainer.strategy,
        trainer.tokenizer,
    )


class _CRLPPOTrainer(ServiceStepMixin, PPOTrainer.__ray_actor_class__):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        install_experience_maker(self)
        self.crl_setup()


class _CRLTrainingActor(ServiceStepMixin, TrainingActor.__ray_actor_class__):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        install_experience_maker(self)
        self.crl_setup()


CRLPPOTrainer = ray.remote(_CRLPPOTrainer)
CRLTrainingActor = ray.remote(_CRLTrainingActor)


class _CRLPPOTrainerAsync(PPOTrainerAsync.__ray_actor_class__):
    def __init__(self, *args: object, **kwargs: object) -> None:
        # PPOTrainerAsync.__init__ looks its actor classes up in its module when it runs (in this
        # actor's own process): ours are put there for the duration of the call. The generator
        # reads the prompt dataset, so it stays on this (the head) node.
        node = ray.get_runtime_context().get_node_id()
        saved = ppo_trainer_async.TrainingActor, ppo_trainer_async.GenerateSamplesActor
        ppo_trainer_async.TrainingActor = CRLTrainingActor
        ppo_trainer_async.GenerateSamplesActor = OnNode(saved[1], node)
        try:
            super().__init__(*args, **kwargs)
        finally:
            ppo_trainer_async.TrainingActor, ppo_trainer_async.GenerateSamplesActor = saved


CRLPPOTrainerAsync = ray.remote(_CRLPPOTrainerAsync)

__all__ = [
    "CRLExperienceMaker",
    "CRLPPOTrainer",
    "CRLPPOTrainerAsync",
    "CRLTrainingActor",
    "install_experience_maker",
]
