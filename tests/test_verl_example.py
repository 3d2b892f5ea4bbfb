"""examples/verl/run_recall.sh's verl settings compose into verl's own config, pass verl's checks, and
name what this project registers (runs in the verl environment: ``make test-verl``).

The run itself needs a GPU (vLLM); scripts/gpu_check.sh runs it. Here: the script's overrides of
``python -m verl.trainer.main_ppo``, composed by hydra over verl's ``ppo_trainer`` config and
checked by verl's ``validate_config``; the trainer, estimator and setup hook they name resolve to
ours, and the hook registers ``crl_agent``.
"""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest
from _verl_fixtures import verl_config
from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
from verl.trainer.main_ppo import validate_config
from verl.trainer.ppo.core_algos import get_adv_estimator_fn
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.trainer.ppo.v1 import get_trainer_cls

from crl_train.integrations.verl import ComplementaryTrainer, split_subgroup_estimator

SCRIPT = Path(__file__).parents[1] / "examples" / "verl" / "run_recall.sh"
VALUES = {"$TRAIN": "/data/train.parquet", "$VAL": "/data/val.parquet", "$MODEL": "/model", "$N": "2",
          "$STEPS": "2", "$OUT": "/out", "$CRL_EXPERIENCE_URL": "http://127.0.0.1:8765"}


def script_overrides() -> list[str]:
    """The arguments the script gives ``python -m verl.trainer.main_ppo``, its variables filled in."""
    text = SCRIPT.read_text()
    command = text[text.index('"$PY" -m verl.trainer.main_ppo'):text.index('>"$OUT/verl.log"')]
    command = re.sub(r"`[^`]*`", "", command).replace("\\\n", " ")  # the `# crl` notes
    for name, value in VALUES.items():
        command = command.replace(f'"{name}"', value).replace(name, value)
    words = shlex.split(command)
    assert words[:3] == ["$PY", "-m", "verl.trainer.main_ppo"]
    return words[3:]


def test_the_example_configures_verl_with_ours() -> None:
    overrides = script_overrides()
    model = next(o for o in overrides if o.startswith("actor_rollout_ref.model.path="))
    cfg = verl_config(Path(model.split("=", 1)[1]), [o for o in overrides if o != model])
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert get_trainer_cls(cfg.trainer.v1.trainer_mode) is ComplementaryTrainer
    assert get_adv_estimator_fn(cfg.algorithm.adv_estimator) is split_subgroup_estimator
    assert cfg.trainer.use_v1 and cfg.crl.service_url == VALUES["$CRL_EXPERIENCE_URL"]
    assert cfg.actor_rollout_ref.rollout.agent.default_agent_loop == "crl_agent"
    assert cfg.actor_rollout_ref.actor.loss_agg_mode == "seq-mean-token-mean"

    module, _, name = cfg.ray_kwargs.ray_init.runtime_env.worker_process_setup_hook.rpartition(".")
    hook = getattr(importlib.import_module(module), name)
    with pytest.MonkeyPatch.context() as mp:
        mp.delitem(_agent_loop_registry, "crl_agent", raising=False)
        hook()
        assert _agent_loop_registry["crl_agent"]["_target_"].endswith("agent_loop.ExperienceAgentLoop")
