"""The ``search_and_ask`` tool as a verl ``BaseTool`` (``verl.tools.base_tool``), for verl's own
``ToolAgentLoop`` (``agent_name: tool_agent``) or any loop that runs verl tools.

Declared in the YAML at ``actor_rollout_ref.rollout.multi_turn.tool_config_path``::

    tools:
      - class_name: crl_gym.integrations.verl.tool.SearchAndAskTool
        config: {type: native, service_url: http://127.0.0.1:8765, max_calls: 2}

(``tool_schema`` may be left out: :data:`TOOL_SCHEMA` is the default.) A call
``search_and_ask(query)`` is answered as ``SearchAndAskWrapper`` answers ``search_and_ask[<query>]``
(the same :func:`~crl_gym.wrappers.search_and_ask.retrieve_and_ask`): the best entry for the
query, refined by the service's extractor for the agent's situation (the last message of the
conversation), the raw entry when no extractor is attached. ``ToolAgentLoop`` makes and releases
an instance per call, so the cap of ``max_calls`` per trajectory is kept in the trajectory's
``agent_data.extra_fields["crl_search_calls"]``; each answered call's entry id is appended to
``extra_fields["crl_search_entries"]``. The tool's reward is 0. Under ``ToolAgentLoop`` no
episode is submitted for distillation (that loop has no env): the entries a trajectory used are
credited only through the episodes ``crl_agent`` submits (docs/wrappers.md, "From verl").
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from crl_gym.integrations.verl import verl_required

with verl_required(__name__):
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from crl_gym.integrations.verl.service import DEFAULT_TIMEOUT_S, service_client
from crl_gym.templates import (
    SEARCH_AND_ASK_ANSWER_TEMPLATE,
    SEARCH_AND_ASK_EMPTY_QUERY_TEMPLATE,
    SEARCH_AND_ASK_ERROR_TEMPLATE,
    SEARCH_AND_ASK_NO_ENTRY_TEMPLATE,
    SEARCH_AND_ASK_OVER_CAP_TEMPLATE,
)
from crl_gym.wrappers.search_and_ask import MAX_QUERY_CHARS, retrieve_and_ask

logger = logging.getLogger(__name__)

TOOL_NAME = "search_and_ask"
TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Ask the experience bank for advice when stuck; does not take a turn in the "
        "environment.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "What you are stuck on, in a sentence."}
            },
            "required": ["query"],
        },
    },
}
"""The tool's OpenAI function schema (the default when the YAML gives none)."""
CALLS_KEY, ENTRIES_KEY = "crl_search_calls", "crl_search_entries"
_TEMPLATES = {
    "answered": SEARCH_AND_ASK_ANSWER_TEMPLATE,
    "no_entry": SEARCH_AND_ASK_NO_ENTRY_TEMPLATE,
    "error": SEARCH_AND_ASK_ERROR_TEMPLATE,
    "over_cap": SEARCH_AND_ASK_OVER_CAP_TEMPLATE,
    "empty_query": SEARCH_AND_ASK_EMPTY_QUERY_TEMPLATE,
}


class SearchAndAskTool(BaseTool):
    """``search_and_ask(query)`` answered from ``crl-experience serve`` (module docstring).

    ``config`` keys: ``service_url`` (else ``$CRL_EXPERIENCE_URL``), ``token_file`` (else
    ``$CRL_EXPERIENCE_TOKEN``), ``max_calls`` (per trajectory, default 2), ``timeout_s``.
    """

    def __init__(
        self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None = None
    ) -> None:
        super().__init__(
            config, tool_schema or OpenAIFunctionToolSchema.model_validate(TOOL_SCHEMA)
        )
        self.client = service_client(
            config.get("service_url"),
            config.get("token_file"),
            timeout_s=float(config.get("timeout_s", DEFAULT_TIMEOUT_S)),
        )
        self.max_calls = int(config.get("max_calls", 2))
        if self.max_calls < 0:
            raise ValueError(f"max_calls must be >= 0, got {self.max_calls}")
        self.error_count = 0

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        query = str(parameters.get("query") or "").strip()[:MAX_QUERY_CHARS]
        agent_data = kwargs.get("agent_data")
        state: dict[str, Any] = agent_data.extra_fields if agent_data is not None else {}
        used = int(state.get(CALLS_KEY, 0))
        call = None
        if not query:
            status = "empty_query"
        elif used >= self.max_calls:
            status = "over_cap"
        else:
            state[CALLS_KEY] = used + 1
            status, call, failure = await asyncio.to_thread(
                retrieve_and_ask, self.client, query, _situation(agent_data), used
            )
            if failure is not None:
                self.error_count += 1
                logger.warning(
                    "search_and_ask %s failed: %s: %s (the trajectory continues)",
                    failure[0],
                    type(failure[1]).__name__,
                    failure[1],
                )
            if call is not None and call.entry is not None:
                state.setdefault(ENTRIES_KEY, []).append(call.entry.id)
        text = (
            _TEMPLATES[status]
            .format(
                query=query,
                answer=call.answer if call is not None else "",
                observation="",
                max_calls=self.max_calls,
            )
            .strip()
        )
        return (
            ToolResponse(text=text),
            0.0,
            {"status": status, "refined": bool(call is not None and call.refined)},
        )


def _situation(agent_data: object) -> str:
    """The last message's text: what the agent sees when it asks (the extractor tailors the
    answer to it)."""
    messages = getattr(agent_data, "messages", None) or []
    for message in reversed(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str) and content and message.get("role") != "assistant":
            return content
    return ""


__all__ = ["TOOL_NAME", "TOOL_SCHEMA", "SearchAndAskTool"]
