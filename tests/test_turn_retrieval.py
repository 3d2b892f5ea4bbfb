"""Per-turn retrieval (``ExperienceWrapper(retrieve=...)``), its credit, and the warm-up.

Real bank, manager and hashing embedder throughout; the service's credit is checked against
numbers worked out by hand.
"""

from __future__ import annotations

import pytest

from crl_gym.clients import LocalClient
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.service import ClosedStep
from crl_gym.protocol import (
    DistillationRequest,
    ExperienceRef,
    Trajectory,
    TurnGuidance,
    guiding_entries,
)
from crl_gym.wrappers.examples import CorridorEnv
from crl_gym.wrappers.experience import ExperienceWrapper
from crl_train.service.credit import credited_entries, step_credits

EMB = HashingEmbedder(64)


def _client(texts: list[str]) -> tuple[LocalClient, ExperienceManager]:
    bank = ExperienceBank(None, dim=64)
    for t in texts:
        bank.add(t, EMB.encode([t])[0])
    manager = ExperienceManager(bank, EMB)
    return LocalClient(manager), manager


def _play(env: ExperienceWrapper, actions: list[str], condition: str = "guided", step: int | None = 0,
          ) -> tuple[list[str], DistillationRequest]:
    obs, info = env.reset(seed=0, options={"experience": condition, "rollout_step": step})
    seen = [obs]
    for a in actions:
        obs, _, term, trunc, info = env.step(a)
        seen.append(obs)
        if term or trunc:
            break
    req = info["distillation_request"]
    assert isinstance(req, DistillationRequest)
    return seen, req


def test_turn_mode_searches_before_every_turn_and_records_each_entry() -> None:
    client, manager = _client(["Walk east along the corridor.", "The exit is east of cell 1."])
    env = ExperienceWrapper(CorridorEnv(length=3), client, retrieve="turn")
    seen, req = _play(env, ["east", "east", "east"])
    # turns 0, 1, 2 were guided (the observation after the last step ends the episode: no search)
    assert [o.startswith("Experience for this step") for o in seen] == [True, True, True, False]
    assert [g.turn for g in req.turn_experience] == [0, 1, 2]
    assert req.experience is None and req.condition == "guided"
    # the recorded trajectory holds the env's own observations, not the injected text
    assert req.trajectory.initial_observation.startswith("You are at cell 0")
    assert all(not s.observation.startswith("Experience") for s in req.trajectory.steps)
    # each shown text is the text of the entry recorded for that turn
    for obs, g in zip(seen, req.turn_experience, strict=False):
        assert obs.splitlines()[1] == g.entry.text
    assert manager.stats()["requests"] == 3  # one search per guided turn, through the manager
    manager.close()


def test_episode_mode_is_the_default_and_searches_once() -> None:
    client, manager = _client(["Walk east along the corridor."])
    env = ExperienceWrapper(CorridorEnv(length=2), client)
    seen, req = _play(env, ["east", "east"])
    assert seen[0].startswith("Experience from similar tasks") and not seen[1].startswith("Experience")
    assert req.turn_experience == [] and req.experience is not None
    assert "turn_experience" not in req.to_dict()  # episode-level requests keep their old form
    assert manager.stats()["requests"] == 1
    manager.close()


def test_both_shows_the_episode_entry_and_a_turn_entry_first() -> None:
    client, manager = _client(["Walk east along the corridor.", "The exit is east."])
    env = ExperienceWrapper(CorridorEnv(length=2), client, retrieve="both")
    seen, req = _play(env, ["east", "east"])
    assert seen[0].startswith("Experience for this step") and "Experience from similar tasks" in seen[0]
    assert req.experience is not None and [g.turn for g in req.turn_experience] == [0, 1]
    manager.close()


def test_free_episodes_never_search_per_turn() -> None:
    client, manager = _client(["Walk east."])
    env = ExperienceWrapper(CorridorEnv(length=2), client, retrieve="turn")
    seen, req = _play(env, ["east", "east"], condition="free")
    assert not any(o.startswith("Experience") for o in seen) and req.turn_experience == []
    assert manager.stats()["requests"] == 0
    manager.close()


def test_a_failed_turn_search_costs_the_turn_its_entry_only() -> None:
    client, manager = _client(["Walk east."])
    env = ExperienceWrapper(CorridorEnv(length=3), client, retrieve="turn")
    env.reset(seed=0, options={"experience": "guided"})
    manager.close()  # the manager is gone: every later search raises
    obs, *_ = env.step("east")
    assert obs.startswith("You are at cell 1") and env.error_count == 1


def test_turn_requests_round_trip_through_json() -> None:
    client, manager = _client(["Walk east."])
    env = ExperienceWrapper(CorridorEnv(length=2), client, retrieve="turn")
    _, req = _play(env, ["east", "east"])
    back = DistillationRequest.from_json(req.to_json())
    assert back.turn_experience == req.turn_experience and len(back.turn_experience) == 2
    with pytest.raises(ValueError, match=r"turn_experience\[0\]\.turn"):
        DistillationRequest.from_dict({**req.to_dict(), "turn_experience": [{"turn": -1, "entry": {"id": 1, "text": "x"}}]})
    manager.close()


def test_warmup_runs_guided_copies_free_until_its_step() -> None:
    client, manager = _client(["Walk east."])
    env = ExperienceWrapper(CorridorEnv(length=1), client, retrieve="both", warmup_steps=5)
    for step in (0, 4):
        obs, info = env.reset(seed=0, options={"experience": "guided", "rollout_step": step})
        assert info["experience"] is None and info["experience_warmup"] and not obs.startswith("Experience")
        req = env.step("east")[4]["distillation_request"]
        assert req.condition == "free" and req.turn_experience == []
    assert manager.stats()["requests"] == 0  # nothing was searched during the warm-up
    obs, info = env.reset(seed=0, options={"experience": "guided", "rollout_step": 5})
    assert info["experience"] is not None and "experience_warmup" not in info
    manager.close()


def _ref(i: int) -> ExperienceRef:
    return ExperienceRef(i, f"entry {i}")


def _request(ok: bool, episode: int | None, turns: list[int], seed: int = 0) -> DistillationRequest:
    return DistillationRequest(task="t", trajectory=Trajectory(), outcome=float(ok), success=ok,
                               experience=_ref(episode) if episode is not None else None, condition="guided",
                               env_id="e", seed=seed, rollout_step=0,
                               turn_experience=[TurnGuidance(t, _ref(i)) for t, i in enumerate(turns)])


def test_an_entry_is_credited_once_per_episode_it_guided() -> None:
    # episode A (won): entry 7 at the start and at turns 0..3, entry 8 at turn 4 -> 7 once, 8 once
    # episode B (lost): entry 8 at three turns, entry 9 at one -> 8 once, 9 once
    # episode C (won): entry 9 at turn 0
    a = _request(True, 7, [7, 7, 7, 7, 8])
    b = _request(False, None, [8, 8, 9, 8], seed=1)
    c = _request(True, None, [9], seed=2)
    assert credited_entries(a) == [7, 8] and credited_entries(b) == [8, 9]
    assert [e.id for e in guiding_entries(a)] == [7, 8]
    credits = {cr.entry_id: cr.reward for cr in step_credits(ClosedStep(0, [a, b, c]))}
    # r̄(7) = +1 (A); r̄(8) = (+1 − 1)/2 = 0 (A, B); r̄(9) = (−1 + 1)/2 = 0 (B, C)
    assert credits == {7: 1.0, 8: 0.0, 9: 0.0}
    # were turns counted, r̄(8) would be (1 − 3)/4 = −0.5 and r̄(9) (−1 + 1)/2: the per-episode rule differs
    c2 = _request(True, None, [9, 9, 9], seed=2)
    assert {cr.entry_id: cr.reward for cr in step_credits(ClosedStep(0, [b, c2]))} == {8: -1.0, 9: 0.0}


def test_the_bank_logs_one_episode_per_entry_per_episode() -> None:
    from crl_train.service import ExperienceService, ServiceOptions

    bank = ExperienceBank(None, dim=64)
    ids = [bank.add(t, EMB.encode([t])[0]) for t in ("walk east", "avoid the wall")]
    service = ExperienceService(ExperienceManager(bank, EMB), None, ServiceOptions(extractor=False))
    closed = ClosedStep(0, [_request(True, None, [ids[0], ids[0], ids[1]]), _request(False, None, [ids[0]], seed=1)])
    service._log_credits(closed, step_credits(closed))  # what a service with an extractor does at end_step
    # entry 1: two episodes (+1, −1) -> r̄ 0 over 2; entry 2: one won episode -> r̄ 1 over 1
    assert bank.credit_stats(ids) == {ids[0]: (0.0, 2), ids[1]: (1.0, 1)}
    service.close()


def test_the_request_of_a_cut_episode_keeps_its_turn_entries() -> None:
    """The episode driver cuts at the turn cap; the wrapper's request carries both turns'
    entries."""
    from crl_gym.episode import EpisodeDriver, EpisodeSpec

    client, manager = _client(["Walk east along the corridor."])
    env = ExperienceWrapper(CorridorEnv(length=5), client, retrieve="turn")
    driver = EpisodeDriver(env, max_turns=1)
    first = driver.reset(EpisodeSpec("corridor", 0, "guided", rollout_step=0))
    assert first.startswith("Experience for this step")
    assert driver.step("<action>east</action>") is None  # the turn cap cut it
    ep = driver.episode
    assert ep is not None and ep.cut == "turn_cap" and ep.request is not None
    req = ep.request
    assert req.meta["turn_cap"] is True and req.success is False and req.rollout_step == 0
    assert [(g.turn, g.entry.text) for g in req.turn_experience] == [(0, "Walk east along the corridor."),
                                                                      (1, "Walk east along the corridor.")]
    assert [(g.turn, g.entry.text) for g in ep.turn_experience] == [
        (g.turn, g.entry.text) for g in req.turn_experience]
    assert credited_entries(req) == [req.turn_experience[0].entry.id]
    manager.close()


def test_the_runner_own_request_is_deprecated() -> None:
    from crl_train.rollout.runner import Episode, RolloutRunner

    ep = Episode(group=0, condition="guided", env_id="corridor", seed=0, task="t")
    with pytest.warns(DeprecationWarning, match="own_request"):
        # reads only the episode
        req = RolloutRunner.own_request(None, ep)  # type: ignore[arg-type]
    assert (req.success, req.condition, req.task) == (False, "guided", "t")


def test_k_entries_per_episode_are_shown_together_and_each_credited_once() -> None:
    client, manager = _client(["Walk east along the corridor.", "The exit is at the east end.", "Go east."])
    env = ExperienceWrapper(CorridorEnv(length=1), client, entries_per_episode=2)
    obs, info = env.reset(seed=0, options={"experience": "guided"})
    first, more = info["experience"], info["experience_more"]
    assert len(more) == 1 and more[0]["id"] != first["id"]  # the recency penalty spread the two
    assert first["text"] in obs and more[0]["text"] in obs
    req = env.step("east")[4]["distillation_request"]
    assert [(g.turn, g.entry.id) for g in req.turn_experience] == [(0, more[0]["id"])]
    assert credited_entries(req) == [first["id"], more[0]["id"]]
    with pytest.raises(ValueError, match="entries_per_episode"):
        ExperienceWrapper(CorridorEnv(length=1), client, entries_per_episode=0)
    manager.close()


def test_the_runner_searches_every_guided_turn_of_a_step_in_one_batch() -> None:
    from _trainer_fixtures import tiny_policy

    from crl_train.rollout.runner import RolloutRunner

    client, manager = _client(["Walk east along the corridor.", "The exit is at the east end."])
    runner = RolloutRunner(
        tiny_policy(0),
        lambda env_id: ExperienceWrapper(CorridorEnv(length=9, max_turns=5), client, env_id=env_id, retrieve="turn",
                                         defer_turn_search=True),
        client=client, group_size=4, max_turns=4, max_new_tokens=4, constrained=True, episode_search=False)
    episodes = runner.collect([("corridor", 0), ("corridor", 1)], step=0)
    guided = [ep for ep in episodes if ep.condition == "guided"]
    assert len(guided) == 4 and all(ep.turns == 4 for ep in episodes)  # length 9: every episode hits the cap
    stats = manager.stats()
    # 4 searches at reset (turn 0, one per guided env), then turns 1-3 in one batch of 4 each; the
    # observation after turn 4 is never shown (the cap ends the episodes), so it is not searched for
    assert stats["requests"] == 4 + 3 * 4 and stats["batches"] <= 4 + 3
    for ep in guided:
        assert [g.turn for g in ep.request.turn_experience] == [0, 1, 2, 3]  # type: ignore[union-attr]
    assert all(ep.request.turn_experience == [] for ep in episodes if ep.condition == "free")  # type: ignore[union-attr]
    runner.close()
    manager.close()
