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
from crl_gym.clients.keeping import KeepingClient
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
    assert refs[0] is not None and refs[1] is not None
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
    env = ExperienceWrapper(CorridorEnv(length=1), KeepingClient(client, spill_path=spill))
    ids = []
    for seed in range(2):
        env.reset(seed=seed, options={"experience": "guided"})
        ids.append(env.step("east")[4]["distillation_request"].request_id)
    lines = spill.read_text().splitlines()
    assert [DistillationRequest.from_dict(json.loads(x)).request_id for x in lines] == ids
    assert len(env.unsent) == 0


def test_spill_path_on_the_wrapper_still_works_deprecated(manager: Any, tmp_path: Any) -> None:
    client = CountingClient(LocalClient(manager))
    client.down = True
    spill = tmp_path / "old.jsonl"
    with pytest.warns(DeprecationWarning, match="KeepingClient"):
        env = ExperienceWrapper(CorridorEnv(length=1), client, spill_path=spill, max_unsent=3)
    env.reset(seed=0, options={"experience": "guided"})
    request = env.step("east")[4]["distillation_request"]
    assert env.spill_path == spill and env.max_unsent == 3
    [line] = spill.read_text().splitlines()
    assert DistillationRequest.from_json(line).request_id == request.request_id


def test_a_keeping_client_is_the_outbox_and_its_client_searches(manager: Any) -> None:
    client = CountingClient(LocalClient(manager))
    keeping = KeepingClient(client, max_unsent=2)
    env = ExperienceWrapper(CorridorEnv(length=1), keeping)
    assert env.outbox is keeping and env.client is client and env.max_unsent == 2
    with pytest.raises(ValueError, match="belong to the KeepingClient"):
        ExperienceWrapper(CorridorEnv(length=1), keeping, max_unsent=5)


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
    assert env.spec is not None
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
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert found is not None, "no python block in the five-line section"
    code = found.group(1)
    monkeypatch.chdir(tmp_path)  # the example writes runs/bank
    scope: dict[str, Any] = {}
    exec(compile(code, "docs/wrappers.md", "exec"), scope)
    assert scope["info"]["search_and_ask"]["status"] in ("answered", "no_entry")
    assert (tmp_path / "runs" / "bank").is_dir()
    scope["manager"].close()


# ---------------------------------------------------------------- non-text input, rejected requests
class JsonClient:
    """Serialises every request as the HTTP client does (json.dumps raises on non-JSON values)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.submitted = 0

    def search(self, query: str) -> ExperienceRef | None:
        return None

    def submit(self, request: DistillationRequest) -> None:
        self.submitted += 1
        self.manager.submit(DistillationRequest.from_json(json.dumps(request.to_dict())))


class BytesIO(gym.Wrapper):
    """Takes bytes (or numpy text) actions and gives bytes observations; any integer seed."""

    def reset(self, *, seed: Any = None, options: dict[str, Any] | None = None) -> Any:
        obs, info = self.env.reset(seed=None if seed is None else int(seed), options=options)
        return obs.encode(), info

    def step(self, action: Any) -> Any:
        text = bytes(action).decode() if isinstance(action, (bytes, bytearray)) else str(action)
        obs, reward, term, trunc, info = self.env.step(text)
        return obs.encode(), reward, term, trunc, info


class AnyAction(gym.Wrapper):
    """Steps the inner env with ``east`` whatever the action is (so any value reaches the recorder)."""

    def step(self, action: Any) -> Any:
        return self.env.step("east")


def test_non_text_actions_and_observations_are_converted_at_episode_end(manager: Any) -> None:
    import numpy as np

    client = JsonClient(manager)
    env = ExperienceWrapper(BytesIO(CorridorEnv(length=3)), client, env_id="bytes")
    env.reset(seed=np.int64(4))  # type: ignore[arg-type]  # a numpy seed on purpose
    for action in (np.str_("west"), b"east", np.bytes_(b"east")):
        *_, info = env.step(action)
    info = env.step(bytearray(b"east"))[4]
    req = info["distillation_request"]
    assert env.rejected_count == 0 and env.error_count == 0 and "experience_error" not in info
    [got] = manager.get_requests(10, 0.5)  # it survived JSON, as it would over HTTP
    assert got.request_id == req.request_id and got.seed == 4 and type(req.seed) is int
    raw = CorridorEnv(length=3).reset(seed=4)[0]
    assert req.trajectory.initial_observation == raw and type(req.trajectory.initial_observation) is str
    assert [s.action for s in req.trajectory.steps] == ["west", "east", "east", "east"]
    assert all(type(s.action) is str and type(s.observation) is str for s in req.trajectory.steps)
    assert req.task == "Walk east 3 times to reach the exit of the corridor."
    # numpy scalars and undecodable bytes
    env2 = ExperienceWrapper(AnyAction(CorridorEnv(length=2)), client)
    env2.reset(seed=0)
    env2.step(np.int64(3))
    req2 = env2.step(b"\xffeast")[4]["distillation_request"]
    assert [s.action for s in req2.trajectory.steps] == ["3", "\ufffdeast"]
    assert manager.get_requests(10, 0.5)[0].request_id == req2.request_id


def test_a_value_with_no_text_form_is_refused_and_later_episodes_go_through(manager: Any) -> None:
    import numpy as np

    client = JsonClient(manager)
    env = ExperienceWrapper(AnyAction(CorridorEnv(length=1)), client)
    for action, named in ((np.array([1, 2]), "the action of turn 1 is a numpy.ndarray of shape (2,), not text"),
                          (None, "the action of turn 1 is None, not text"),
                          (object(), "the action of turn 1 is an object, not text")):
        env.reset(seed=0)
        info = env.step(action)[4]
        assert info["distillation_request"] is None and named in info["experience_error"]
    assert env.rejected_count == 3 and client.submitted == 0 and not env.unsent and env.error_count == 0
    env.reset(seed=1)
    info = env.step("east")[4]
    assert "experience_error" not in info and client.submitted == 1
    assert [r.request_id for r in manager.get_requests(10, 0.5)] == [info["distillation_request"].request_id]

    class NoneObservation(gym.Wrapper):
        def step(self, action: Any) -> Any:
            obs, *rest = self.env.step(action)
            return (None, *rest)

    env = ExperienceWrapper(NoneObservation(CorridorEnv(length=2)), client)
    env.reset(seed=0)
    env.step("east")
    info = env.step("east")[4]
    assert "the observation after turn 1 is None, not text" in info["experience_error"]
    assert env.rejected_count == 1 and info["distillation_request"] is None


def test_a_reward_that_is_not_a_number_refuses_the_request_without_raising(manager: Any) -> None:
    class NoneReward(gym.Wrapper):
        def step(self, action: Any) -> Any:
            obs, _, term, trunc, info = self.env.step(action)
            return obs, None, term, trunc, info

    env = ExperienceWrapper(NoneReward(CorridorEnv(length=1)), LocalClient(manager))
    env.reset(seed=0)
    info = env.step("east")[4]
    assert info["distillation_request"] is None and "record is malformed (TypeError" in info["experience_error"]
    assert env.rejected_count == 1 and manager.pending() == 0


class RejectingClient(CountingClient):
    """Rejects the requests of some seeds as malformed (what a 4xx or a failed json.dumps raises)."""

    def __init__(self, inner: Any, reject_seeds: set[int], error: type[Exception] = ValueError) -> None:
        super().__init__(inner)
        self.reject_seeds, self.error = reject_seeds, error

    def submit(self, request: DistillationRequest) -> None:
        self._hit("submit")
        if request.seed in self.reject_seeds:
            raise self.error(f"experience server rejected the request (422): seed {request.seed}")
        self.inner.submit(request)


def test_a_request_the_client_rejects_is_logged_counted_and_not_retried(
    manager: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    client = RejectingClient(LocalClient(manager), {1})
    env = ExperienceWrapper(CorridorEnv(length=1), client)
    env.reset(seed=1)
    info = env.step("east")[4]
    assert env.rejected_count == 1 and not env.unsent and env.error_count == 0
    assert "was rejected (ValueError: experience server rejected" in info["experience_error"]
    assert "rejected so far: 1" in caplog.text
    env.reset(seed=2)
    second = env.step("east")[4]["distillation_request"]
    assert client.calls["submit"] == 2  # the rejected one was not tried again
    assert [r.request_id for r in manager.get_requests(10, 0.5)] == [second.request_id]
    assert env.episodes_submitted == 1


def test_a_kept_request_rejected_on_retry_does_not_block_the_ones_behind_it(manager: Any) -> None:
    client = RejectingClient(LocalClient(manager), {0}, error=TypeError)
    env = ExperienceWrapper(CorridorEnv(length=1), client)
    client.down = True  # an outage: both requests are kept, in order
    for seed in (0, 1):
        env.reset(seed=seed)
        env.step("east")
    assert len(env.unsent) == 2 and env.error_count == 2 and env.rejected_count == 0
    client.down = False
    ids = []
    for seed in (2, 3):
        env.reset(seed=seed)
        ids.append(env.step("east")[4]["distillation_request"].request_id)
    # seed 0 is dropped at the first retry; seed 1 then the new ones follow, in order
    assert [r.seed for r in manager.get_requests(10, 0.5)] == [1, 2, 3]
    assert env.rejected_count == 1 and not env.unsent and env.episodes_submitted == 3


def test_an_auth_error_keeps_the_request_like_an_outage(manager: Any) -> None:
    from crl_gym.clients import ExperienceAuthError

    client = RejectingClient(LocalClient(manager), {0}, error=ExperienceAuthError)
    env = ExperienceWrapper(CorridorEnv(length=1), client)
    env.reset(seed=0)
    env.step("east")
    assert len(env.unsent) == 1 and env.rejected_count == 0 and env.error_count == 1


def test_numpy_values_over_http_do_not_block_later_requests(manager: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from crl_gym.clients import TOKEN_ENV, RemoteClient
    from crl_gym.server import BackgroundServer

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with BackgroundServer(manager) as server:
        env = ExperienceWrapper(AnyAction(CorridorEnv(length=1)), RemoteClient(server.url))
        env.reset(seed=0)
        env.step(np.int64(7))
        env.reset(seed=1)
        env.step("east")
        assert not env.unsent and env.error_count == 0 and env.episodes_submitted == 2
        env.client.flush()  # RemoteClient.submit buffers; the sender thread delivers
        got = manager.get_requests(10, 1.0)
    assert [(r.seed, r.trajectory.steps[0].action) for r in got] == [(0, "7"), (1, "east")]


def test_numpy_values_are_spilled_as_text_while_the_client_is_down(manager: Any, tmp_path: Any) -> None:
    import numpy as np

    client = CountingClient(LocalClient(manager))
    client.down = True
    spill = tmp_path / "unsent.jsonl"
    env = ExperienceWrapper(AnyAction(CorridorEnv(length=1)), KeepingClient(client, spill_path=spill))
    env.reset(seed=0)
    env.step(np.float32(0.5))
    [line] = spill.read_text().splitlines()
    assert DistillationRequest.from_json(line).trajectory.steps[0].action == "0.5"


# ------------------------------------------------------------------------------------ rollout_step
def test_rollout_step_option_reaches_the_request_and_not_the_env(manager: Any) -> None:
    import numpy as np

    seen: list[Any] = []

    class Spy(gym.Wrapper):
        def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
            seen.append(options)
            return self.env.reset(seed=seed, options=options)

    env = ExperienceWrapper(Spy(CorridorEnv(length=1)), JsonClient(manager))
    env.reset(seed=0, options={"experience": "guided", "rollout_step": 4})
    req = env.step("east")[4]["distillation_request"]
    assert req.rollout_step == 4 and DistillationRequest.from_json(req.to_json()).rollout_step == 4
    env.reset(seed=0, options={"rollout_step": np.int64(5), "level": 2})
    req = env.step("east")[4]["distillation_request"]
    assert req.rollout_step == 5 and type(req.rollout_step) is int
    env.reset(seed=0, options={"experience": "free"})
    assert env.step("east")[4]["distillation_request"].rollout_step is None
    assert seen == [None, {"level": 2}, None]
    assert [r.rollout_step for r in manager.get_requests(10, 0.5)] == [4, 5, None]
    for bad in ("3", True, 2.0):
        with pytest.raises(TypeError, match=r'options\["rollout_step"\]'):
            env.reset(seed=0, options={"rollout_step": bad})
    env.reset(seed=0, options={"rollout_step": -1})  # held out (evaluation): a step the service never credits
    assert env.step("east")[4]["distillation_request"].rollout_step == -1
