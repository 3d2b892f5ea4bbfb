"""The agent file OpenRLHF loads: ``--train.agent_func_path <this file>`` (the launcher passes it).

OpenRLHF executes this file by path in every vLLM engine actor and builds ``AgentExecutor()`` with
no arguments; everything it needs (config, the experience service's name) comes from the
``CRL_OPENRLHF_SETTINGS`` environment variable the launcher sets for the whole Ray job. The path
must exist on every node: install the project at the same location on each (as OpenRLHF itself).
The code lives in :mod:`crl_train.openrlhf.executor`.
"""

from crl_train.openrlhf.executor import AgentExecutor, CRLAgentInstance

AgentInstance = CRLAgentInstance
"""The per-episode instance, for OpenRLHF's own ``MultiTurnAgentExecutor(AgentInstance)``."""

__all__ = ["AgentExecutor", "AgentInstance"]
