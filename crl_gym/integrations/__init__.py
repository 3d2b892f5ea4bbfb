"""Adapters that let other RL libraries drive the wrapped envs and the experience service.

Each submodule imports its library itself; importing this package imports none of them.
``crl_gym.integrations.trl``: TRL's ``GRPOTrainer(environment_factory=...)`` (docs/wrappers.md).
``crl_gym.integrations.verl``: verl's agent loop ``crl_agent`` and the ``search_and_ask`` tool.
"""
