"""Our wrapped envs and the experience service inside verl 0.9.1 (``verl.experimental.agent_loop``).

* :mod:`~crl_gym.integrations.verl.agent_loop`: :class:`ExperienceAgentLoop`, registered as
  ``crl_agent``: one episode of a wrapped env per dataset row copy, the model reached through
  verl's ``server_manager``.
* :mod:`~crl_gym.integrations.verl.tool`: :class:`SearchAndAskTool`, the ``search_and_ask`` tool
  as a verl ``BaseTool`` (verl's own ``ToolAgentLoop`` runs it).
* :mod:`~crl_gym.integrations.verl.rows`: the dataset rows these read (no verl import).

The trainer side (split-subgroup advantages, ``end_step`` once per training step) is
``crl_train.integrations.verl``. Importing this package imports no verl module; the two
submodules that subclass verl's classes import verl themselves (docs/wrappers.md, "From verl").
"""
