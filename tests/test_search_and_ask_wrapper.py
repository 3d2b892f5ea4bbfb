"""SearchAndAskWrapper: interception without stepping, the per-episode cap, refinement (and
the raw-entry fallback), recording for credit, outages, custom formats and check_env."""

from __future__ import annotations

import doctest
from typing import Any

import pytest
from gymnasium.utils.env_checker import check_env

from crl_gym.clients import ExperienceUnavailable, LocalClient
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.protocol import DistillationRequest, ExperienceRef, ExtractorSample
from crl_gym.wrappers import ExperienceWrapper, SearchAndAskWrapper, wrap
from crl_gym.wrappers.examples import CorridorEnv

TIP = "When lost in a corridor, walk east: the exit is always east."
QUERY = "I walked west and I am lost in the corridor"


def make_manager(texts: tuple[str, ...] = (TIP, "Push boxes away from walls.")) -> Any:
    emb = HashingEmbedder(64)
    bank = ExperienceBank(None, dim=64)
    for text in texts:
        bank.add(text, emb.encode([text])[0])
    return ExperienceManager(bank, emb)


@pytest.fixture()
def manager() -> Any:
    m = make_manager()
    yield m
    m.close()


def test_call_does_not_step_the_env_and_answers_with_the_entry(manager: Any) -> None:
    env = SearchAndAskWrapper(CorridorEnv(length=3), LocalClient(manager))
    env.reset(seed=0)
    obs1, _, _, _, info1 = env.step("east")
    obs, reward, terminated, truncated, info = env.step(f"I am stuck. search_and_ask[{QUERY}]")
    assert env.unwrapped.turn == 1 and env.unwrapped.pos == 1  # the env was not stepped
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert obs == f"Answer to search_and_ask[{QUERY}]:\n{TIP}\n\n{obs1}"
    for key, value in info1.items():  # the env's info keys (its state is unchanged)
        assert info[key] == value
    sa = info["search_and_ask"]
    assert sa["status"] == "answered" and sa["query"] == QUERY and sa["calls_left"] == 1
    call = sa["call"]
    assert call.query == QUERY and call.answer == TIP and call.entry.text == TIP
    assert call.turn == 1 and call.refined is False and call.provenance is None
    # A normal action afterwards steps the env as usual.
    assert env.step("east")[0] == "You are at cell 2 of a corridor; the exit is at cell 3, to the east."


def test_cap_is_enforced_per_episode_without_stepping(manager: Any) -> None:
    env = SearchAndAskWrapper(CorridorEnv(length=3), LocalClient(manager))  # default cap 2
    env.reset(seed=0)
    statuses = [env.step(f"search_and_ask[{QUERY} {i}]")[4]["search_and_ask"] for i in range(3)]
    assert [s["status"] for s in statuses] == ["answered", "answered", "over_cap"]
    assert [s["calls_left"] for s in statuses] == [1, 0, 0]
    over_obs = env.step("search_and_ask[again]")[0]
    assert over_obs.startswith("search_and_ask refused: you have used all 2 calls")
    assert env.unwrapped.turn == 0
    env.reset(seed=0)  # a new episode gets its calls back
    assert env.step(f"search_and_ask[{QUERY}]")[4]["search_and_ask"]["status"] == "answered"
    capped = SearchAndAskWrapper(CorridorEnv(), LocalClient(manager), max_calls=0)
    capped.reset(seed=0)
    assert capped.step("search_and_ask[x]")[4]["search_and_ask"]["status"] == "over_cap"


def test_refiner_rewrites_the_entry_and_provenance_is_kept(manager: Any) -> None:
    seen: list[tuple[str, ExperienceRef, str]] = []

    def refiner(query: str, entry: ExperienceRef, context: str) -> tuple[str, ExtractorSample]:
        seen.append((query, entry, context))
        return f"Since you are at cell 0: {entry.text}", ExtractorSample(
            prompt="p", response="r", logprobs=[-0.5, -0.25], token_ids=[3, 4], prompt_token_ids=[1, 2], extractor_version=5
        )

    manager.refiner = refiner
    env = SearchAndAskWrapper(CorridorEnv(length=3), LocalClient(manager))
    obs0, _ = env.reset(seed=0)
    call = env.step(f"search_and_ask[{QUERY}]")[4]["search_and_ask"]["call"]
    assert seen[0][0] == QUERY and seen[0][1].text == TIP and seen[0][2] == obs0  # context = where it is
    assert call.answer == f"Since you are at cell 0: {TIP}" and call.refined is True
    assert call.provenance["logprobs"] == [-0.5, -0.25] and call.provenance["extractor_version"] == 5


def test_broken_refiner_falls_back_to_the_raw_entry(manager: Any) -> None:
    from crl_gym.clients import ASK_FALLBACKS

    def refiner(query: str, entry: ExperienceRef, context: str) -> tuple[str, None]:
        raise RuntimeError("extractor crashed")

    manager.refiner = refiner
    before = ASK_FALLBACKS["count"]
    env = SearchAndAskWrapper(CorridorEnv(), LocalClient(manager))
    env.reset(seed=0)
    call = env.step(f"search_and_ask[{QUERY}]")[4]["search_and_ask"]["call"]
    assert call.answer == TIP and call.refined is False
    assert ASK_FALLBACKS["count"] == before + 1 and "extractor crashed" in ASK_FALLBACKS["last_reason"]


def test_calls_are_recorded_in_the_trajectory_for_credit(manager: Any) -> None:
    env = wrap(CorridorEnv(length=2), LocalClient(manager))
    env.reset(seed=0, options={"experience": "guided"})
    actions = ["west", f"search_and_ask[{QUERY}]", "east", "search_and_ask[]", "east"]
    for a in actions:
        info = env.step(a)[4]
    req: DistillationRequest = info["distillation_request"]
    traj = req.trajectory
    assert [s.kind for s in traj.steps] == ["env", "search_and_ask", "env", "search_and_ask", "env"]
    assert [s.action for s in traj.steps] == actions
    assert traj.num_actions == 3 and req.success and req.outcome == 1.0
    assert len(traj.search_calls) == 1  # the empty query retrieved nothing, so no call to credit
    call = traj.search_calls[0]
    assert call.query == QUERY and call.turn == 1 and call.entry is not None
    assert traj.steps[1].reward == 0.0
    back = DistillationRequest.from_json(req.to_json())
    assert back.trajectory.search_calls[0].to_dict() == call.to_dict()
    assert [s.kind for s in back.trajectory.steps] == [s.kind for s in traj.steps]
    assert manager.get_requests(10, 0.5)[0].request_id == req.request_id


def test_empty_bank_and_empty_query() -> None:
    m = make_manager(())
    try:
        env = SearchAndAskWrapper(CorridorEnv(), LocalClient(m))
        obs0, _ = env.reset(seed=0)
        obs, _, _, _, info = env.step("search_and_ask[where is the exit]")
        assert info["search_and_ask"]["status"] == "no_entry" and info["search_and_ask"]["call"] is None
        assert obs.endswith(obs0) and "no relevant experience" in obs
        obs, _, _, _, info = env.step("search_and_ask[   ]")
        assert info["search_and_ask"]["status"] == "empty_query" and "needs a query" in obs
        assert env.calls_used == 1  # an empty query does not use up a call
    finally:
        m.close()


def test_client_down_answers_without_stepping() -> None:
    class Down:
        def search(self, query: str) -> None:
            raise ExperienceUnavailable("server gone")

    env = SearchAndAskWrapper(CorridorEnv(), Down())
    env.reset(seed=0)
    obs, reward, term, trunc, info = env.step("search_and_ask[help]")
    assert info["search_and_ask"]["status"] == "error" and "server gone" in info["experience_error"]
    assert env.unwrapped.turn == 0 and reward == 0.0 and not (term or trunc)
    assert env.error_count == 1


def test_ask_failure_still_returns_the_raw_entry(manager: Any) -> None:
    class AskDown(LocalClient):
        def ask(self, query: str, entry: ExperienceRef, context: str) -> tuple[str, None]:
            raise ExperienceUnavailable("ask timed out")

    env = SearchAndAskWrapper(CorridorEnv(), AskDown(manager))
    env.reset(seed=0)
    info = env.step(f"search_and_ask[{QUERY}]")[4]
    assert info["search_and_ask"]["call"].answer == TIP and "ask timed out" in info["experience_error"]


def test_custom_pattern_and_templates(manager: Any) -> None:
    env = SearchAndAskWrapper(
        CorridorEnv(), LocalClient(manager), pattern=r"^ASK\((.+)\)$", answer_template="HINT {answer}|{observation}"
    )
    obs0, _ = env.reset(seed=0)
    obs, _, _, _, info = env.step(f"ASK({QUERY})")
    assert obs == f"HINT {TIP}|{obs0}"
    # The default syntax is now an ordinary (invalid) env action: the env is stepped.
    obs, _, _, _, info = env.step("search_and_ask[x]")
    assert "search_and_ask" not in info and env.unwrapped.turn == 1 and obs.startswith("Invalid action")
    with pytest.raises(ValueError, match="needs a group named 'query'"):
        SearchAndAskWrapper(CorridorEnv(), None, pattern=r"(a)(b)")
    with pytest.raises(ValueError, match="answer_template uses unknown field"):
        SearchAndAskWrapper(CorridorEnv(), None, answer_template="{hint}")
    with pytest.raises(ValueError, match="max_calls"):
        SearchAndAskWrapper(CorridorEnv(), None, max_calls=-1)


def test_default_pattern_compiled_case_insensitive_still_matches(manager: Any) -> None:
    import re

    from crl_gym.wrappers.search_and_ask import DEFAULT_PATTERN

    # the literal pre-check for the default pattern must not skip a case-insensitive variant
    env = SearchAndAskWrapper(CorridorEnv(), LocalClient(manager), pattern=re.compile(DEFAULT_PATTERN, re.I))
    env.reset(seed=0)
    info = env.step(f"SEARCH_AND_ASK[{QUERY}]")[4]
    assert info["search_and_ask"]["status"] == "answered" and env.unwrapped.turn == 0


def test_ordinary_actions_pass_through_unchanged(manager: Any) -> None:
    raw, env = CorridorEnv(length=2), SearchAndAskWrapper(CorridorEnv(length=2), LocalClient(manager))
    assert raw.reset(seed=4) == env.reset(seed=4)
    for a in ["west", "search", "east", "east"]:
        assert raw.step(a) == env.step(a)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_check_env_passes(manager: Any) -> None:
    check_env(SearchAndAskWrapper(CorridorEnv(), LocalClient(manager)), skip_render_check=False)


def test_docstring_examples_run() -> None:
    import crl_gym.wrappers.search_and_ask as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_two_calls_in_one_action_take_the_first(manager: Any) -> None:
    env = SearchAndAskWrapper(CorridorEnv(length=3), LocalClient(manager))
    env.reset(seed=0)
    obs, _, _, _, info = env.step(f"search_and_ask[{QUERY}] and then search_and_ask[push boxes]")
    sa = info["search_and_ask"]
    assert sa["query"] == QUERY and sa["calls_left"] == 1  # one call, not a query spanning both
    assert obs.startswith(f"Answer to search_and_ask[{QUERY}]:\n{TIP}")
    info = env.step("search_and_ask[what does [x] mean?] search_and_ask[b]")[4]
    assert info["search_and_ask"]["query"] == "what does [x] mean?"  # brackets inside a query nest
    assert env.unwrapped.turn == 0


def test_a_query_as_long_as_the_context_is_capped(manager: Any) -> None:
    env = SearchAndAskWrapper(CorridorEnv(length=3), LocalClient(manager), max_query_chars=40)
    obs0, _ = env.reset(seed=0)
    runaway = "where is the exit " * 2000  # a generation that never closed its thought
    obs, _, _, _, info = env.step(f"search_and_ask[{runaway}]")
    query = info["search_and_ask"]["query"]
    assert query == runaway[:40].rstrip() and info["search_and_ask"]["call"].query == query
    assert obs == f"Answer to search_and_ask[{query}]:\n{TIP}\n\n{obs0}"
    with pytest.raises(ValueError, match="max_query_chars"):
        SearchAndAskWrapper(CorridorEnv(), None, max_query_chars=0)


class _SmallSpaceCorridor(CorridorEnv):
    """A corridor whose observations may hold at most 200 characters."""

    def __init__(self) -> None:
        super().__init__(length=3)
        from gymnasium import spaces

        from crl_gym.envs.base import TEXT_CHARSET

        self.observation_space = spaces.Text(max_length=200, min_length=0, charset=TEXT_CHARSET)


def test_the_current_observation_is_never_cut_off_by_the_echoed_query(manager: Any) -> None:
    env = SearchAndAskWrapper(_SmallSpaceCorridor(), LocalClient(manager))
    obs0, _ = env.reset(seed=0)
    long_query = "I am lost and I have walked up and down this corridor many times " * 5  # ~330 characters
    obs, _, _, _, info = env.step(f"search_and_ask[{long_query}]")
    assert info["search_and_ask"]["status"] == "answered"
    assert len(obs) <= 200 and env.observation_space.contains(obs)
    assert obs.endswith(f"\n\n{obs0}")  # the observation is whole; the echoed query was shortened
    assert obs.startswith("Answer to search_and_ask[I am lost")
    # when not even the template's own words fit beside it, the observation alone is returned
    tight = SearchAndAskWrapper(_SmallSpaceCorridor(), LocalClient(manager),
                                answer_template="{answer} " * 3 + "x" * 150 + "{observation}")
    tight.reset(seed=0)
    assert tight.step("search_and_ask[stuck]")[0] == obs0


def test_wrapping_an_object_that_is_not_a_gymnasium_env_names_the_adapter(manager: Any) -> None:
    class GemLike:
        def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
            return "start", {}

        def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
            return "end", 1.0, True, False, {}

    for wrapper in (SearchAndAskWrapper, ExperienceWrapper, wrap):
        with pytest.raises(TypeError, match=r"wraps a gymnasium.Env, got .*GemLike; .*"
                                            r"crl_gym.envs.gem_adapter.GEMEnv\(env=obj\)"):
            wrapper(GemLike(), LocalClient(manager))
    with pytest.raises(TypeError, match=r"make the env first: SearchAndAskWrapper\(crl_gym.envs.make\('crl/Sokoban-6x6-v0'\)"):
        SearchAndAskWrapper("crl/Sokoban-6x6-v0", LocalClient(manager))  # type: ignore[arg-type]
