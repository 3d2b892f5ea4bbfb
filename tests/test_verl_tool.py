"""verl's own ``ToolAgentLoop`` runs our ``search_and_ask`` tool against a real experience server.

Runs in the verl environment (``make test-verl``). verl's ``AgentLoopWorker``, built from verl's
composed config with the tool YAML of examples/verl (``multi_turn.tool_config_path``), runs verl's
``tool_agent`` loop; the tiny CPU actor (tests/_verl_fixtures.py) writes a Hermes tool call
``search_and_ask(query)`` every turn; verl parses it and calls the tool, which answers from a
``RetrievalService`` served over HTTP (``BackgroundServer``).

Asserted: the first call is answered with the bank's entry, in a tool turn the actor is not
trained on (mask 0); the second is refused by the per-trajectory cap (``max_calls: 1``); the
trajectory's ``crl_search_calls`` and ``crl_search_entries`` reach verl's batch.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import yaml
from _verl_fixtures import TOOL_CALL, CPUServer, save_tiny_actor, verl_config
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.protocol import DataProto

from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.service import RetrievalService
from crl_gym.integrations.verl.service import close_clients
from crl_gym.protocol import AddOp
from crl_gym.server import BackgroundServer

pytestmark = pytest.mark.slow

ENTRY = "Walk east first, then north."


def test_tool_agent_loop_calls_search_and_ask(tmp_path: Path) -> None:
    service = RetrievalService(ExperienceManager(ExperienceBank(None, dim=64), HashingEmbedder(64)))
    service.apply_ops([AddOp(ENTRY)])
    model, tokenizer = save_tiny_actor(tmp_path / "actor", replies=(TOOL_CALL,))
    try:
        with BackgroundServer(service) as server:
            tools = yaml.safe_load((Path(__file__).parents[1] / "examples" / "verl" / "tools.yaml").read_text())
            tools["tools"][0]["config"].update({"service_url": server.url, "max_calls": 1})
            tool_yaml = tmp_path / "tools.yaml"
            tool_yaml.write_text(yaml.safe_dump(tools))
            config = verl_config(tmp_path / "actor", [
                "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.prompt_length=128",
                "actor_rollout_ref.rollout.response_length=192",
                f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_yaml}",
                "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
                "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=500",
            ])
            worker = AgentLoopWorker(config, CPUServer(model, tokenizer, replies=(TOOL_CALL,)))
            prompt = [{"role": "user", "content": "You are in a corridor. Which way is the exit?"}]
            batch = DataProto(batch=None, non_tensor_batch={
                "raw_prompt": np.array([prompt], dtype=object), "agent_name": np.array(["tool_agent"], dtype=object),
                "index": np.arange(1), "uid": np.array(["u0"], dtype=object)})
            out = asyncio.run(worker.generate_sequences(batch))
    finally:
        close_clients()
        service.close()

    nt = out.non_tensor_batch
    assert nt["crl_search_calls"][0] == 1
    assert len(nt["crl_search_entries"][0]) == 1
    mask = out.batch["response_mask"][0].bool()
    length = int(out.batch["attention_mask"][0, -mask.numel():].sum())
    responses = out.batch["responses"][0]
    told = tokenizer.decode(responses[:length][~mask[:length]])
    assert ENTRY in told  # the first call's answer: in a tool turn, not trained on
    assert "refused" in told  # the second call: over the trajectory's cap of 1
    call_id = tokenizer.convert_tokens_to_ids(TOOL_CALL)
    assert responses[mask].tolist().count(call_id) == 3  # three assistant turns, each a call
