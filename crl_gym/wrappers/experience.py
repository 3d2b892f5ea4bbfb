"""``ExperienceWrapper``: guided/free episodes, trajectory recording, distillation requests.

``reset(options={"experience": "guided"})`` fetches the best bank entry for the task (one
``client.search`` for ``info["task"]``, else the first observation, unless the caller passes a
``"prefetched"`` entry it fetched in one ``search_many`` batch for the whole rollout group),
prepends it to the first observation and reports it under ``info["experience"]``. The env's own
observation goes in unchanged: only the entry is fitted, into the env's ``Text`` space widened
for it (:mod:`crl_gym.wrappers.text_spaces`), so guided and free episodes read the same task. Each
step is recorded by appending four references to one flat list (no copies, no per-step object: the
wrapper's cost must stay ≤ 2 µs per step); on ``terminated or truncated`` the wrapper hands
that list to a :class:`~crl_gym.wrappers.recording.RecordedRequest` — a ``DistillationRequest``
whose ``Step`` objects and id are built when a consumer first reads them, not at episode end
for every episode of a rollout at once — submits it and returns it under
``info["distillation_request"]``. Rewards and the env's info keys pass through. The request's
``success`` is the last step's ``info["success"]``, else the declared ``success_rule`` or
``return >= success_reward`` (:mod:`crl_gym.wrappers.success`; undeclared, it warns once per
env). An env with a non-text observation or action space is refused when the wrapper is built
(:mod:`crl_gym.wrappers.accepted_envs`).

Reset options of the wrapper's own (the others reach the env): ``"experience"`` (``"guided"`` /
``"free"``), ``"prefetched"`` (an ``ExperienceRef``, its dict, or ``None``) and
``"rollout_step"``: the actor step ``t`` the episode belongs to, copied into the request's
``rollout_step`` (``None`` when not given). The experience service groups requests by it to
credit the entries used in step ``t`` once that step has ended; a negative step marks an episode
of no training step (held-out evaluation), which the service never credits. ``"meta"``: a dict
copied into the request's ``meta`` (the actor-critic gate's verdict travels there).
A reset with neither seed nor options (how a vector env resets a finished copy) is the next episode
of the last explicit reset: its condition, ``rollout_step`` and ``meta`` hold, and it is seeded
from that reset's seed (:mod:`crl_gym.wrappers.autoreset`).

Actions and observations are recorded as text. At episode end (not per step) a value that is
not ``str`` is converted — a numpy scalar or 0-d array to its Python value's ``str``, bytes
decoded as UTF-8 with replacement, a number to its ``str`` — or, for ``None``, arrays and
other objects, the request is refused: nothing is submitted, ``info["distillation_request"]``
is ``None`` and ``info["experience_error"]`` names the turn and the value.

The wrapper injects experience and emits requests; it does not deliver them. Each request goes to
its outbox, a :class:`~crl_gym.clients.keeping.KeepingClient` over the client (pass your own,
``KeepingClient(client, spill_path=..., max_unsent=...)``, as the client to choose where
undelivered requests go; by default they are kept in memory), the one place besides
``RemoteClient``'s own outbox that retries, keeps or spills a request: a request the client
rejects as malformed (``TypeError`` / ``ValueError``, see :data:`MALFORMED_ERRORS`) is dropped,
never retried; an outage (``ExperienceUnavailable``, a transport error) keeps it for a later
retry. The wrapper reports what happened (``rejected_count``, ``error_count``,
``info["experience_error"]``). (A ``RemoteClient``'s submit only buffers, so it never raises for
an outage: the client retries and spills to its own file, see
:class:`~crl_gym.clients.RemoteClient`.)

>>> from crl_gym.clients import LocalClient
>>> from crl_gym.experience.bank import ExperienceBank
>>> from crl_gym.experience.embedders import HashingEmbedder
>>> from crl_gym.experience.manager import ExperienceManager
>>> from crl_gym.wrappers.examples import CorridorEnv
>>> emb = HashingEmbedder(64); bank = ExperienceBank(None, dim=64)
>>> _ = bank.add("Walk east.", emb.encode(["Walk east."])[0])
>>> manager = ExperienceManager(bank, emb)
>>> env = ExperienceWrapper(CorridorEnv(length=1), LocalClient(manager))
>>> obs, info = env.reset(seed=0, options={"experience": "guided"})
>>> info["experience"]["text"]
'Walk east.'
>>> obs, reward, terminated, truncated, info = env.step("east")
>>> info["distillation_request"].success, manager.pending()
(True, 1)
>>> manager.close()
"""

from __future__ import annotations

import logging
import warnings
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, SupportsFloat, SupportsIndex

import gymnasium as gym

from crl_gym.clients.keeping import (
    DEFAULT_MAX_UNSENT,
    MALFORMED_ERRORS,
    KeepingClient,
    Offered,
    reraise_misuse,
)
from crl_gym.json_types import EnvInfo, EnvOptions, FlushReport
from crl_gym.protocol import (
    CONDITIONS,
    FREE_CONDITION,
    GUIDED_CONDITION,
    DistillationRequest,
    ExperienceRef,
    TurnGuidance,
)
from crl_gym.templates import GUIDED_OBSERVATION_TEMPLATE
from crl_gym.wrappers.accepted_envs import require_gym_env, require_text_spaces
from crl_gym.wrappers.autoreset import AutoresetCarry
from crl_gym.wrappers.recording import SEARCH_INFO_KEY, RecordedRequest, text_record
from crl_gym.wrappers.success import (
    DEFAULT_SUCCESS_REWARD,
    SuccessRule,
    episode_success,
    warn_if_guessed,
)
from crl_gym.wrappers.text_actions import (
    NotTextError,
    Shared,
    check_template,
    to_text,
    unshare,
)
from crl_gym.wrappers.text_spaces import DEFAULT_MAX_ENTRY_CHARS, EntryFitter, guided_space
from crl_gym.wrappers.turn_retrieval import (
    TURN_OBSERVATION_TEMPLATE,
    TurnRetrieval,
    check_retrieve,
    episode_entries,
    searches_at_start,
    searches_per_turn,
)

if TYPE_CHECKING:
    from crl_gym.clients import ExperienceClient

    Client = ExperienceClient | KeepingClient[ExperienceClient]
    """What the wrapper takes as its client: a bare one, or one with its own outbox."""

logger = logging.getLogger(__name__)

DEFAULT_TEMPLATE = GUIDED_OBSERVATION_TEMPLATE
"""How a guided episode's first observation shows the entry (text in :mod:`crl_gym.templates`)."""

_OWN_OPTIONS = ("experience", "prefetched", "rollout_step", "meta")


__all__ = [
    "DEFAULT_TEMPLATE",
    "MALFORMED_ERRORS",
    "SEARCH_INFO_KEY",
    "ExperienceWrapper",
    "FlushReport",
    "require_gym_env",
]


def _outbox(
    client: Client,
    spill_path: str | Path | None,
    max_unsent: int | None,
) -> KeepingClient[ExperienceClient]:
    """The wrapper's outbox: the ``KeepingClient`` it was given, else one over ``client`` (built
    from the deprecated ``spill_path`` / ``max_unsent`` when they are given)."""
    if spill_path is not None or max_unsent is not None:
        if isinstance(client, KeepingClient):
            raise ValueError(
                "spill_path and max_unsent belong to the KeepingClient given as the client; "
                "do not also give them to ExperienceWrapper"
            )
        warnings.warn(
            "ExperienceWrapper(spill_path=..., max_unsent=...) is deprecated: pass "
            "KeepingClient(client, spill_path=..., max_unsent=...) as the client",
            DeprecationWarning,
            stacklevel=3,
        )
    if isinstance(client, KeepingClient):
        return client
    return KeepingClient(
        client,
        spill_path=spill_path,
        max_unsent=DEFAULT_MAX_UNSENT if max_unsent is None else max_unsent,
    )


class ExperienceWrapper(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """Make a text env experience-augmented (see the module docstring).

    Args:
        env: any Gymnasium env with text observations (``str``) and text actions.
        client: an :class:`~crl_gym.clients.ExperienceClient` (``LocalClient`` / ``RemoteClient``),
            or a :class:`~crl_gym.clients.keeping.KeepingClient` over one: the wrapper searches
            through its ``client`` and hands requests to it (its ``spill_path`` and
            ``max_unsent`` say where undelivered requests are kept). A bare client gets a
            ``KeepingClient`` that keeps them in memory.
        template: format string for the guided first observation (``{experience}``,
            ``{observation}``).
        task_key: info key holding the task text; the first observation is used when absent.
        default_condition: condition of an explicit ``reset`` without ``options["experience"]``
            (``"free"`` keeps ``check_env``'s determinism check valid; a vector env can set it per
            copy with ``set_attr("default_condition", [...])``); a bare ``reset()`` keeps the last
            explicit one's.
        env_id: recorded in each request (defaults to the env spec's id, else the env's class name).
        spill_path: deprecated: ``KeepingClient(client, spill_path=...)`` as the client.
        max_unsent: deprecated: ``KeepingClient(client, max_unsent=...)`` as the client.
        success_reward: without ``info["success"]`` on the last step, an episode is a success
            when its return reaches this (see :mod:`crl_gym.wrappers.success`). None: 1.0, and the
            first episode without ``info["success"]`` logs a warning saying so (once per env).
        success_rule: ``rule(rewards, last_info) -> bool`` deciding success without
            ``info["success"]`` (over ``success_reward``); a rule that raises counts the episode as
            no success, logged.
        max_entry_chars: longest entry text a guided observation shows; a ``Text`` observation
            space is widened by the template and this many characters (:func:`guided_space`),
            so the env's own observation is never cut or altered.
        retrieve: when a guided episode retrieves: ``"episode"`` (at reset, for the task: the
            paper), ``"turn"`` (before every turn, for the current observation:
            :mod:`crl_gym.wrappers.turn_retrieval`) or ``"both"``.
        turn_template: how a guided turn's observation shows its entry (``{experience}``,
            ``{observation}``).
        defer_turn_search: per-turn retrieval after a step is left to the caller: the step returns
            the observation as the env gave it, with ``info["turn_query"]``; the caller searches for
            all its envs at once (``client.search_many``) and hands each its entry through
            :meth:`show_turn_entry`, which returns the observation to show (``RolloutRunner`` does).
        entries_per_episode: entries a guided episode is shown at its start (the authors'
            ``memory_fetch_num``; 1 = the paper): the first is ``info["experience"]``, the others
            ``info["experience_more"]``, each credited once for the episode.
        warmup_steps: guided episodes of a rollout step below this (``options["rollout_step"]``)
            run free, retrieving nothing (the authors' ``memory_warmup_interval``; 0 = off).

    A client that is down never costs an episode: the episode runs free, ``info``
    gets ``"experience_error"``, and the request is kept and retried later. A malformed
    request is dropped instead (``rejected_count``), so it never holds up the ones after it.
    """

    def __init__(
        self,
        env: gym.Env,
        client: Client | Shared[Client],
        template: str = DEFAULT_TEMPLATE,
        task_key: str = "task",
        default_condition: str = FREE_CONDITION,
        env_id: str | None = None,
        spill_path: str | Path | None = None,
        max_unsent: int | None = None,
        success_reward: float | None = None,
        max_entry_chars: int = DEFAULT_MAX_ENTRY_CHARS,
        retrieve: str = "episode",
        turn_template: str = TURN_OBSERVATION_TEMPLATE,
        warmup_steps: int = 0,
        entries_per_episode: int = 1,
        defer_turn_search: bool = False,
        success_rule: SuccessRule | None = None,
    ) -> None:
        # Recorded so that env.spec (and gym.make(env.spec)) can rebuild the wrapper stack.
        gym.utils.RecordConstructorArgs.__init__(
            self,
            client=Shared(unshare(client)),
            template=template,
            task_key=task_key,
            default_condition=default_condition,
            env_id=env_id,
            spill_path=spill_path,
            max_unsent=max_unsent,
            success_reward=success_reward,
            max_entry_chars=max_entry_chars,
            retrieve=retrieve,
            turn_template=turn_template,
            warmup_steps=warmup_steps,
            entries_per_episode=entries_per_episode,
            defer_turn_search=defer_turn_search,
            success_rule=success_rule,
        )
        require_gym_env(env, "ExperienceWrapper")
        require_text_spaces(env, "ExperienceWrapper")
        gym.Wrapper.__init__(self, env)
        if max_entry_chars < 1:
            raise ValueError(f"max_entry_chars must be >= 1, got {max_entry_chars}")
        if default_condition not in CONDITIONS:
            raise ValueError(
                f"default_condition must be one of {CONDITIONS}, got {default_condition!r}"
            )
        outbox = _outbox(
            client.obj if isinstance(client, Shared) else client, spill_path, max_unsent
        )
        self.client = outbox.client
        # a LocalClient used in a worker process raises here, at the first reset (not hours later)
        self._check_process = getattr(self.client, "check_process", None)
        self.retrieve = check_retrieve(retrieve)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        self.warmup_steps = warmup_steps
        if (
            isinstance(entries_per_episode, bool)
            or not isinstance(entries_per_episode, int)
            or entries_per_episode < 1
        ):
            raise ValueError(
                f"entries_per_episode must be an integer >= 1, got {entries_per_episode!r}"
            )
        self.entries_per_episode = entries_per_episode
        self._more: list[
            ExperienceRef
        ] = []  # the start's entries after the first (entries_per_episode > 1)
        self._turn_guided = False  # the open episode searches before each turn
        self.defer_turn_search = bool(defer_turn_search)
        self.template = check_template(
            template, "template", ("experience", "observation"), ("experience", "observation")
        )
        self.task_key = task_key
        self.default_condition = default_condition
        self.env_id = (
            env_id
            if env_id is not None
            else (env.spec.id if env.spec is not None else type(env.unwrapped).__name__)
        )
        self.success_reward = (
            DEFAULT_SUCCESS_REWARD if success_reward is None else float(success_reward)
        )
        self.success_rule = success_rule
        # a rule the user declared (threshold or callable) is applied without a warning
        self._rule_declared = success_reward is not None or success_rule is not None
        self.outbox = outbox
        """Where the episodes' requests go: it retries, keeps and spills what the client could
        not take (:class:`~crl_gym.clients.keeping.KeepingClient`); the wrapper only reports it."""
        self.error_count = 0
        """Client outages seen by this wrapper (search or submit)."""
        self.rejected_count = 0
        """Requests dropped as malformed: refused here (an action or observation with no text
        form) or by the client (see :data:`MALFORMED_ERRORS`); each one is logged."""
        self.episodes_submitted = 0
        self._outbox_seen = 0
        # Flat [obs0, action1, reward1, info1, obs1, action2, ...]: extend() with a temporary
        # tuple leaves no new GC-tracked object per step (a tuple or Step per step would make
        # the cyclic GC walk a trainer's whole heap more often).
        self._records: list[Any] | None = None
        # The env's observation goes into a guided one as it is: only the entry is fitted, and the
        # space is widened to hold both.
        space = guided_space(env.observation_space, self.template, max_entry_chars)
        turn_template = check_template(
            turn_template,
            "turn_template",
            ("experience", "observation"),
            ("experience", "observation"),
        )
        if searches_per_turn(
            self.retrieve
        ):  # a turn's entry may stand in front of the guided start too
            space = guided_space(space, turn_template, max_entry_chars)
        self.observation_space = space  # type: ignore[assignment]
        self._fit_entry = EntryFitter(self.observation_space, max_entry_chars)
        self.turns: TurnRetrieval | None = (
            TurnRetrieval(self.client, turn_template, self._fit_entry)
            if searches_per_turn(self.retrieve)
            else None
        )
        """The per-turn searches (``retrieve`` ``"turn"`` / ``"both"``), else None."""
        self._task = ""
        self._initial_obs = ""
        self._experience: ExperienceRef | None = None
        self._condition: str = FREE_CONDITION
        self._seed: int | None = None
        self._rollout_step: int | None = None
        self._meta: dict[str, object] | None = None
        self._errors: list[str] = []
        self._carry: AutoresetCarry | None = None
        """The last explicit reset's seed and options, for the episodes after it
        (vector autoreset)."""

    # ------------------------------------------------------------------ reset
    def reset(
        self, *, seed: int | None = None, options: EnvOptions | None = None
    ) -> tuple[Any, EnvInfo]:
        if self._check_process is not None:
            self._check_process()
        autoreset = seed is None and options is None  # how a vector env resets a finished copy
        if autoreset and self._carry is not None:
            seed, options = self._carry.next_episode()
        condition, prefetched, has_prefetched, rollout_step, env_options = self._parse_options(
            options
        )
        if (
            not autoreset
        ):  # checked: a later autoreset episode keeps this reset's condition and step
            self._carry = AutoresetCarry.after(
                seed if seed is None or type(seed) is int else int(seed), options
            )
        obs, info = self.env.reset(seed=seed, options=env_options)
        task = info.get(self.task_key)
        task = task if task is not None else obs
        self._task = task if type(task) is str else _task_text(task)
        self._initial_obs = obs
        # a numpy seed would not survive JSON
        self._seed = seed if seed is None or type(seed) is int else int(seed)
        self._rollout_step = rollout_step
        self._meta = _request_meta(options)
        category = info.get("task_category")
        if category is not None:  # EDGE reflects per category (the env id when the env has none)
            self._meta = {**(self._meta or {}), "task_category": str(category)}
        if self._errors:
            self._errors = []
        experience: ExperienceRef | None = None
        if self._more:
            self._more = []
        if (
            condition == GUIDED_CONDITION
            and rollout_step is not None
            and 0 <= rollout_step < self.warmup_steps
        ):
            condition = (
                FREE_CONDITION  # warm-up: nothing is retrieved, so the episode really is free
            )
            info["experience_warmup"] = True
        if condition == GUIDED_CONDITION and searches_at_start(self.retrieve):
            if has_prefetched:
                experience = prefetched
            else:
                try:
                    experience, self._more = episode_entries(
                        self.client, self._task, self.entries_per_episode
                    )
                except Exception as exc:  # noqa: BLE001 - a down client must not cost the episode
                    reraise_misuse(exc)
                    self._note_error("search", exc)
                    condition = FREE_CONDITION  # nothing was shown: the episode really is free
        self._condition = condition
        self._experience = experience
        if experience is not None:
            shown = (
                "\n\n".join([experience.text, *(e.text for e in self._more)])
                if self._more
                else experience.text
            )
            obs = self.template.format(experience=self._fit_entry(shown), observation=obs)
            # a literal dict: dataclasses.asdict costs ~10 µs, a fifth of the per-episode budget
            info["experience"] = {
                "id": experience.id,
                "text": experience.text,
                "version": experience.version,
            }
            if self._more:
                info["experience_more"] = [e.to_dict() for e in self._more]
        else:
            info["experience"] = None
        self._turn_guided = self.turns is not None and condition == GUIDED_CONDITION
        if self.turns is not None:
            self.turns.start()
        if self._turn_guided:
            obs = self._guide_turn(
                self._initial_obs, 0, info, obs if experience is not None else None
            )
        if self._errors:
            info["experience_error"] = "; ".join(self._errors)
        self._records = [self._initial_obs]
        return obs, info

    def _parse_options(
        self,
        options: dict[str, object] | None,
    ) -> tuple[str, ExperienceRef | None, bool, int | None, dict[str, object] | None]:
        if not options:
            return self.default_condition, None, False, None, options
        if not isinstance(options, dict):
            raise TypeError(f"reset options must be a dict, got {type(options).__name__}")
        condition = options.get("experience", self.default_condition)
        if condition not in CONDITIONS:
            raise ValueError(
                f'options["experience"] must be one of {CONDITIONS}, got {condition!r}'
            )
        has_prefetched = "prefetched" in options
        prefetched = options.get("prefetched")
        if isinstance(prefetched, dict):
            prefetched = ExperienceRef.from_dict(prefetched)
        if prefetched is not None and not isinstance(prefetched, ExperienceRef):
            raise TypeError(
                'options["prefetched"] must be an ExperienceRef, a dict or None, got '
                f"{type(prefetched).__name__}"
            )
        rollout_step = options.get("rollout_step")
        if rollout_step is not None and type(rollout_step) is not int:
            rollout_step = _rollout_step(rollout_step)
        if all(k in _OWN_OPTIONS for k in options):
            return condition, prefetched, has_prefetched, rollout_step, None
        env_options = {k: v for k, v in options.items() if k not in _OWN_OPTIONS}
        return condition, prefetched, has_prefetched, rollout_step, env_options

    # ------------------------------------------------------------------- step
    def step(self, action: object) -> tuple[Any, SupportsFloat, bool, bool, EnvInfo]:
        obs, reward, terminated, truncated, info = out = self.env.step(action)
        records = self._records
        if records is not None:  # None: no episode open (step after the end without reset)
            records += (action, reward, info, obs)
            if terminated or truncated:
                return obs, reward, terminated, truncated, self._finish(info)
            if (
                self._turn_guided and SEARCH_INFO_KEY not in info
            ):  # a search_and_ask turn left the env as it was
                info = dict(info)  # the recorded info stays the env's
                turn = (len(records) - 1) // 4
                if self.defer_turn_search and self.turns is not None:
                    info["turn_query"] = self.turns.defer(obs, turn)
                    return obs, reward, terminated, truncated, info
                return self._guide_turn(obs, turn, info), reward, terminated, truncated, info
        return out  # the env's own tuple: no repacking on the common turn

    def _guide_turn(self, obs: Any, turn: int, info: dict[str, object], display: Any = None) -> Any:
        """``obs`` with the entry found for it (fitted to the space) in front (per-turn retrieval);
        the entry goes to ``info["turn_experience"]`` (a caller that writes its own request of a
        cut episode reads it there)."""
        assert self.turns is not None
        found = len(self.turns.guidance)
        shown, error = self.turns.show(obs, turn, display)
        if error is not None:
            self.error_count += 1
            self._errors.append(error)
            logger.warning("experience: %s (the turn runs unguided)", error)
        if len(self.turns.guidance) > found:
            e = self.turns.guidance[-1].entry
            info["turn_experience"] = {"id": e.id, "text": e.text, "version": e.version}
        return shown

    def show_turn_entry(
        self, entry: ExperienceRef | None, info: dict[str, object] | None = None
    ) -> Any:
        """The observation of a deferred turn (``defer_turn_search``) with ``entry`` in front of it,
        the caller's search result for ``info["turn_query"]`` (None: the bank had nothing, or the
        search failed). ``info`` (the step's) gets ``"turn_experience"`` as in a turn
        searched here."""
        if self.turns is None:
            raise RuntimeError(
                "show_turn_entry: this wrapper does not retrieve per turn (retrieve='episode')"
            )
        shown, placed = self.turns.complete(entry)
        if placed and entry is not None and info is not None:
            info["turn_experience"] = {"id": entry.id, "text": entry.text, "version": entry.version}
        return shown

    # ------------------------------------------------------------ episode end
    def end_episode(
        self, *, meta: Mapping[str, object] | None = None, success: bool | None = None
    ) -> DistillationRequest | None:
        """End the open episode without a step, for a caller that stops before the env ends it
        (a TRL rollout whose model stopped calling the action tool, a loop's turn cap): its request
        is built and submitted as at a truncation, with ``success`` (default: the last step's
        ``success``, ``False`` when it has none) and ``meta`` added to the request's ``meta`` (a
        cut's reason: ``{"turn_cap": True}``).

        Returns the request; ``None`` when no episode is open or its record was refused.
        """
        records = self._records
        if records is None:
            return None
        if success is None:
            last = records[-2] if len(records) > 1 and isinstance(records[-2], dict) else {}
            success = bool(last.get("success", False))
        if meta:
            self._meta = {**(self._meta or {}), **meta}
        info = self._finish({"success": success, "ended_by_caller": True})
        request: DistillationRequest | None = info["distillation_request"]
        return request

    def _finish(self, info: EnvInfo) -> EnvInfo:
        records = self._records or [self._initial_obs]
        self._records = None
        declared = info.get("success")
        rewards = records[2::4]
        warn_if_guessed(
            self.env_id, declared, rewards, self.success_reward, rule_declared=self._rule_declared
        )
        try:
            success = episode_success(
                declared, rewards, self.success_reward, rule=self.success_rule, last_info=info
            )
        except Exception as exc:  # noqa: BLE001 - a user's rule that raises is named, and the episode is no success
            success = False
            logger.warning(
                "success_rule of env %r raised %s: %s (the episode counts as no success)",
                self.env_id,
                type(exc).__name__,
                exc,
            )
        # Text is checked here, once per episode, not per step: a request that cannot be
        # serialised must never reach the client, where it would be retried forever.
        problem = text_record(records)
        request: RecordedRequest | None = None
        if problem is None:
            try:
                request = RecordedRequest.from_record(
                    records,
                    task=self._task,
                    experience=self._experience,
                    condition=self._condition,  # type: ignore[arg-type]  # validated in _parse_options
                    env_id=self.env_id,
                    seed=self._seed,
                    success=success,
                    # the search failed: the extractor should know the episode ran free
                    meta={**(self._meta or {}), "experience_error": list(self._errors)}
                    if self._errors
                    else self._meta,
                    rollout_step=self._rollout_step,
                    turn_experience=[TurnGuidance(0, e) for e in self._more]
                    + (self.turns.taken() if self.turns is not None else []),
                )
            except (TypeError, ValueError) as exc:  # e.g. a reward float() cannot read
                problem = f"its record is malformed ({type(exc).__name__}: {exc})"
        if request is not None:
            self._submit(request)
        else:
            self._reject(
                f"the episode (env {self.env_id!r}, seed {self._seed}) is not recorded: {problem}"
            )
        # A new dict: the last step's info is in the record, and putting the request inside it
        # would make the trajectory contain itself.
        info = {**info, "distillation_request": request}
        if self._errors:
            info["experience_error"] = "; ".join(self._errors)
        return info

    @property
    def client(self) -> ExperienceClient:
        """The experience client (searches here; requests through :attr:`outbox`)."""
        return self._client

    @client.setter
    def client(self, client: ExperienceClient) -> None:
        self._client = client
        outbox: KeepingClient | None = self.__dict__.get("outbox")
        if outbox is not None:  # a client swapped in later (a service restarted) delivers too
            outbox.client = client

    # the outbox's state, under the wrapper's old names
    @property
    def unsent(self) -> deque[DistillationRequest]:
        """Requests kept in memory for a retry (the outbox's)."""
        return self.outbox.unsent

    @property
    def spill_path(self) -> Path | None:
        return self.outbox.spill_path

    @property
    def max_unsent(self) -> int:
        return self.outbox.max_unsent

    def _submit(self, request: DistillationRequest) -> None:
        """Hand ``request`` to the outbox (which keeps it when the client is down: a spill file
        when ``spill_path`` is set, else memory, retried at the next episode end or by
        :meth:`retry_unsent`) and report what happened in the episode's ``info``."""
        self._report(self.outbox.offer(request))

    def retry_unsent(self) -> int:
        """Submit the requests kept in memory, oldest first; returns how many are still unsent.

        A request the client rejects as malformed is dropped (counted in ``rejected_count``)
        and the next one is tried: it must not hold up the requests queued behind it.
        """
        offered = self.outbox.retry()
        self._report(offered)
        return offered.still_unsent

    def _report(self, offered: Offered) -> None:
        sent_before = self.episodes_submitted
        self.episodes_submitted = sent_before + (self.outbox.submitted - self._outbox_seen)
        self._outbox_seen = self.outbox.submitted
        for message in offered.outages:
            self.error_count += 1
            self._errors.append(message)
            logger.warning("experience: %s (episode continues)", message)
        for message in offered.rejections:
            self._reject(message)

    def flush_experience(self, timeout: float | None = None) -> FlushReport:
        """Retry the requests kept here, then wait until the client has delivered every request
        submitted in this process (``client.flush``). A vector env calls it in each of its copies
        before the driver closes the step (``envs.call("flush_experience")``, or
        :func:`crl_gym.wrappers.vector.end_step`), so no episode of the step reaches the service
        after its ``end_step``. Returns ``{"kept": requests still kept here, "undelivered": the
        flush error's message or None}``: the error is reported, not raised, so that it does not
        end an ``AsyncVectorEnv`` worker (the requests it names are in the client's spill file).
        """
        kept = self.retry_unsent()
        try:
            self.client.flush(timeout)
        except Exception as exc:  # noqa: BLE001 - reported to the caller, who decides
            reraise_misuse(exc)
            logger.error("experience: flush failed: %s: %s", type(exc).__name__, exc)
            return {"kept": kept, "undelivered": f"{type(exc).__name__}: {exc}"}
        return {"kept": kept, "undelivered": None}

    def _reject(self, message: str) -> None:
        """Drop a request that can never be taken as it is: counted, logged, shown in ``info``."""
        self.rejected_count += 1
        self._errors.append(message)
        logger.error(
            "experience: %s; the request is dropped (rejected so far: %d)",
            message,
            self.rejected_count,
        )

    def _note_error(self, what: str, exc: BaseException) -> None:
        self.error_count += 1
        message = f"{what} failed: {type(exc).__name__}: {exc}"
        self._errors.append(message)
        logger.warning("experience: %s (episode continues)", message)


def _task_text(value: object) -> str:
    """The task (``info[task_key]`` or the first observation) as text, ``str()`` when it has no
    text form (a first observation without one also refuses the request at episode end)."""
    try:
        return to_text(value)
    except NotTextError:
        return str(value)


def _request_meta(options: Mapping[str, object] | None) -> dict[str, object] | None:
    """``options["meta"]``: what the caller wants the episode's request to carry (e.g. the
    gate's verdict)."""
    meta = options.get("meta") if options else None
    if meta is not None and not isinstance(meta, dict):
        raise TypeError(f'options["meta"] must be a dict or None, got {type(meta).__name__}')
    return dict(meta) if meta else None


def _rollout_step(value: object) -> int:
    """``options["rollout_step"]`` as an ``int`` (numpy integers too); bad values are named."""
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise TypeError(
            f'options["rollout_step"] must be an int or None, got {type(value).__name__}'
        )
    return int(value.__index__())
