"""Rollouts: K env copies per task with one seed, K/2 guided and K/2 free, one batched generation per turn.

Order of a rollout step (``RolloutRunner.collect``):

1. every free copy is reset with its task's seed; the task text comes from ``info["task"]``;
2. the guided halves are prefetched with ONE ``client.search_many`` over the task texts of all
   groups, then reset with ``options={"experience": "guided", "prefetched": entry}``;
3. all live episodes advance together: one ``policy.generate`` call per turn over every
   unfinished episode (constrained to ``info["admissible_actions"]`` through a token trie when
   ``constrained``), then one ``env.step`` each.

Every :class:`Episode` keeps its token ids, loss mask (1 only on the agent's own tokens), old
log-probs and constraints (a :class:`~crl_train.policy.base.TokenSequence`), its turn count, the
entry it saw and its distillation request.

**Context policy.** The actor's sequence is never cut in the middle: an episode whose next turn
(observation + ``max_new_tokens``) would exceed ``max_context_tokens`` ends there as a failure
(``context_truncated``). The recorded log-probs are then exactly those of the trained tokens.
Observations are shortened to ``max_obs_chars`` (middle elided) before tokenisation.

**Errors.** An env that raises in ``reset`` or ``step`` ends that episode as a failure with the
error in ``episode.info["error"]`` and in the log; the others continue.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from crl_gym.protocol import (
    FREE_CONDITION,
    GROUP_COPY,
    GROUP_SIZE,
    GUIDED_CONDITION,
    Condition,
    DistillationRequest,
    ExperienceRef,
    Step,
    TurnGuidance,
)
from crl_gym.templates import SEARCH_ACTION, SYSTEM_CONSTRAINED, SYSTEM_REACT
from crl_gym.wrappers.success import ended_success
from crl_train.policy.base import Generation, Policy, TokenSequence
from crl_train.policy.chat import parse_action
from crl_train.rollout.contract import condition_of
from crl_train.rollout.rules import MAX_OBS_CHARS, cut_request, shown_turn_entry, user_text

if TYPE_CHECKING:
    import gymnasium as gym

    from crl_gym.clients import ExperienceClient

log = logging.getLogger(__name__)

class EntryGate(Protocol):
    """What the runner asks of an entry gate (``crl_train.methods.gate.ActorCriticGate``)."""

    def judge(self, tasks: Sequence[str], entries: Sequence[ExperienceRef]) -> tuple[list[Any], float]:
        """A verdict per (task, entry) — with ``shown``, ``verdict`` and ``meta()`` — and the seconds taken."""
        ...

    def observe(self, tasks: Sequence[str], successes: Sequence[bool]) -> None:
        """A finished rollout step's outcomes."""
        ...


@dataclass
class Turn:
    """One generation and the context tokens that followed it (for rebuilding a sequence)."""

    generation: Generation
    context_ids: list[int]
    kind: str = "env"


@dataclass
class Episode:
    """One rollout of the batch."""

    group: int
    condition: Condition
    env_id: str
    seed: int
    sequence: TokenSequence = field(default_factory=TokenSequence)
    task: str = ""
    reward: float = 0.0
    success: bool = False
    turns: int = 0
    num_actions: int = 0
    experience: ExperienceRef | None = None
    request: DistillationRequest | None = None
    info: dict[str, Any] = field(default_factory=dict)
    done: bool = False
    prompt_ids: list[int] = field(default_factory=list)
    history: list[Turn] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    admissible: list[str] = field(default_factory=list)
    search_calls: int = 0
    request_meta: dict[str, Any] = field(default_factory=dict)
    """What the episode's request carries in ``meta`` besides the env's own: its place in its group
    (``GROUP_COPY``, ``GROUP_SIZE``: per-group distillation) and the gate's verdict."""
    turn_experience: list[TurnGuidance] = field(default_factory=list)
    """Entries per-turn retrieval showed (``info["turn_experience"]``), for the request of a cut episode."""

    @property
    def failed_by_error(self) -> bool:
        return "error" in self.info


class RolloutRunner:
    """Runs groups of episodes with one policy over a pool of (wrapped) envs.

    Args:
        policy: the actor (:class:`~crl_train.policy.base.Policy`).
        make_env: ``make_env(env_id) -> gym.Env`` already wrapped for experience when ``client``.
        client: an ExperienceClient (``search_many``), or None for runs without experience.
        group_size: K; guided copies are the first K/2 of each group.
        max_turns: trainer turn cap per episode.
        max_new_tokens / max_context_tokens: see the module docstring.
        constrained: restrict actions to the env's admissible actions.
        search_and_ask: offer the tool (constrained: as one fixed extra action).
        episode_search: prefetch the guided copies' entries for their task (False when the wrappers
            retrieve per turn only: ``experience.retrieve = turn``).
    """

    def __init__(
        self,
        policy: Policy,
        make_env: Callable[[str], Any],
        *,
        client: ExperienceClient | None = None,
        group_size: int = 8,
        max_turns: int = 30,
        max_new_tokens: int = 64,
        max_context_tokens: int = 4096,
        constrained: bool = False,
        search_and_ask: bool = False,
        max_obs_chars: int = MAX_OBS_CHARS,
        episode_search: bool = True,
    ) -> None:
        if group_size < 2 or group_size % 2:
            raise ValueError(f"group_size must be even and >= 2, got {group_size}")
        self.policy = policy
        self.make_env = make_env
        self.client = client
        self.group_size = group_size
        self.max_turns = max_turns
        self.max_new_tokens = max_new_tokens
        self.max_context_tokens = max_context_tokens
        self.constrained = constrained
        self.search_and_ask = search_and_ask
        self.max_obs_chars = max_obs_chars
        self.episode_search = episode_search
        self._pool: dict[str, list[Any]] = {}
        self.errors = 0
        self.context_truncations = 0
        self.malformed_tool_calls = 0
        """Cut-off or malformed ``search_and_ask`` calls answered as a tool error (status ``malformed``)."""
        self.search_failures = 0
        self.submit_failures = 0
        self.gate: EntryGate | None = None
        """Judges each guided episode's entry before it starts (the actor-critic gate), or None."""
        self.last_search_s = 0.0
        """Wall time of the last rollout step's batched search (s)."""
        self.eos_ids = set(policy.eos_token_ids)

    # ------------------------------------------------------------------ envs
    def _envs(self, env_id: str, n: int) -> list[Any]:
        pool = self._pool.setdefault(env_id, [])
        while len(pool) < n:
            pool.append(self.make_env(env_id))
        return pool[:n]

    def close(self) -> None:
        for pool in self._pool.values():
            for env in pool:
                try:
                    env.close()
                except Exception:  # noqa: BLE001 - closing is best effort
                    log.debug("env close failed", exc_info=True)
        self._pool.clear()

    # --------------------------------------------------------------- prompts
    def _system(self) -> str:
        return SYSTEM_CONSTRAINED if self.constrained else SYSTEM_REACT

    def _user_text(self, obs: object, admissible: Sequence[str]) -> str:
        return user_text(obs, admissible, constrained=self.constrained, max_obs_chars=self.max_obs_chars)

    def _start(self, ep: Episode, obs: object, info: dict[str, Any]) -> None:
        ep.task = str(info.get("task") or obs)
        ep.admissible = list(info.get("admissible_actions") or [])
        exp = info.get("experience")
        ep.experience = ExperienceRef.from_dict(exp) if isinstance(exp, dict) else None
        for more in info.get("experience_more") or ():  # entries_per_episode > 1: shown with the first observation
            ep.turn_experience.append(TurnGuidance(0, ExperienceRef(**more)))
        _note_turn_entry(ep, info, 0)
        ep.prompt_ids = self.policy.apply_chat(
            [{"role": "system", "content": self._system()}, {"role": "user", "content": self._user_text(obs, ep.admissible)}]
        )
        ep.sequence.append_context(ep.prompt_ids)

    def _fail(self, ep: Episode, where: str, exc: BaseException) -> None:
        self.errors += 1
        ep.info["error"] = f"{where}: {type(exc).__name__}: {exc}"
        ep.done, ep.success = True, False
        log.warning("episode env=%s seed=%s %s %s failed and ends as a failure: %s", ep.env_id, ep.seed, ep.condition, where, exc)

    # ----------------------------------------------------------------- collect
    def collect(self, tasks: Sequence[tuple[str, int]], *, guided: bool = True, step: int = 0) -> list[Episode]:
        """Run one rollout step: ``tasks`` = [(env_id, seed)] groups of K copies each.

        ``guided=False`` runs every copy free (GRPO, or evaluation without experience).
        """
        k = self.group_size
        episodes: list[Episode] = []
        envs: list[Any] = []
        need: dict[str, int] = {}
        for env_id, _ in tasks:
            need[env_id] = need.get(env_id, 0) + k
        taken: dict[str, int] = dict.fromkeys(need, 0)
        pools = {env_id: self._envs(env_id, n) for env_id, n in need.items()}
        for g, (env_id, seed) in enumerate(tasks):
            for c in range(k):
                cond = condition_of(c, k, guided=guided)
                episodes.append(Episode(group=g, condition=cond, env_id=env_id, seed=seed,
                                        request_meta={GROUP_COPY: c, GROUP_SIZE: k}))
                envs.append(pools[env_id][taken[env_id]])
                taken[env_id] += 1
        # 1. free copies first: they give the task text of each group
        task_text: dict[int, str] = {}
        for ep, env in zip(episodes, envs, strict=True):
            if ep.condition == FREE_CONDITION:
                self._reset(ep, env, {"experience": FREE_CONDITION, "rollout_step": step, "meta": ep.request_meta}
                            if self.client is not None else None)
                if not ep.failed_by_error:
                    task_text.setdefault(ep.group, ep.task)
        # 2. one batched search for all guided halves
        guided_groups = sorted({ep.group for ep in episodes if ep.condition == GUIDED_CONDITION})
        prefetched: dict[int, ExperienceRef | None] = {}
        if guided_groups and self.client is not None and self.episode_search:
            queries = [task_text.get(g, "") for g in guided_groups]
            t0 = time.perf_counter()
            try:
                refs = self.client.search_many(queries)
            except Exception as exc:  # noqa: BLE001 - a down manager costs guidance, not the step
                self.search_failures += 1
                log.warning("search_many failed (%s); guided copies run without experience", exc)
                refs = [None] * len(queries)
            self.last_search_s = time.perf_counter() - t0
            prefetched = dict(zip(guided_groups, refs, strict=True))
        judged = self._judge([ep for ep in episodes if ep.condition == GUIDED_CONDITION], prefetched, task_text)
        for ep, env in zip(episodes, envs, strict=True):
            if ep.condition == GUIDED_CONDITION:
                options: dict[str, Any] = {"experience": GUIDED_CONDITION, "rollout_step": step, "meta": ep.request_meta}
                if self.episode_search:
                    options["prefetched"] = prefetched.get(ep.group)
                if id(ep) in judged:
                    ep.request_meta["gate"] = judged[id(ep)].meta()
                    options.update(prefetched=judged[id(ep)].shown, meta=ep.request_meta)
                self._reset(ep, env, options)
        # 3. advance all together
        for ep in episodes:
            ep.info["rollout_step"] = step
        try:
            while True:
                live = [(ep, env) for ep, env in zip(episodes, envs, strict=True) if not ep.done]
                if not live:
                    break
                self._turn(live)
                # a finished episode's kept keys/values are not needed again
                self.policy.release_cache([id(ep) for ep, _ in live if ep.done])
        finally:
            self.policy.release_cache([id(ep) for ep in episodes])
        self._submit_unfinished(episodes, step)
        if self.gate is not None and step >= 0:  # held-out episodes do not move the actor's success rates
            done = [ep for ep in episodes if not ep.failed_by_error]
            self.gate.observe([ep.task for ep in done], [ep.success for ep in done])
        return episodes

    def _judge(self, guided: list[Episode], prefetched: dict[int, ExperienceRef | None],
               task_text: dict[int, str]) -> dict[int, Any]:
        """The gate's verdict for each guided episode that has an entry (by ``id(episode)``)."""
        pairs = [(ep, e) for ep in guided if (e := prefetched.get(ep.group)) is not None]
        if self.gate is None or not pairs:
            return {}
        verdicts, seconds = self.gate.judge([task_text.get(ep.group, "") for ep, _ in pairs], [e for _, e in pairs])
        out = {}
        for (ep, _), v in zip(pairs, verdicts, strict=True):
            ep.info["gate"] = v.verdict
            ep.info["gate_s"] = seconds / len(pairs)
            out[id(ep)] = v
        return out

    def _submit_unfinished(self, episodes: list[Episode], step: int) -> None:
        """Episodes the trainer cut (turn cap, context limit) got no request from their env: the
        runner writes and submits one, so the service sees every episode it can credit."""
        if self.client is None:
            return
        for ep in episodes:
            if ep.request is None and not ep.failed_by_error and ep.prompt_ids:
                ep.request = self.own_request(ep)
                ep.request.rollout_step = step
                try:
                    self.client.submit(ep.request)
                except Exception as exc:  # noqa: BLE001 - counted and logged; the step goes on
                    self.submit_failures += 1
                    log.warning("submit of a cut episode failed: %s", exc)

    def _reset(self, ep: Episode, env: gym.Env, options: dict[str, Any] | None) -> None:
        try:
            obs, info = env.reset(seed=ep.seed, options=options)
        except Exception as exc:  # noqa: BLE001 - see module docstring
            self._fail(ep, "reset", exc)
            return
        self._start(ep, obs, info)

    def _allowed(self, ep: Episode) -> list[str] | None:
        if not self.constrained:
            return None
        actions = list(ep.admissible)
        if self.search_and_ask and self.client is not None:
            actions.append(SEARCH_ACTION)
        return actions or None

    def _turn(self, live: list[tuple[Episode, Any]]) -> None:
        prompts = [ep.sequence.input_ids for ep, _ in live]
        allowed = [self._allowed(ep) for ep, _ in live]
        # a policy with a prefix cache encodes only each episode's new tokens (keys live until collect ends)
        keys = [id(ep) for ep, _ in live] if self.policy.prefix_cache else None
        gens = self.policy.generate(prompts, self.max_new_tokens, allowed=allowed if self.constrained else None,
                                    cache_keys=keys)
        stepped: list[tuple[Episode, Any, Generation, str, list[Any]]] = []
        for (ep, env), gen in zip(live, gens, strict=True):
            ep.sequence.append_generation(gen)
            action = gen.text.strip() if self.constrained else (parse_action(gen.text) or gen.text.strip())
            try:
                stepped.append((ep, env, gen, action, list(env.step(action))))
            except Exception as exc:  # noqa: BLE001 - see module docstring
                ep.history.append(Turn(gen, []))
                self._fail(ep, "step", exc)
        self._search_turns(stepped)
        for ep, _env, gen, action, (obs, reward, terminated, truncated, info) in stepped:
            kind = "search_and_ask" if info.get("search_and_ask") is not None else "env"
            if kind == "search_and_ask" and info["search_and_ask"].get("status") == "malformed":
                self.malformed_tool_calls += 1
            ep.turns += 1
            ep.num_actions += kind == "env"
            ep.search_calls += kind == "search_and_ask"
            ep.reward += float(reward)
            ep.steps.append(Step(observation="", action=action, reward=float(reward), kind=kind))  # type: ignore[arg-type]
            ep.admissible = list(info.get("admissible_actions") or ep.admissible)
            _note_turn_entry(ep, info, ep.turns)
            if terminated or truncated or ep.turns >= self.max_turns:
                ep.done = True
                req = info.get("distillation_request")
                if isinstance(req, DistillationRequest):
                    ep.request = req
                ep.success = ended_success(info, [s.reward for s in ep.steps], ep.env_id) if (terminated or truncated) else False
                if not (terminated or truncated):
                    ep.info["turn_cap"] = True
                ep.history.append(Turn(gen, [], kind))
                continue
            after_eos = bool(gen.token_ids) and gen.token_ids[-1] in self.eos_ids
            ctx = self.policy.chat.user_turn_ids(self._user_text(obs, ep.admissible), after_eos=after_eos)
            if len(ep.sequence) + len(ctx) + self.max_new_tokens > self.max_context_tokens:
                self.context_truncations += 1
                ep.info["context_truncated"] = True
                ep.done, ep.success = True, False
                ep.history.append(Turn(gen, [], kind))  # the history mirrors the sequence: no context was added
                continue
            ep.history.append(Turn(gen, list(ctx), kind))
            ep.sequence.append_context(ctx)

    def _search_turns(self, stepped: list[tuple[Episode, Any, Generation, str, list[Any]]]) -> None:
        """Per-turn retrieval of every env that asked for it (``info["turn_query"]``: its wrapper
        defers the search to us) in one ``search_many``; each env then shows its entry
        (``show_turn_entry``), which replaces the step's observation. An episode the turn cap ends
        now is not searched for: its next observation is never shown."""
        asked = [row for row in stepped if isinstance(row[4][4].get("turn_query"), str)
                 and row[0].turns + 1 < self.max_turns]
        if not asked or self.client is None:
            return
        try:
            refs: list[ExperienceRef | None] = list(self.client.search_many([row[4][4]["turn_query"] for row in asked]))
        except Exception as exc:  # noqa: BLE001 - a down manager costs the turns their entries, not the step
            self.search_failures += 1
            log.warning("per-turn search_many failed (%s); these turns run unguided", exc)
            refs = [None] * len(asked)
        for (_, env, _, _, result), ref in zip(asked, refs, strict=True):
            result[0] = env.get_wrapper_attr("show_turn_entry")(ref, result[4])

    def own_request(self, ep: Episode) -> DistillationRequest:
        """A request for an episode the env did not finish (turn cap / context cut)."""
        return cut_request(task=ep.task, steps=ep.steps, outcome=ep.reward, experience=ep.experience,
                           condition=ep.condition, env_id=ep.env_id, seed=ep.seed, reasons=ep.info,
                           meta=ep.request_meta, turn_experience=ep.turn_experience)


def _note_turn_entry(ep: Episode, info: dict[str, Any], turn: int) -> None:
    """Record the entry per-turn retrieval showed with this turn's observation, if any."""
    shown = shown_turn_entry(info, turn)
    if shown is not None:
        ep.turn_experience.append(shown)


def swap_prompt(ep: Episode, prompt_ids: Sequence[int], *, drop_search_turns: bool = False) -> TokenSequence:
    """``ep``'s own turns behind another first prompt (the same first observation with or without
    the experience), rebuilt from its history (which mirrors its sequence turn by turn).

    EDGE's teacher is a free episode behind its group's guided prompt; self-distillation is a
    guided episode behind the free prompt with every search_and_ask turn dropped
    (``drop_search_turns``: the generation and the answer that followed it; the env was not
    stepped, so the observation before it is still current).
    """
    seq = TokenSequence()
    seq.append_context(list(prompt_ids))
    for turn in ep.history:
        if drop_search_turns and turn.kind == "search_and_ask":
            continue
        seq.append_generation(turn.generation)
        if turn.context_ids:
            seq.append_context(turn.context_ids)
    return seq
