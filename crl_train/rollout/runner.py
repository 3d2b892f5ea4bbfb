"""Rollouts: K env copies per task with one seed, K/2 guided and K/2 free, one batched generation
per turn.

Order of a rollout step (``RolloutRunner.collect``):

1. every free copy is reset with its task's seed; the task text comes from ``info["task"]``;
2. the guided halves are prefetched with ONE ``client.search_many`` over the task texts of all
   groups (the driver's :func:`~crl_gym.episode.search_entries`), then reset with the entry in
   their :class:`~crl_gym.episode.EpisodeSpec`;
3. all live episodes advance together: one ``policy.generate`` call per turn over every
   unfinished episode (constrained to ``info["admissible_actions"]`` through a token trie when
   ``constrained``), then one ``env.step`` each.

Each episode is played by an :class:`~crl_gym.episode.EpisodeDriver` (its prompts, the reading of
its answers, its turn cap and its request, the same as in every training loop); the runner keeps
the batched generation and the tokens. Every :class:`Episode` keeps its token ids, loss mask (1
only on the agent's own tokens), old
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
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from crl_gym.episode import (
    MAX_OBS_CHARS,
    EpisodeDriver,
    EpisodeSpec,
    condition_of,
    first_messages,
    plain_messages,
    search_entries,
    search_turns,
)
from crl_gym.json_types import EnvInfo
from crl_gym.protocol import (
    FREE_CONDITION,
    GROUP_COPY,
    GROUP_SIZE,
    GUIDED_CONDITION,
    DistillationRequest,
    ExperienceRef,
    Step,
)
from crl_gym.templates import SEARCH_ACTION
from crl_train.policy.base import Generation, Policy, TokenSequence
from crl_train.rollout.episode import Episode, Turn
from crl_train.rollout.rules import cut_request, shown_turn_entry

if TYPE_CHECKING:
    from crl_gym.clients import ExperienceClient

log = logging.getLogger(__name__)


class EntryGate(Protocol):
    """What the runner asks of an entry gate (``crl_train.methods.gate.ActorCriticGate``)."""

    def judge(
        self, tasks: Sequence[str], entries: Sequence[ExperienceRef]
    ) -> tuple[list[Any], float]:
        """A verdict per (task, entry) — with ``shown``, ``verdict`` and ``meta()`` — and the
        seconds taken."""
        ...

    def observe(self, tasks: Sequence[str], successes: Sequence[bool]) -> None:
        """A finished rollout step's outcomes."""
        ...


class RolloutRunner:
    """Runs groups of episodes with one policy over a pool of (wrapped) envs: the batched
    generation and the tokens are the runner's, everything else about an episode is its
    :class:`~crl_gym.episode.EpisodeDriver`'s (one per env of the pool).

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
        self._pool: dict[str, list[EpisodeDriver]] = {}
        self.errors = 0
        self.context_truncations = 0
        self.malformed_tool_calls = 0
        """Cut-off or malformed ``search_and_ask`` calls answered as a tool error
        (status ``malformed``)."""
        self.unreadable_answers = 0
        """Answers without an action tag, passed to the env whole
        (:mod:`crl_gym.episode.answer`)."""
        self.search_failures = 0
        self.submit_failures = 0
        self.gate: EntryGate | None = None
        """Judges each guided episode's entry before it starts (the actor-critic gate), or None."""
        self.last_search_s = 0.0
        """Wall time of the last rollout step's batched search (s)."""
        self.eos_ids = set(policy.eos_token_ids)

    # ------------------------------------------------------------------ envs
    def _drivers(self, env_id: str, n: int) -> list[EpisodeDriver]:
        pool = self._pool.setdefault(env_id, [])
        while len(pool) < n:
            pool.append(
                EpisodeDriver(
                    self.make_env(env_id),
                    constrained=self.constrained,
                    max_turns=self.max_turns,
                    max_obs_chars=self.max_obs_chars,
                )
            )
        return pool[:n]

    def close(self) -> None:
        for pool in self._pool.values():
            for driver in pool:
                try:
                    driver.env.close()
                except Exception:  # noqa: BLE001 - closing is best effort
                    log.debug("env close failed", exc_info=True)
        self._pool.clear()

    # ----------------------------------------------------------------- collect
    def collect(
        self, tasks: Sequence[tuple[str, int]], *, guided: bool = True, step: int = 0
    ) -> list[Episode]:
        """Run one rollout step: ``tasks`` = [(env_id, seed)] groups of K copies each.

        ``guided=False`` runs every copy free (GRPO, or evaluation without experience).
        """
        k = self.group_size
        episodes: list[Episode] = []
        need: dict[str, int] = {}
        for env_id, _ in tasks:
            need[env_id] = need.get(env_id, 0) + k
        taken: dict[str, int] = dict.fromkeys(need, 0)
        pools = {env_id: self._drivers(env_id, n) for env_id, n in need.items()}
        for g, (env_id, seed) in enumerate(tasks):
            for c in range(k):
                driver = pools[env_id][taken[env_id]]
                episodes.append(
                    Episode(
                        group=g,
                        condition=condition_of(c, k, guided=guided),
                        env_id=env_id,
                        seed=seed,
                        driver=driver,
                        request_meta={GROUP_COPY: c, GROUP_SIZE: k},
                    )
                )
                taken[env_id] += 1
        # 1. free copies first: they give the task text of each group
        task_text: dict[int, str] = {}
        for ep in episodes:
            if ep.condition == FREE_CONDITION:
                self._reset(ep, self._spec(ep, step))
                if not ep.failed_by_error:
                    task_text.setdefault(ep.group, ep.task)
        # 2. one batched search for all guided halves
        guided_groups = sorted({ep.group for ep in episodes if ep.condition == GUIDED_CONDITION})
        prefetched: dict[int, ExperienceRef | None] = {}
        if guided_groups and self.client is not None and self.episode_search:
            queries = [task_text.get(g, "") for g in guided_groups]
            t0 = time.perf_counter()
            refs, failed = search_entries(self.client, queries)
            self.search_failures += failed
            self.last_search_s = time.perf_counter() - t0
            prefetched = dict(zip(guided_groups, refs, strict=True))
        guided_eps = [ep for ep in episodes if ep.condition == GUIDED_CONDITION]
        judged = self._judge(guided_eps, prefetched, task_text)
        for ep in guided_eps:
            entry = prefetched.get(ep.group)
            if id(ep) in judged:
                ep.request_meta["gate"] = judged[id(ep)].meta()
                entry = judged[id(ep)].shown
            self._reset(
                ep,
                self._spec(ep, step, entry=entry, searched=self.episode_search or id(ep) in judged),
            )
        # 3. advance all together
        for ep in episodes:
            ep.info["rollout_step"] = step
        try:
            while True:
                live = [ep for ep in episodes if not ep.done]
                if not live:
                    break
                self._turn(live)
                # a finished episode's kept keys/values are not needed again
                self.policy.release_cache([id(ep) for ep in live if ep.done])
        finally:
            self.policy.release_cache([id(ep) for ep in episodes])
        if self.gate is not None and step >= 0:  # held-out episodes do not move the actor's rates
            done = [ep for ep in episodes if not ep.failed_by_error]
            self.gate.observe([ep.task for ep in done], [ep.success for ep in done])
        return episodes

    def _spec(
        self, ep: Episode, step: int, *, entry: ExperienceRef | None = None, searched: bool = False
    ) -> EpisodeSpec:
        return EpisodeSpec(
            ep.env_id,
            ep.seed,
            ep.condition,
            rollout_step=step,
            meta=dict(ep.request_meta),
            prefetched=entry,
            searched=searched,
        )

    def _judge(
        self,
        guided: list[Episode],
        prefetched: dict[int, ExperienceRef | None],
        task_text: dict[int, str],
    ) -> dict[int, Any]:
        """The gate's verdict for each guided episode that has an entry (by ``id(episode)``)."""
        pairs = [(ep, e) for ep in guided if (e := prefetched.get(ep.group)) is not None]
        if self.gate is None or not pairs:
            return {}
        verdicts, seconds = self.gate.judge(
            [task_text.get(ep.group, "") for ep, _ in pairs], [e for _, e in pairs]
        )
        out = {}
        for (ep, _), v in zip(pairs, verdicts, strict=True):
            ep.info["gate"] = v.verdict
            ep.info["gate_s"] = seconds / len(pairs)
            out[id(ep)] = v
        return out

    def _reset(self, ep: Episode, spec: EpisodeSpec) -> None:
        driver = _driver(ep)
        ep.request_meta = spec.request_meta()
        try:
            first = driver.reset(spec)
        except Exception:  # noqa: BLE001 - see module docstring (the driver logged it)
            self._fail(ep)
            return
        played = driver.episode
        assert played is not None
        ep.task, ep.admissible = played.task, list(played.admissible)
        ep.experience = played.experience
        ep.turn_experience = played.turn_experience
        ep.prompt_ids = self.policy.apply_chat(plain_messages(first_messages(driver.system, first)))
        ep.sequence.append_context(ep.prompt_ids)

    def _fail(self, ep: Episode) -> None:
        self.errors += 1
        played = _driver(ep).episode
        ep.info["error"] = played.error if played is not None and played.error else "error"
        ep.done, ep.success = True, False
        log.warning(
            "episode env=%s seed=%s %s %s and ends as a failure",
            ep.env_id,
            ep.seed,
            ep.condition,
            ep.info["error"],
        )

    def _allowed(self, ep: Episode) -> list[str] | None:
        if not self.constrained:
            return None
        actions = list(ep.admissible)
        if self.search_and_ask and self.client is not None:
            actions.append(SEARCH_ACTION)
        return actions or None

    def _turn(self, live: list[Episode]) -> None:
        prompts = [ep.sequence.input_ids for ep in live]
        allowed = [self._allowed(ep) for ep in live]
        # a policy with a prefix cache encodes only each episode's new tokens (keys live until
        # collect ends)
        keys = [id(ep) for ep in live] if self.policy.prefix_cache else None
        gens = self.policy.generate(
            prompts,
            self.max_new_tokens,
            allowed=allowed if self.constrained else None,
            cache_keys=keys,
        )
        stepped: list[tuple[Episode, Generation]] = []
        for ep, gen in zip(live, gens, strict=True):
            ep.sequence.append_generation(gen)
            driver = _driver(ep)
            try:
                turn = driver.act(gen.text)
            except Exception:  # noqa: BLE001 - see module docstring (the driver logged it)
                ep.history.append(Turn(gen, []))
                self._fail(ep)
                continue
            played = driver.episode
            assert played is not None
            info = played.last_info
            tool = info.get("search_and_ask")
            if isinstance(tool, dict) and tool.get("status") == "malformed":
                self.malformed_tool_calls += 1
            self.unreadable_answers += not turn.readable
            ep.unreadable = played.unreadable
            ep.turns += 1
            ep.num_actions += turn.kind == "env"
            ep.search_calls += turn.kind == "search_and_ask"
            ep.reward += turn.reward
            ep.steps.append(
                Step(observation="", action=turn.action, reward=turn.reward, kind=turn.kind)
            )
            ep.admissible = list(played.admissible)
            stepped.append((ep, gen))
        if self.client is not None:  # the wrappers left the turns' searches to one batch
            self.search_failures += search_turns([_driver(ep) for ep, _ in stepped], self.client)
        for ep, gen in stepped:
            driver = _driver(ep)
            played = driver.episode
            assert played is not None
            if played.done:
                self._end(ep, gen, played.cut)
                continue
            shown = driver.observe()
            assert shown is not None
            after_eos = bool(gen.token_ids) and gen.token_ids[-1] in self.eos_ids
            ctx = self.policy.chat.user_turn_ids(shown, after_eos=after_eos)
            if len(ep.sequence) + len(ctx) + self.max_new_tokens > self.max_context_tokens:
                self.context_truncations += 1
                driver.cut("context_truncated")
                self._end(ep, gen, "context_truncated")
                continue
            ep.history.append(Turn(gen, list(ctx), ep.steps[-1].kind))
            ep.sequence.append_context(ctx)

    def _end(self, ep: Episode, gen: Generation, cut: str | None) -> None:
        """Close ``ep`` after its last generation (the history mirrors the sequence: no context)."""
        played = _driver(ep).episode
        assert played is not None
        ep.done = True
        ep.success = played.success
        ep.request = played.request
        if cut is not None:
            ep.info[cut] = True
        ep.history.append(Turn(gen, [], ep.steps[-1].kind))

    def own_request(self, ep: Episode) -> DistillationRequest:
        """Deprecated: the driver ends a cut episode through its wrapper, which submits the request
        (:meth:`crl_gym.episode.EpisodeDriver.cut`). A request for an episode the env did not
        finish (turn cap / context cut), built from the runner's episode."""
        warnings.warn(
            "RolloutRunner.own_request is deprecated: the episode driver's cut() ends a "
            "cut episode and its wrapper submits the request",
            DeprecationWarning,
            stacklevel=2,
        )
        return cut_request(
            task=ep.task,
            steps=ep.steps,
            outcome=ep.reward,
            experience=ep.experience,
            condition=ep.condition,
            env_id=ep.env_id,
            seed=ep.seed,
            reasons=ep.info,
            meta=ep.request_meta,
            turn_experience=ep.turn_experience,
        )


def _driver(ep: Episode) -> EpisodeDriver:
    if ep.driver is None:
        raise RuntimeError("the episode has no driver: the runner built neither it nor its env")
    return ep.driver


def _note_turn_entry(ep: Episode, info: EnvInfo, turn: int) -> None:
    """Deprecated: the driver records the entries per-turn retrieval showed."""
    warnings.warn(
        "crl_train.rollout.runner._note_turn_entry is deprecated: the episode driver "
        "records the turns' entries",
        DeprecationWarning,
        stacklevel=2,
    )
    shown = shown_turn_entry(info, turn)
    if shown is not None:
        ep.turn_experience.append(shown)


def swap_prompt(
    ep: Episode, prompt_ids: Sequence[int], *, drop_search_turns: bool = False
) -> TokenSequence:
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
