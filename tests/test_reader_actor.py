"""The reader actor (``actor.model: reader``): it plays what its experience names, else seeded random.

Unit tests on hand-made prompts, then rollouts on crl/Recall-v0 through the real wrappers, then a
short ``crl-train`` run with the oracle extractor whose metrics and trajectories files show that a
guided episode of a task already solved always succeeds.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from crl_gym.clients import LocalClient  # noqa: E402
from crl_gym.envs import make  # noqa: E402
from crl_gym.envs.recall import RecallEnv  # noqa: E402
from crl_gym.experience.bank import ExperienceBank  # noqa: E402
from crl_gym.experience.embedders import HashingEmbedder  # noqa: E402
from crl_gym.experience.manager import ExperienceManager  # noqa: E402
from crl_gym.protocol import DistillationRequest, Step, Trajectory  # noqa: E402
from crl_gym.templates import EXPERIENCE_TEMPLATE, GUIDED_OBSERVATION_TEMPLATE, SYSTEM_CONSTRAINED  # noqa: E402
from crl_gym.wrappers.experience import ExperienceWrapper  # noqa: E402
from crl_train.config import ConfigError, ModelConfig, load_config  # noqa: E402
from crl_train.config.docs import config_reference  # noqa: E402
from crl_train.extractor.oracle import oracle_entry  # noqa: E402
from crl_train.methods import make_method  # noqa: E402
from crl_train.policy.base import TokenSequence, TrainBatch  # noqa: E402
from crl_train.policy.checkpoint import verify_checkpoint  # noqa: E402
from crl_train.policy.factory import build_policy, trains  # noqa: E402
from crl_train.policy.reader import ReaderNotTrainable, ReaderPolicy, experience_section  # noqa: E402
from crl_train.rollout.runner import RolloutRunner  # noqa: E402

ACTIONS = ["north", "east", "south", "west"]


def _prompt(reader: ReaderPolicy, user: str, *answers: tuple[str, str]) -> list[int]:
    """A conversation as the runner builds it: system, first user turn, then (answer, next observation) turns."""
    ids = reader.apply_chat([{"role": "system", "content": SYSTEM_CONSTRAINED}, {"role": "user", "content": user}])
    for action, obs in answers:
        ids += [*reader.tokenizer.encode(action, add_special_tokens=False), reader.eos_token_ids[0]]
        ids += reader.chat.user_turn_ids(obs, after_eos=True)
    return ids


def _guided(entry: str, observation: str) -> str:
    return GUIDED_OBSERVATION_TEMPLATE.format(experience=entry, observation=observation)


# ------------------------------------------------------------------------------------ hand-made prompts


def test_it_plays_the_action_an_entry_names_with_log_prob_zero() -> None:
    reader = ReaderPolicy(seed=0)
    for entry, want in (("Go west first.", "west"), ("When stuck, SOUTH works; never north.", "south")):
        gen, = reader.generate([_prompt(reader, _guided(entry, "Task: x. Action 1 of 1?"))], 16, allowed=[ACTIONS])
        assert gen.text == want and gen.finish_reason == "stop"
        assert gen.logprobs == [0.0] * len(gen.token_ids) and gen.token_ids[-1] == reader.eos_token_ids[0]
    # the other guided template reads the same way
    gen, = reader.generate([_prompt(reader, EXPERIENCE_TEMPLATE.replace("{experience}", "Try east.")
                                    .replace("{observation}", "Task: x."))], 16, allowed=[ACTIONS])
    assert gen.text == "east" and reader.reads == 3 and reader.fallbacks == 0


def test_a_multi_action_entry_is_played_in_order_one_action_per_turn() -> None:
    reader = ReaderPolicy(seed=0)
    user = _guided("Winning actions, one per line:\nsouth\nsouth\neast", "Task: x. Action 1 of 3?")
    played: list[str] = []
    for _ in range(3):
        answers = [(a, f"Correct. Action {i + 2} of 3?") for i, a in enumerate(played)]
        gen, = reader.generate([_prompt(reader, user, *answers)], 16, allowed=[ACTIONS])
        played.append(gen.text)
    assert played == ["south", "south", "east"]
    # a fourth turn has no named action left: the seeded fallback plays
    gen, = reader.generate([_prompt(reader, user, *[(a, "?") for a in played])], 16, allowed=[ACTIONS])
    assert reader.fallbacks == 1 and gen.text in ACTIONS


def test_action_words_outside_the_experience_section_are_never_read() -> None:
    # the observation, the task text and the earlier turns all say north; the entry names nothing
    user = _guided("Nothing useful was learnt here.", "Task: north north. The answer is north, then north.")
    r0 = ReaderPolicy(seed=0)
    assert experience_section(str(r0.tokenizer.decode(_prompt(r0, user, ("north", "Correct: north."))))) == (
        "Nothing useful was learnt here.")
    # an entry followed by a blank line of its own: what comes after it is not read
    assert experience_section(str(r0.tokenizer.decode(_prompt(r0, _guided("Go east.\n\nSecret: north", "obs"))))) == "Go east."
    free = "Task: go north. North is right. Valid north."
    seen = set()
    for seed in range(12):
        reader = ReaderPolicy(seed=seed)
        for user_text in (user, free):  # guided without a named action, and a free episode
            gen, = reader.generate([_prompt(reader, user_text, ("north", "Correct: north is action 1."))], 16,
                                   allowed=[ACTIONS])
            seen.add(gen.text)
        assert reader.reads == 0 and reader.fallbacks == 2
    assert seen == set(ACTIONS)  # 24 uniform draws over 4 actions: a reader of the task would only play north


def test_fallback_actions_are_seeded_and_their_log_probs_are_the_uniform_choice() -> None:
    prompt = [_prompt(ReaderPolicy(seed=0), "Task: x. Action 1 of 1?")]

    def draws(seed: int, n: int = 40) -> list[str]:
        reader = ReaderPolicy(seed=seed)
        return [reader.generate(prompt, 16, allowed=[ACTIONS])[0].text for _ in range(n)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)  # equal on 40 uniform draws over 4 actions with probability 4^-40
    assert set(draws(3)) == set(ACTIONS)
    gen, = ReaderPolicy(seed=0).generate(prompt, 16, allowed=[ACTIONS])
    # the actions share no first byte: the whole log(1/4) sits on the first token, the rest are certain
    assert gen.logprobs[0] == pytest.approx(math.log(1 / 4)) and gen.logprobs[1:] == [0.0] * (len(gen.logprobs) - 1)
    # "north" and "now" share "no": first token 2/3 ("n"), then "o" certain, then 1/2 at "r" / "w"
    gen, = ReaderPolicy(seed=0).generate(prompt, 16, allowed=[["north", "now", "east"]])
    assert sum(gen.logprobs) == pytest.approx(math.log(1 / 3))
    if gen.text != "east":
        assert gen.logprobs[:3] == pytest.approx([math.log(2 / 3), 0.0, math.log(1 / 2)])


def test_without_listed_actions_it_reads_the_valid_actions_line_and_answers_in_tags() -> None:
    reader = ReaderPolicy(seed=0)
    gen, = reader.generate([_prompt(reader, _guided("Take west.", "Task: x.\nValid actions: north, west"))], 32)
    assert gen.text == "<action>west</action>"
    with pytest.raises(ValueError, match="no admissible actions"):
        reader.generate([_prompt(reader, "Task: x.")], 32)
    with pytest.raises(TypeError, match="listed actions only"):
        reader.generate([_prompt(reader, "Task: x.")], 32, allowed=[object()])  # type: ignore[list-item]


# ------------------------------------------------------------------------------------ never trained


def _seq() -> TokenSequence:
    seq = TokenSequence()
    seq.append_context([1, 2, 3])
    return seq


def test_it_is_never_trained_and_the_config_keeps_it_an_actor() -> None:
    reader = ReaderPolicy(seed=0)
    assert trains(ModelConfig(model="reader")) is False and trains(ModelConfig(model="tiny")) is True
    with pytest.raises(ReaderNotTrainable, match="no weights"):
        reader.train_objective([])
    with pytest.raises(ReaderNotTrainable):
        reader.logprobs(TrainBatch.from_sequences([_seq()], [0.0], reader.pad_token_id))
    assert load_config(None, ["actor.model=reader"]).actor.model == "reader"
    with pytest.raises(ConfigError, match="is an actor, not an extractor"):
        load_config(None, ["extractor.model=reader"])
    for bad in ("method=edge", "algo.self_distill=true", "algo.gate.enabled=true"):
        with pytest.raises(ConfigError, match="needs a model actor"):
            make_method(load_config(None, ["actor.model=reader", bad]))  # method=edge: checked by the method
    doc = {k.key: k.doc for k in config_reference()}["actor.model"]
    assert "reader" in doc and "never a default" in doc
    assert load_config(None, []).actor.model == "tiny"


def test_a_checkpoint_verifies_and_resumes_the_fallback_draws(tmp_path: Path) -> None:
    prompt = [_prompt(ReaderPolicy(seed=0), "Task: x.")]
    reader = build_policy(ModelConfig(model="reader"), None, loss_scale="none", seed=5, checkpoint=None, role="actor")
    assert isinstance(reader, ReaderPolicy)
    first = [reader.generate(prompt, 8, allowed=[ACTIONS])[0].text for _ in range(10)]
    reader.save(tmp_path / "actor")
    verify_checkpoint(tmp_path / "actor")  # the trainer's resume check
    rest = [reader.generate(prompt, 8, allowed=[ACTIONS])[0].text for _ in range(20)]
    back = build_policy(ModelConfig(model="reader"), None, loss_scale="none", seed=0, checkpoint=tmp_path / "actor")
    assert isinstance(back, ReaderPolicy) and back.fallbacks == 10
    assert [back.generate(prompt, 8, allowed=[ACTIONS])[0].text for _ in range(20)] == rest
    fresh = ReaderPolicy(seed=5)  # the uninterrupted sequence
    assert first + rest == [fresh.generate(prompt, 8, allowed=[ACTIONS])[0].text for _ in range(30)]


# ------------------------------------------------------------------------------------ on crl/Recall-v0


def test_on_recall_a_guided_episode_with_the_oracle_entry_plays_the_secret() -> None:
    kwargs = {"num_tasks": 8, "length": 3, "num_actions": 4}
    env = RecallEnv(num_tasks=8, length=3, num_actions=4)
    emb = HashingEmbedder(256)
    manager = ExperienceManager(ExperienceBank(None, dim=256), emb)
    secrets = {}
    for seed in range(8):
        env.reset(seed=seed)
        secrets[seed] = env.secret
        text = oracle_entry(DistillationRequest(env.task, Trajectory([Step("", a) for a in env.secret]), 1.0, True, None))
        manager.bank.add(text, emb.encode([text])[0])
    client = LocalClient(manager)
    reader = ReaderPolicy(seed=0)
    runner = RolloutRunner(reader, lambda env_id: ExperienceWrapper(make(env_id, **kwargs), client, env_id=env_id),
                           client=client, group_size=4, max_turns=6, constrained=True)
    try:
        eps = runner.collect([("crl/Recall-v0", seed) for seed in range(8)], guided=True, step=-1)
    finally:
        runner.close()
        manager.close()
    guided = [e for e in eps if e.condition == "guided"]
    assert len(guided) == 16 and all(e.success for e in guided)
    for e in guided:
        assert tuple(s.action for s in e.steps) == secrets[e.seed]
    free = [e for e in eps if e.condition == "free"]
    # free copies play the seeded fallback: (1/4)^3 each, so not every one of 16 succeeds
    assert sum(e.success for e in free) < len(free)


RUN = ["--set", "method=static_online", "--set", "actor.model=reader", "--set", "extractor.model=oracle",
       "--set", "env.ids=[crl/Recall-v0]", "--set", "env.kwargs={num_tasks: 4, length: 2, num_actions: 2}",
       "--set", "env.max_turns=4", "--set", "env.tasks_per_step=4", "--set", "env.group_size=8",
       "--set", "experience.seed_entries=[]", "--set", "experience.asynchronous=false",
       "--set", "manager.recency_window_s=0", "--set", "manager.diversity_lambda=0",
       "--set", "train.steps=6", "--set", "train.eval_episodes=0", "--set", "train.checkpoint_every=1000"]


def test_a_crl_train_run_with_the_oracle_succeeds_on_every_guided_episode_of_a_solved_task(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([str(Path(sys.executable).parent / "crl-train"), *RUN, "--out", str(tmp_path / "run"),
                           "--no-progress"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    requests = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    assert len(requests) == 6 * 4 * 8
    solved_before: dict[int, set[str]] = defaultdict(set)  # step -> tasks some episode solved at an earlier step
    by_step: dict[int, list[dict[str, object]]] = defaultdict(list)
    for r in requests:
        by_step[int(r["rollout_step"])].append(r)
    solved: set[str] = set()
    for step in sorted(by_step):
        solved_before[step] = set(solved)
        solved |= {str(r["task"]) for r in by_step[step] if r["success"]}
    seen = [r for r in requests if r["condition"] == "guided" and r["task"] in solved_before[int(r["rollout_step"])]]
    assert len(seen) >= 48  # most guided episodes after the first steps (a random pair wins 1/4 of the time)
    assert all(r["success"] for r in seen)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(6))
    for row in rows:  # a step whose four tasks were all solved before it: every guided episode succeeds
        if len(solved_before[row["step"]]) == 4:
            assert row["success_guided"] == 1.0
    assert any(len(solved_before[row["step"]]) == 4 for row in rows)
    assert all(row.get("actor_loss") is None for row in rows)  # never trained
