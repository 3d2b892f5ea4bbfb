"""A model directory as an agent of ``crl_gym``'s tools (the SWE-Bench task filter): the
project's policy backend behind ``agent(messages) -> reply``.

``crl_gym`` never imports this module: it finds it through the entry point group
:data:`crl_gym.envs.swebench.filter.MODEL_AGENT_GROUP` (``setup.cfg``), so its arrows point only
down (``tests/test_layering.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from crl_train.policy import HFPolicy

Messages = list[dict[str, str]]
Agent = Callable[[Messages], str]


def model_agent_factory(directory: Path, max_new_tokens: int) -> Callable[[], Agent]:
    """A factory of agents that answer with the model in ``directory`` (a checkpoint with a
    ``model/`` folder, or a Hugging Face model directory); one policy, loaded once, serves all."""
    is_checkpoint = (directory / "model").is_dir()
    policy = (
        HFPolicy.from_checkpoint(directory)
        if is_checkpoint
        else HFPolicy.from_pretrained(directory)
    )

    def agent(messages: Messages) -> str:
        ids = policy.chat.prompt_ids(messages)
        return str(policy.generate([ids], max_new_tokens)[0].text)

    return lambda: agent


__all__ = ["model_agent_factory"]
