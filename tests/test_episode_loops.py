"""One episode, four loops: the same env, seed, condition and scripted model give byte-identical
prompts and identical distillation requests through our runner, OpenRLHF's executor, TRL's
environments and verl's agent loop (each driven at the level this project owns: the runner with a
scripted policy, OpenRLHF's ``CRLAgentInstance`` with a recording chat template, TRL's
``ExperienceEnv`` through its tools, verl's ``VerlEpisode``, what ``crl_agent`` plays).

What legitimately differs, and is compared apart: the system text of TRL (its model answers by
calling the ``take_action`` tool: ``SYSTEM_TOOLS``); the runner's place of an episode in its
group (``meta``, for per-group distillation); and a TRL episode that the model stopped (TRL's own
cap) carries no ``turn_cap`` flag.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym
import pytest
from _trainer_fixtures import LocalClient, manager

from crl_gym.episode import ACTIONS_LINE, EpisodeSpec, read_answer, system_text
from crl_gym.experience.service import RetrievalService
from crl_gym.integrations.trl import TRLExperience, dataset_rows
from crl_gym.integrations.verl.episode import VerlEpisode, row_spec
from crl_gym.integrations.verl.rows import task_rows
from crl_gym.protocol import GROUP_COPY, GROUP_SIZE, DistillationRequest
from crl_gym.wrappers import wrap
from crl_gym.wrappers.examples import CorridorEnv
from crl_gym.wrappers.experience import ExperienceWrapper
from crl_train.config import load_config
from crl_train.policy.base import Generation
from crl_train.rollout.runner import RolloutRunner

ENV_ID = "crl-test/LoopCorridor-v0"
ENTRY = "Walk east until the exit."
SEED = 3
if ENV_ID not in gym.registry:
    gym.register(
        ENV_ID,
        entry_point=CorridorEnv,
        kwargs={"length": 2, "max_turns": 50},
        disable_env_checker=True,
    )


def raw_env(env_id: str = ENV_ID) -> gym.Env:
    return gym.make(env_id)


class Played:
    """What one loop showed the model in one episode, and the request that came out."""

    def __init__(self, system: str, users: list[str], request: DistillationRequest | None) -> None:
        self.system, self.users, self.request = system, users, request


# ------------------------------------------------------------------------------ the four loops


class ScriptedPolicy:
    """The runner's policy, scripted: every answer is ``reply``; a prompt's and a user turn's ids
    index the texts recorded here, so each episode's texts come back from its own tokens."""

    eos_token_ids = [0]
    prefix_cache = False

    def __init__(self, reply: str) -> None:
        self.reply = reply
        self.texts: list[Sequence[Mapping[str, str]] | str] = []
        self.chat = self

    def _id(self, value: Sequence[Mapping[str, str]] | str) -> list[int]:
        self.texts.append(value)
        return [1000 + len(self.texts) - 1]

    def apply_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        return self._id([dict(m) for m in messages])

    def user_turn_ids(self, text: str, *, after_eos: bool = False) -> list[int]:
        return self._id(text)

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        allowed: Any = None,
        cache_keys: Any = None,
    ) -> list[Generation]:
        return [
            Generation(prompt_ids=list(p), token_ids=[7], logprobs=[-0.5], text=self.reply)
            for p in prompts
        ]

    def release_cache(self, keys: Any) -> None:
        pass


def via_runner(client: LocalClient, reply: str, condition: str, max_turns: int) -> Played:
    policy = ScriptedPolicy(reply)
    runner = RolloutRunner(
        policy,
        lambda env_id: ExperienceWrapper(
            raw_env(env_id), client, env_id=env_id, defer_turn_search=True
        ),
        client=client,
        group_size=2,
        max_turns=max_turns,
        max_new_tokens=4,
    )
    episodes = runner.collect([(ENV_ID, SEED)], step=0)
    (ep,) = [e for e in episodes if e.condition == condition]
    (first,) = ep.prompt_ids
    messages = policy.texts[first - 1000]
    assert isinstance(messages, list) and [m["role"] for m in messages] == ["system", "user"]
    users = [messages[1]["content"]]
    users += [str(policy.texts[t.context_ids[0] - 1000]) for t in ep.history if t.context_ids]
    runner.close()
    return Played(messages[0]["content"], users, ep.request)


class RecordingChat:
    """OpenRLHF's chat template, recording the messages and user turns it renders."""

    def __init__(self) -> None:
        self.messages: list[dict[str, str]] = []
        self.users: list[str] = []

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        self.messages = [dict(m) for m in messages]
        return "rendered"

    def user_turn_text(self, text: str, *, after_eos: bool = False) -> str:
        self.users.append(text)
        return text


def via_openrlhf(service: RetrievalService, reply: str, condition: str, max_turns: int) -> Played:
    from crl_train.openrlhf import executor as ex
    from crl_train.openrlhf.tasks import TaskLabel

    cfg = load_config(
        None, ["env.group_size=2", f"env.max_turns={max_turns}", "experience.search_and_ask=false"]
    )
    runtime = ex.EpisodeRuntime(cfg, LocalClient(service), env_factory=raw_env, env_threads=2)
    chat = RecordingChat()
    runtime.chat = lambda tokenizer: chat  # type: ignore[method-assign]

    async def play() -> ex.CRLAgentInstance:
        inst = ex.CRLAgentInstance(runtime, condition=condition, tokenizer=object())
        await inst.reset({"label": TaskLabel(ENV_ID, SEED).encode()})
        while not (await inst.step({"action_text": reply}))["done"]:
            pass
        return inst

    inst = asyncio.run(play())
    runtime.close()
    assert [m["role"] for m in chat.messages] == ["system", "user"]
    return Played(
        chat.messages[0]["content"], [chat.messages[1]["content"], *chat.users], inst.request
    )


def via_trl(client: LocalClient, reply: str, condition: str, max_turns: int) -> Played:
    session = TRLExperience(client, lambda: raw_env(), search_and_ask=False)
    env = session.environment_factory()
    row = dataset_rows([SEED], experience=condition)[0]
    users = [env.reset(**row)]
    for turn in range(1, max_turns + 1):  # TRL's own cap on tool calls: max_tool_calling_iterations
        shown = env.take_action(read_answer(reply).action)  # TRL parsed the tool call
        if env.request is not None or turn == max_turns:  # no answer follows: no prompt
            break
        users.append(shown)
    env.get_reward()
    return Played(row["prompt"][0]["content"], users, env.request)


def via_verl(client: LocalClient, reply: str, condition: str, max_turns: int) -> Played:
    row = task_rows([SEED], [condition], env_id=ENV_ID)[0]
    episode = VerlEpisode(
        wrap(raw_env(), client, search_and_ask=False, env_id=ENV_ID), max_turns=max_turns
    )
    messages = episode.start(row_spec(row["extra_info"], ENV_ID, 0), row["prompt"])
    users = [messages[-1]["content"]]
    while episode.answer(reply) is not None:
        users.append(episode.messages[-1]["content"])
    return Played(messages[0]["content"], users, episode.played.request)


# ------------------------------------------------------------------------------ the test


def comparable(
    request: DistillationRequest | None, *, drop: tuple[str, ...] = ()
) -> dict[str, Any]:
    assert request is not None
    out = request.to_dict()
    out.pop("request_id")
    out["meta"] = {
        k: v for k, v in (out.get("meta") or {}).items() if k not in (GROUP_COPY, GROUP_SIZE, *drop)
    }
    return out


@pytest.mark.parametrize(
    ("condition", "reply", "max_turns"),
    [
        ("guided", "I will walk. <action>east</action>", 6),  # the env ends it: a success
        ("free", "west", 2),  # unreadable answers; the turn cap cuts it
    ],
)
def test_four_loops_show_the_same_prompts_and_send_the_same_request(
    condition: str, reply: str, max_turns: int
) -> None:
    service = RetrievalService(manager((ENTRY,)))
    client = LocalClient(service)
    played = {
        "runner": via_runner(client, reply, condition, max_turns),
        "openrlhf": via_openrlhf(service, reply, condition, max_turns),
        "trl": via_trl(client, reply, condition, max_turns),
        "verl": via_verl(client, reply, condition, max_turns),
    }
    runner = played["runner"]
    # the prompts: the first user turn and every next one, byte for byte
    assert runner.users[0].endswith(f"{ACTIONS_LINE}east, west")
    assert (ENTRY in runner.users[0]) == (condition == "guided")
    assert len(runner.users) == (2 if condition == "guided" else max_turns)
    for name, p in played.items():
        assert p.users == runner.users, name
    # the system text: one per answer format (a tag in the reply, or TRL's tool call)
    assert runner.system == played["openrlhf"].system == played["verl"].system == system_text()
    assert played["trl"].system == system_text(tools=True)
    # the requests
    request = runner.request
    assert request is not None and request.condition == condition
    assert [s.action for s in request.trajectory.steps] == [read_answer(reply).action] * len(
        runner.users
    )
    if condition == "guided":
        assert (
            request.success and request.experience is not None and request.experience.text == ENTRY
        )
    else:
        assert not request.success and request.meta["turn_cap"] is True
    assert (request.meta[GROUP_COPY], request.meta[GROUP_SIZE]) == (
        0 if condition == "guided" else 1,
        2,
    )
    for name in ("openrlhf", "verl"):
        assert comparable(played[name].request) == comparable(request), name
    assert comparable(played["trl"].request) == comparable(request, drop=("turn_cap",))
    # the step each loop gave (OpenRLHF gives none: the service's open step, 0, was filled in)
    assert request.rollout_step == 0
    service.close()


def test_the_spec_is_the_reset_options_of_the_wrapper() -> None:
    spec = EpisodeSpec(
        ENV_ID, SEED, "guided", rollout_step=4, copy=1, group_size=4, meta={"gate": "x"}
    )
    assert spec.reset_options() == {
        "experience": "guided",
        "rollout_step": 4,
        "meta": {GROUP_COPY: 1, GROUP_SIZE: 4, "gate": "x"},
    }
    assert "prefetched" in EpisodeSpec(ENV_ID, SEED, searched=True).reset_options()
