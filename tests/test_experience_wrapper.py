"""ExperienceWrapper: guided/free resets, recording by reference, one request per episode,
pass-through of rewards and info, a client that is down, check_env and the docstring examples."""

from __future__ import annotations

import doctest
import json
from typing import Any

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

from crl_gym.clients import ExperienceUnavailable, LocalClient
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.protocol import DistillationRequest, ExperienceRef
from crl_gym.wrappers import ExperienceWrapper, SearchAndAskWrapper, wrap
from crl_gym.wrappers.examples import CorridorEnv

TIP = "Keep walking east until you reach the exit."


@pytest.fixture()
def manager() -> Any:
    emb = HashingEmbedder(64)
    bank = ExperienceBank(None, dim=64)
    for text in (TIP, "In Sokoban, never push a box into a corner.", "Read the scroll before the fight."):
        bank.add(text, emb.encode([text])[0])
    m = ExperienceManager(bank, emb)
    yield m
    m.close()


class CountingClient:
    """Wraps a client, counts calls, and can be switched off to simulate an outage."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: dict[str, int] = {"search": 0, "search_many": 0, "ask": 0, "submit": 0}
        self.down = False

    def _hit(self, name: str) -> None:
        self.calls[name] += 1
        if self.down:
            raise ExperienceUnavailable("simulated outage")

    def search(self, query: str) -> ExperienceRef | None:
        self._hit("search")
        return self.inner.search(query)

    def search_many(self, queries: list[str]) -> list[ExperienceRef | None]:
        self._hit("search_many")
        return self.inner.search_many(queries)

    def ask(self, query: str, entry: ExperienceRef, context: str) -> tuple[str, dict[str, Any] | None]:
        self._hit("ask")
        return self.inner.ask(query, entry, context)

    def submit(self, request: DistillationRequest) -> None:
        self._hit("submit")
        self.inner.submit(request)


def drain(manager: Any) -> list[DistillationRequest]:
    return manager.get_requests(1000, 0.5) if manager.pending() else []


def test_guided_reset_prepends_the_entry_and_keeps_info(manager: Any) -> None:
    client = CountingClient(LocalClient(manager))
    env = ExperienceWrapper(CorridorEnv(length=2), client, template="TIP: {experience}\n---\n{observation}")
    raw_obs, raw_info = CorridorEnv(length=2).reset(seed=3)
    obs, info = env.reset(seed=3, options={"experience": "guided"})
    assert client.calls["search"] == 1  # one search per guided reset
    assert info["experience"]["text"] == TIP
    assert set(info["experience"]) == {"id", "text", "version"}
    assert obs == f"TIP: {TIP}\n---\n{raw_obs}"
    for key, value in raw_info.items():  # the env's own info keys pass through
        assert info[key] == value
    assert "experience_error" not in info


def test_free_reset_changes_nothing_and_does_not_search(manager: Any) -> None:
    client = CountingClient(LocalClient(manager))
    env = ExperienceWrapper(CorridorEnv(length=2), client)
    raw_obs, _ = CorridorEnv(length=2).reset(seed=0)
    obs, info = env.reset(seed=0, options={"experience": "free"})
    assert obs == raw_obs and info["experience"] is None
    obs, info = env.reset(seed=0)  # no options: default_condition ("free")
    assert obs == raw_obs and info["experience"] is None
    assert client.calls["search"] == 0


def test_prefetched_entry_is_used_without_searching(manager: Any) -> None:
    client = CountingClient(LocalClient(manager))
    env = ExperienceWrapper(CorridorEnv(length=2), client)
    tasks = [CorridorEnv(length=2).reset(seed=s)[1]["task"] for s in range(4)]
    refs = client.search_many(tasks)  # the trainer's one batch for the whole group
    # The manager diversifies within a group, so the refs may differ; all are bank entries.
    assert client.calls["search_many"] == 1 and refs[0] is not None and refs[0].text == TIP
    assert all(r is not None and manager.bank.get(r.id).text == r.text for r in refs)
    obs, info = env.reset(seed=0, options={"experience": "guided", "prefetched": refs[0]})
    assert info["experience"] == refs[0].to_dict() and obs.startswith(f"Experience from similar tasks (use it if it helps):\n{TIP}\n\n")
    # A dict works too (options cross process boundaries), and an explicit None means
    # "the batch found nothing": no second search, no experience shown.
    obs, info = env.reset(seed=0, options={"experience": "guided", "prefetched": refs[1].to_dict()})
    assert info["experience"]["id"] == refs[1].id
    obs, info = env.reset(seed=0, options={"experience": "guided", "prefetched": None})
    assert info["experience"] is None and TIP not in obs
    assert client.calls["search"] == 0
    env.step("east")
    env.step("east")
    req = drain(manager)[-1]
    assert req.condition == "guided" and req.experience is None


def test_episode_is_recorded_by_reference_and_submitted_once(manager: Any) -> None:
    env = ExperienceWrapper(CorridorEnv(length=2), LocalClient(manager), env_id="corridor")
    obs0, _ = env.reset(seed=7, options={"experience": "guided"})
    actions = ["west", "jump", "east", "east"]
    infos, observations, rewards = [], [], []
    for a in actions:
        obs, reward, terminated, truncated, info = env.step(a)
        infos.append(info)
        observations.append(obs)
        rewards.append(reward)
    assert terminated and not truncated
    assert rewards == [0.0, 0.0, 0.0, 1.0]
    req = info["distillation_request"]
    assert manager.pending() == 1
    queued = manager.get_requests(10, 0.5)
    assert [r.request_id for r in queued] == [req.request_id]
    traj = req.trajectory
    # The trajectory holds the env's own view: the raw first observation (the entry is in
    # req.experience), each step's observation is the one the action was taken on.
    raw0 = CorridorEnv(length=2).reset(seed=7)[0]
    assert traj.initial_observation == raw0 and obs0 != raw0
    assert [s.observation for s in traj.steps] == [raw0, *observations[:-1]]
    assert [s.action for s in traj.steps] == actions
    assert [s.kind for s in traj.steps] == ["env"] * 4
    # References, not copies: the recorded info of a middle step is the env's own dict.
    assert traj.steps[1].info is infos[1]
    assert req.outcome == 1.0 and req.success is True
    assert req.condition == "guided" and req.experience is not None and req.experience.text == TIP
    assert req.task == "Walk east 2 times to reach the exit of the corridor."
    assert req.env_id == "corridor" and req.seed == 7
    # The request survives JSON (no cycle through info["distillation_request"]).
    assert DistillationRequest.from_json(req.to_json()).to_dict() == req.to_dict()
    # Stepping past the end without reset must not submit a second request.
    env.step("west")
    assert manager.pending() == 0


def test_rewards_and_info_keys_match_the_raw_env(manager: Any) -> None:
    raw, wrapped = CorridorEnv(length=3, max_turns=4), ExperienceWrapper(CorridorEnv(length=3, max_turns=4), LocalClient(manager))
    raw.reset(seed=1)
    wrapped.reset(seed=1, options={"experience": "guided"})
    for a in ["east", "west", "east", "fly"]:
        r_obs, r_rew, r_term, r_trunc, r_info = raw.step(a)
        w_obs, w_rew, w_term, w_trunc, w_info = wrapped.step(a)
        assert (w_obs, w_rew, w_term, w_trunc) == (r_obs, r_rew, r_term, r_trunc)
        assert {k: w_info[k] for k in r_info} == r_info
    assert r_trunc and set(w_info) - set(r_info) == {"distillation_request"}
    req = w_info["distillation_request"]
    assert req.success is False and req.outcome == 0.0 and len(req.trajectory) == 4


def test_success_falls_back_to_positive_return_without_info_success(manager: Any) -> None:
    class NoSuccessKey(gym.Wrapper):
        def step(self, action: Any) -> Any:
            obs, reward, term, trunc, info = self.env.step(action)
            info = {k: v for k, v in info.items() if k != "success"}
            return obs, reward, term, trunc, info

    env = ExperienceWrapper(NoSuccessKey(CorridorEnv(length=1)), LocalClient(manager))
    env.reset(seed=0)
    info = env.step("east")[4]
    assert info["distillation_request"].success is True  # return 1.0 > 0


def test_task_falls_back_to_the_first_observation(manager: Any) -> None:
    class NoTask(gym.Wrapper):
        def reset(self, **kw: Any) -> Any:
            obs, info = self.env.reset(**kw)
            return obs, {k: v for k, v in info.items() if k != "task"}

    env = ExperienceWrapper(NoTask(CorridorEnv(length=1)), LocalClient(manager))
    obs, _ = env.reset(seed=0)
    req = env.step("east")[4]["distillation_request"]
    assert req.task == obs


def test_other_reset_options_reach_the_env(manager: Any) -> None:
    seen: list[Any] = []

    class Spy(gym.Wrapper):
        def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
            seen.append(options)
            return self.env.reset(seed=seed, options=options)

    env = ExperienceWrapper(Spy(CorridorEnv()), LocalClient(manager))
    env.reset(seed=0, options={"experience": "guided", "level": 3})
    env.reset(seed=0, options={"experience": "free"})
    assert seen == [{"level": 3}, None]


def test_client_down_runs_free_and_keeps_the_request(manager: Any) -> None:
    client = CountingClient(LocalClient(manager))
    env = ExperienceWrapper(CorridorEnv(length=1), client)
    client.down = True
    raw_obs = CorridorEnv(length=1).reset(seed=0)[0]
    obs, info = env.reset(seed=0, options={"experience": "guided"})
    assert obs == raw_obs and info["experience"] is None
    assert "simulated outage" in info["experience_error"]
    info = env.step("east")[4]
    first = info["distillation_request"]
    assert first.condition == "free" and first.success  # the episode itself is never lost
    assert "experience_error" in info and len(env.unsent) == 1 and manager.pending() == 0
    client.down = False
    env.reset(seed=1, options={"experience": "guided"})
    second = env.step("east")[4]["distillation_request"]
    # The kept request goes first, then the new one; nothing is left behind.
    assert [r.request_id for r in manager.get_requests(10, 0.5)] == [first.request_id, second.request_id]
    assert len(env.unsent) == 0 and env.episodes_submitted == 2 and env.error_count == 2


def test_client_down_spills_requests_to_a_file(manager: Any, tmp_path: Any) -> None:
    client = CountingClient(LocalClient(manager))
    client.down = True
    spill = tmp_path / "spill" / "pending_requests.jsonl"
    env = ExperienceWrapper(CorridorEnv(length=1), client, spill_path=spill)
    ids = []
    for seed in range(2):
        env.reset(seed=seed, options={"experience": "guided"})
        ids.append(env.step("east")[4]["distillation_request"].request_id)
    lines = spill.read_text().splitlines()
    assert [DistillationRequest.from_dict(json.loads(x)).request_id for x in lines] == ids
    assert len(env.unsent) == 0


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match=r'options\["experience"\]'):
        ExperienceWrapper(CorridorEnv(), None).reset(options={"experience": "half"})
    with pytest.raises(ValueError, match="template uses unknown field"):
        ExperienceWrapper(CorridorEnv(), None, template="{tip} {observation}")
    with pytest.raises(ValueError, match="template must contain"):
        ExperienceWrapper(CorridorEnv(), None, template="{observation}")
    with pytest.raises(ValueError, match="default_condition"):
        ExperienceWrapper(CorridorEnv(), None, default_condition="sometimes")
    with pytest.raises(TypeError, match=r'options\["prefetched"\]'):
        ExperienceWrapper(CorridorEnv(), None).reset(options={"experience": "guided", "prefetched": 3})


def test_experience_text_is_fitted_to_the_observation_space() -> None:
    class Client:
        def search(self, query: str) -> ExperienceRef:
            return ExperienceRef(id=1, text="Go east \u2192 exit \U0001f600", version=2)

        def submit(self, request: DistillationRequest) -> None:
            pass

    env = ExperienceWrapper(CorridorEnv(), Client())
    obs, info = env.reset(seed=0, options={"experience": "guided"})
    assert env.observation_space.contains(obs) and "Go east ? exit ?" in obs
    assert info["experience"]["text"] == "Go east \u2192 exit \U0001f600"  # info keeps the original


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("condition", ["free", "guided"])
def test_check_env_passes(manager: Any, condition: str) -> None:
    check_env(wrap(CorridorEnv(), LocalClient(manager), default_condition=condition), skip_render_check=False)
    check_env(ExperienceWrapper(CorridorEnv(), LocalClient(manager)), skip_render_check=False)


def test_search_and_ask_outside_the_recorder_warns(manager: Any, caplog: pytest.LogCaptureFixture) -> None:
    client = LocalClient(manager)
    SearchAndAskWrapper(ExperienceWrapper(CorridorEnv(), client), client)
    assert "will not be recorded" in caplog.text


def test_docstring_examples_run() -> None:
    import crl_gym.wrappers as pkg
    import crl_gym.wrappers.examples as examples
    import crl_gym.wrappers.experience as experience
    import crl_gym.wrappers.recording as recording
    import crl_gym.wrappers.text_actions as text_actions

    for module in (pkg, examples, experience, recording, text_actions):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("env_id", ["crl/Sokoban-6x6-v0", "crl/MiniHack-Room-5x5-v0"])
def test_real_envs_wrapped_pass_check_env_and_record(manager: Any, env_id: str) -> None:
    if env_id.startswith("crl/MiniHack"):
        pytest.importorskip("minihack")
    client = LocalClient(manager)
    env = wrap(gym.make(env_id), client)
    check_env(env.unwrapped)
    check_env(env, skip_render_check=True)
    raw = gym.make(env_id)
    raw_obs, raw_info = raw.reset(seed=5)
    obs, info = env.reset(seed=5, options={"experience": "guided"})
    assert info["experience"] is not None and obs.endswith(raw_obs) and obs != raw_obs
    assert env.env_id == env_id
    # env.spec records the wrapper stack; rebuilding it shares the client (a handle), not a copy.
    rebuilt = gym.make(env.spec)
    assert isinstance(rebuilt, ExperienceWrapper) and rebuilt.client is client
    assert isinstance(rebuilt.env, SearchAndAskWrapper) and rebuilt.env.client is client
    rebuilt.close()
    actions = list(raw_info["admissible_actions"])
    for t in range(200):
        a = actions[t % len(actions)]
        r_out, w_out = raw.step(a), env.step(a)
        assert r_out[:4] == w_out[:4]  # same observation, reward, termination: nothing changed
        if w_out[2] or w_out[3]:
            break
    req = w_out[4]["distillation_request"]
    assert req.task == raw_info["task"] and req.env_id == env_id and req.seed == 5
    assert len(req.trajectory) == t + 1 and req.trajectory.initial_observation == raw_obs
    assert req.success == bool(w_out[4]["success"])
    assert DistillationRequest.from_json(req.to_json()).request_id == req.request_id
    env.close()
    raw.close()


def test_docs_five_line_example_runs(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import re
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "wrappers.md").read_text()
    section = doc.split("## Wrap your own text env in five lines", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    monkeypatch.chdir(tmp_path)  # the example writes runs/bank
    scope: dict[str, Any] = {}
    exec(compile(code, "docs/wrappers.md", "exec"), scope)
    assert scope["info"]["search_and_ask"]["status"] in ("answered", "no_entry")
    assert (tmp_path / "runs" / "bank").is_dir()
    scope["manager"].close()
