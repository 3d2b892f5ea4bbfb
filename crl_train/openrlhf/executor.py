"""Our env, wrappers and experience service inside OpenRLHF's agent mode.

OpenRLHF (``--train.agent_func_path FILE``) builds ``AgentExecutor()`` with no arguments in every
vLLM engine actor and awaits ``execute(prompt, label, sampling_params, max_length, hf_tokenizer,
llm_engine)`` once per sample; the ``n_samples_per_prompt`` = K samples of a prompt run
concurrently on the engine's event loop and share one label. Here:

* **The task travels in the label.** Each dataset row's label is a :class:`TaskLabel`
  (``{"env_id", "seed", "index"}`` as JSON); the row's prompt text is not used: the first
  observation comes from the env.
* **Guided or free is decided in the executor** (the label is the same for all K samples):
  :class:`ConditionAssigner` counts the executions of each label *before the first await*, so
  the first K/2 samples of a group are guided and the other K/2 free, and the condition is
  reported in ``extra_logs["crl_guided"]`` for the advantage mixin.
* **The env runs off the event loop.** ``env.reset`` / ``env.step`` (and with them the wrappers'
  ``client.search`` / ``ask`` / ``submit``, blocking Ray calls) run in the runtime's thread pool:
  a blocking call on vLLM's loop would stall generation for every episode of the engine.
* **Our wrappers do the experience work**: :class:`~crl_gym.wrappers.ExperienceWrapper` injects the
  retrieved entry into a guided episode's first observation and submits its distillation request
  when the env ends it; :class:`~crl_gym.wrappers.SearchAndAskWrapper` answers ``search_and_ask``.
  An episode the executor cuts (turn cap, context) is ended by its
  :class:`~crl_gym.episode.EpisodeDriver`, whose wrapper submits its request (in the thread pool).
  The trainer (``crl_train.openrlhf.steps``) calls ``end_step`` after each update.
* **Caps are ours.** OpenRLHF overwrites ``sampling_params.max_tokens`` with the remaining
  ``max_length`` budget each turn and has no turn limit; :meth:`AgentExecutor.execute` gives each
  turn at most ``actor.max_new_tokens``, stops at ``env.max_turns`` turns, and ends an episode
  whose next turn would not fit in ``max_length`` (``--data.max_len`` =
  ``actor.max_context_tokens``) as a failure, like the ``hf`` backend's runner.
* **Nothing raises out of an episode.** An exception in ``step`` would fail the whole
  ``asyncio.gather`` of the engine's batch: env errors end that episode as a failure
  (``crl_valid = 0``: it gets advantage 0) and are logged; a service outage costs guidance, never
  the episode.

Rewards are the paper's R ∈ {0, 1} (success), given on the last turn. ``extra_logs`` has the same
keys for every sample (OpenRLHF concatenates them into tensors): :data:`EXTRA_LOG_KEYS`.
:class:`CRLAgentInstance` is an OpenRLHF ``AgentInstanceBase`` and also runs under OpenRLHF's own
``MultiTurnAgentExecutor`` (then the turn cap holds, the token caps are OpenRLHF's).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import warnings
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from copy import deepcopy
from functools import partial
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

from crl_gym.episode import Episode, EpisodeDriver, EpisodeSpec, system_text
from crl_gym.episode.prompt import first_messages, plain_messages
from crl_gym.protocol import (
    CONDITIONS,
    GUIDED_CONDITION,
    DistillationRequest,
    ExperienceRef,
    TurnGuidance,
)
from crl_train.config import TrainConfig
from crl_train.openrlhf.tasks import ConditionAssigner, TaskLabel
from crl_train.policy.chat import ChatFormatter

if TYPE_CHECKING:
    import gymnasium as gym
    from transformers import PreTrainedTokenizerBase

    from crl_gym.clients import ExperienceClient
    from crl_train.openrlhf.settings import ClusterSettings

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

EXTRA_LOG_KEYS: tuple[str, ...] = (
    "crl_guided",
    "crl_experience",
    "crl_success",
    "crl_valid",
    "crl_turns",
    "crl_search_calls",
    "crl_turn_cap",
    "crl_context_truncated",
    "crl_env_error",
)
"""``extra_logs`` of every sample (floats): condition (1 guided), an entry was shown, success, not
ended by an env error, turns, search_and_ask calls, cut by the turn cap, cut by the context,
env error."""

# ---------------------------------------------------------------------------------------- runtime


class EpisodeRuntime:
    """What every episode of one engine process shares: the config, the service client, the envs
    (pooled per env id), the thread pool that steps them, the chat template and the counters.

    Args:
        cfg: the crl-train config (env, actor caps, experience, method).
        client: an :class:`~crl_gym.clients.ExperienceClient` (the Ray client on a cluster); unused
            (and may be None) for a method without experience (``grpo``).
        env_factory: ``env_factory(env_id) -> env`` of raw envs (default ``crl_gym.envs.make`` with
            ``env.kwargs``); the wrappers are added here.
        tokenizer: the actor's tokenizer for :class:`CRLAgentInstance` built without one (OpenRLHF's
            ``MultiTurnAgentExecutor``); ``AgentExecutor`` passes the engine's own.
        env_threads: threads that run env calls.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        client: ExperienceClient | None = None,
        *,
        env_factory: Callable[[str], Any] | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        env_threads: int = 128,
    ) -> None:
        from crl_train.methods import make_method

        self.cfg = cfg
        self.method = make_method(cfg)
        self.guided = bool(self.method.guided)
        if self.guided and client is None:
            raise ValueError(
                f"method {cfg.method.value!r} uses experience: the runtime needs a service client"
            )
        self.client = client if self.guided else None
        self.assigner = ConditionAssigner(cfg.env.group_size, self.guided)
        self._raw_env = env_factory
        self.tokenizer = tokenizer
        self._chats: dict[int, ChatFormatter] = {}
        self._pool: defaultdict[str, list[gym.Env]] = defaultdict(list)
        self._pool_lock = threading.Lock()
        self.threads = ThreadPoolExecutor(
            max_workers=max(1, env_threads), thread_name_prefix="crl-env"
        )
        self.counters: dict[str, int] = dict.fromkeys(
            ("episodes", "env_errors", "turn_caps", "context_truncations", "submit_failures"), 0
        )

    @classmethod
    def from_settings(cls, settings: ClusterSettings) -> EpisodeRuntime:
        """The runtime of a process started by the launcher (the service is the named Ray actor)."""
        from crl_train.methods import make_method
        from crl_train.service.ray_actor import RayServiceClient

        cfg = settings.train_config()
        client = (
            RayServiceClient(settings.service_name, settings.namespace)
            if make_method(cfg).guided
            else None
        )
        return cls(cfg, client, env_threads=settings.env_threads)

    # ------------------------------------------------------------------ helpers
    async def run(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """``fn(*args, **kwargs)`` in the env thread pool, awaited (the event loop
        keeps generating)."""
        return await asyncio.get_running_loop().run_in_executor(
            self.threads, partial(fn, *args, **kwargs)
        )

    def chat(self, tokenizer: PreTrainedTokenizerBase) -> ChatFormatter:
        key = id(tokenizer)
        if key not in self._chats:
            think = self.cfg.actor.enable_thinking
            self._chats[key] = ChatFormatter(
                tokenizer, None if think is None else {"enable_thinking": think}
            )
        return self._chats[key]

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(
                self.cfg.actor.model, trust_remote_code=True
            )
        return self.tokenizer

    def make_env(self, env_id: str) -> gym.Env:
        """A raw env, wrapped for experience when the method uses it."""
        if self._raw_env is not None:
            env = self._raw_env(env_id)
        else:
            from crl_train.rollout.envs import make_raw_env

            env = make_raw_env(self.cfg.env, env_id)
        if (
            self.client is None
        ):  # a method without experience (the constructor checks the others have one)
            return env
        from crl_gym.wrappers.experience import ExperienceWrapper
        from crl_gym.wrappers.search_and_ask import SearchAndAskWrapper

        if self.cfg.experience.search_and_ask:
            env = SearchAndAskWrapper(
                env, self.client, max_calls=self.cfg.experience.max_search_calls
            )
        return ExperienceWrapper(
            env,
            self.client,
            env_id=env_id,
            retrieve=self.cfg.experience.retrieve,
            entries_per_episode=self.cfg.experience.entries_per_episode,
        )

    def acquire_env(self, env_id: str) -> gym.Env:
        with self._pool_lock:
            free = self._pool[env_id]
            if free:
                return free.pop()
        return self.make_env(env_id)

    def release_env(self, env_id: str, env: gym.Env, *, broken: bool = False) -> None:
        if broken:  # an env that raised may be in any state: never reuse it
            try:
                env.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                log.debug("closing a failed env raised", exc_info=True)
            return
        with self._pool_lock:
            self._pool[env_id].append(env)

    def count(self, key: str) -> None:
        with self._pool_lock:
            self.counters[key] += 1

    async def submit(self, request: DistillationRequest) -> None:
        """Deprecated: a cut episode's request is submitted by its env's wrapper (the episode
        driver's ``cut``). Hands ``request`` to the service without blocking the loop (failures
        logged)."""
        warnings.warn(
            "EpisodeRuntime.submit is deprecated: the episode driver's cut() has the "
            "env's wrapper submit a cut episode's request",
            DeprecationWarning,
            stacklevel=2,
        )
        if self.client is None:
            return
        try:
            asubmit = getattr(self.client, "asubmit", None)
            if asubmit is not None:
                await asubmit(request)
            else:
                await self.run(self.client.submit, request)
        except Exception as exc:  # noqa: BLE001 - a down service costs the request, never the episode
            self.count("submit_failures")
            log.warning("submit of a cut episode's request failed: %s", exc)

    def close(self) -> None:
        self.threads.shutdown(wait=False)
        with self._pool_lock:
            envs = [e for pool in self._pool.values() for e in pool]
            self._pool.clear()
        for env in envs:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                log.debug("env close failed", exc_info=True)


_DEFAULT: EpisodeRuntime | None = None
_DEFAULT_LOCK = threading.Lock()


def default_runtime() -> EpisodeRuntime:
    """This process's runtime: set by :func:`set_default_runtime`, else built from the
    launcher's settings."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            from crl_train.openrlhf.settings import load_settings

            _DEFAULT = EpisodeRuntime.from_settings(load_settings())
        return _DEFAULT


def set_default_runtime(runtime: EpisodeRuntime | None) -> None:
    """Use ``runtime`` for instances and executors built without one (None: back to
    the settings)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        _DEFAULT = runtime


# -------------------------------------------------------------------------------------- one episode


class CRLAgentInstance(AgentInstanceBase):
    """One episode of our env behind OpenRLHF's ``reset`` / ``step`` protocol (see the module
    docstring): a translation between OpenRLHF's texts and an
    :class:`~crl_gym.episode.EpisodeDriver`, which plays the episode.

    ``__init__`` is synchronous and cheap (OpenRLHF builds one per sample); the env is taken from
    the runtime's pool in :meth:`reset`.
    """

    def __init__(
        self,
        runtime: EpisodeRuntime | None = None,
        condition: str | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.runtime = runtime if runtime is not None else default_runtime()
        if condition is not None and condition not in CONDITIONS:
            raise ValueError(
                f"condition must be {', '.join(map(repr, CONDITIONS))} or None, got {condition!r}"
            )
        self.condition = condition
        self.tokenizer = tokenizer
        self.task: TaskLabel | None = None
        self.env: Any = None
        self.driver: EpisodeDriver | None = None
        self.error: str | None = None
        self.done = False

    # ------------------------------------------------------------------ what the episode did
    @property
    def episode(self) -> Episode | None:
        """The driver's episode (None before :meth:`reset` took an env)."""
        return None if self.driver is None else self.driver.episode

    @property
    def task_text(self) -> str:
        return self.episode.task if self.episode is not None else ""

    @property
    def admissible(self) -> list[str]:
        return self.episode.admissible if self.episode is not None else []

    @property
    def experience(self) -> ExperienceRef | None:
        return self.episode.experience if self.episode is not None else None

    @property
    def turn_experience(self) -> list[TurnGuidance]:
        return self.episode.turn_experience if self.episode is not None else []

    @property
    def turns(self) -> int:
        return len(self.episode.turns) if self.episode is not None else 0

    @property
    def search_calls(self) -> int:
        return self.episode.search_calls if self.episode is not None else 0

    @property
    def reward(self) -> float:
        return self.episode.ret if self.episode is not None else 0.0

    @property
    def success(self) -> bool:
        return self.episode is not None and self.episode.success and self.error is None

    @property
    def cut_reason(self) -> str | None:
        return self.episode.cut if self.episode is not None else None

    @property
    def request(self) -> DistillationRequest | None:
        return self.episode.request if self.episode is not None else None

    # ------------------------------------------------------------------ protocol
    async def reset(self, states: dict[str, Any], **kwargs: object) -> dict[str, Any]:
        """``{"observation": the chat-rendered first prompt}`` (system prompt +
        first observation)."""
        rt = self.runtime
        label = states.get("label")
        if self.condition is None:  # OpenRLHF's own executor: decided here, still before any await
            self.condition = rt.assigner.assign(label)
        rt.count("episodes")
        tokenizer = kwargs.get("hf_tokenizer") or self.tokenizer or rt.load_tokenizer()
        self.tokenizer = tokenizer
        try:
            self.task = TaskLabel.parse(label)
            self.env = await rt.run(rt.acquire_env, self.task.env_id)
            self.driver = EpisodeDriver(self.env, max_turns=rt.cfg.env.max_turns)
            spec = EpisodeSpec(self.task.env_id, self.task.seed, self.condition)
            first = await rt.run(self.driver.reset, spec)
        except Exception as exc:  # noqa: BLE001 - see the module docstring
            self._fail("reset", exc)
            text = (
                f"The environment failed to start ({type(exc).__name__}). Answer with any action."
            )
            return {"observation": self._render_first(text)}
        return {"observation": self._render_first(first)}

    async def step(self, states: dict[str, Any], **kwargs: object) -> dict[str, Any]:
        """One env turn on the model's ``action_text``: the next user turn as
        ``environment_feedback``."""
        if self.done or self.driver is None:  # failed at reset: this turn's text is not an action
            return self._result("")
        text = str(states.get("action_text", ""))
        eos = str(getattr(self.tokenizer, "eos_token", None) or "")
        after_eos = kwargs.get("after_eos")
        if after_eos is None:
            after_eos = bool(eos) and text.endswith(eos)
        clean = text[: -len(eos)] if eos and text.endswith(eos) else text
        try:
            await self.runtime.run(self.driver.act, clean)
        except Exception as exc:  # noqa: BLE001 - see the module docstring
            self._fail("step", exc)
            return self._result("")
        episode = self.driver.episode
        assert episode is not None
        if episode.done:
            if episode.cut == "turn_cap":
                self.runtime.count("turn_caps")
            self._finish()
            return self._result("")
        shown = self.driver.observe()
        assert shown is not None
        chat = self.runtime.chat(self.tokenizer)
        feedback = chat.user_turn_text(shown, after_eos=bool(after_eos))
        return self._result(feedback)

    # ------------------------------------------------------------------ ending
    async def cut(self, reason: str) -> None:
        """End the episode here as a failure (``turn_cap`` / ``context_truncated``): the driver
        has the env's wrapper submit its request (the env did not end it)."""
        if self.done:
            return
        self.runtime.count("turn_caps" if reason == "turn_cap" else "context_truncations")
        if self.driver is not None:
            await self.runtime.run(self.driver.cut, reason)
        self._finish()

    def _fail(self, where: str, exc: BaseException) -> None:
        self.error = f"{where}: {type(exc).__name__}: {exc}"
        self.runtime.count("env_errors")
        task = self.task or TaskLabel("?", -1)
        log.warning(
            "episode env=%s seed=%s %s: %s failed and ends as a failure (not trained on): %s",
            task.env_id,
            task.seed,
            self.condition,
            where,
            exc,
        )
        self._finish(broken=True)

    def _finish(self, *, broken: bool = False) -> None:
        self.done = True
        if self.env is not None and self.task is not None:
            self.runtime.release_env(self.task.env_id, self.env, broken=broken)
        self.env = None

    # ------------------------------------------------------------------ texts
    def _render_first(self, user: str) -> str:
        chat = self.runtime.chat(self.tokenizer)
        system = self.driver.system if self.driver is not None else system_text()
        return chat.render(plain_messages(first_messages(system, user)))

    def extra_logs(self) -> dict[str, float]:
        return {
            "crl_guided": float(self.condition == GUIDED_CONDITION),
            "crl_experience": float(self.experience is not None),
            "crl_success": float(self.success),
            "crl_valid": float(self.error is None),
            "crl_turns": float(self.turns),
            "crl_search_calls": float(self.search_calls),
            "crl_turn_cap": float(self.cut_reason == "turn_cap"),
            "crl_context_truncated": float(self.cut_reason == "context_truncated"),
            "crl_env_error": float(self.error is not None),
        }

    def _result(self, feedback: str) -> dict[str, Any]:
        r = 1.0 if self.done and self.success else 0.0
        return {
            "rewards": torch.tensor(r),
            "scores": torch.tensor(r),
            "environment_feedback": feedback,
            "done": self.done,
            "extra_logs": self.extra_logs(),
        }


# ------------------------------------------------------------------------------------- the executor


class AgentExecutor(MultiTurnAgentExecutor):
    """OpenRLHF's agent executor for our envs (``AgentExecutor()`` reads the
    launcher's settings)."""

    def __init__(self, runtime: EpisodeRuntime | None = None) -> None:
        super().__init__(CRLAgentInstance)
        self._runtime = runtime

    @property
    def runtime(self) -> EpisodeRuntime:
        if self._runtime is None:
            self._runtime = default_runtime()
        return self._runtime

    async def execute(
        self,
        prompt: Any,
        label: Any,
        sampling_params: Any,
        max_length: int,
        hf_tokenizer: Any,
        llm_engine: Any,
        images: Any = None,
    ) -> dict[str, Any]:
        """One episode; returns the dict OpenRLHF's ``MultiTurnAgentExecutor`` returns
        (same keys)."""
        rt = self.runtime
        condition = rt.assigner.assign(label)  # before the first await: the order of the K samples
        inst = CRLAgentInstance(rt, condition=condition, tokenizer=hf_tokenizer)
        first = (
            await inst.reset({"observation": prompt, "label": label}, hf_tokenizer=hf_tokenizer)
        )["observation"]
        per_turn = rt.cfg.actor.max_new_tokens
        tokens = _encode(hf_tokenizer, first)
        if len(tokens) > max_length - per_turn:
            log.warning(
                "first prompt (%d tokens) leaves less than actor.max_new_tokens (%d) of max_length "
                "(%d): kept its last tokens",
                len(tokens),
                per_turn,
                max_length,
            )
            tokens = tokens[-max(1, max_length - per_turn) :]
        eos_ids = _eos_ids(hf_tokenizer)
        want_logprobs = getattr(sampling_params, "logprobs", None) is not None
        logprobs: list[float] | None = [0.0] * len(tokens) if want_logprobs else None
        ranges: list[tuple[int, int]] = []
        observation_text = first
        truncated = False
        while True:
            budget = min(per_turn, max_length - len(tokens))
            if budget <= 0:
                await inst.cut("context_truncated")
                break
            params = deepcopy(sampling_params)
            params.max_tokens = budget
            out = await llm_engine.generate(tokens, params, multi_modal_data=None)
            comp = out.outputs[0]
            action = [int(t) for t in comp.token_ids]
            ranges.append((len(tokens), len(tokens) + len(action)))
            tokens += action
            if logprobs is not None:
                logprobs += _action_logprobs(comp, action)
            truncated = comp.finish_reason == "length"
            result = await inst.step(
                {
                    "observation_text": observation_text,
                    "action_text": comp.text,
                    "label": label,
                    "sampling_params": params,
                },
                after_eos=bool(action) and action[-1] in eos_ids,
            )
            observation_text += comp.text
            if result["done"]:
                break
            feedback = _encode(hf_tokenizer, result["environment_feedback"])
            if len(tokens) + len(feedback) + per_turn > max_length:
                await inst.cut("context_truncated")
                break
            tokens += feedback
            observation_text += result["environment_feedback"]
            if logprobs is not None:
                logprobs += [0.0] * len(feedback)
        reward = 1.0 if inst.success else 0.0
        return {
            "prompt": prompt,
            "label": label,
            "images": images,
            "mm_train_inputs": None,
            "reward": reward,
            "scores": reward,
            "observation_tokens": tokens,
            "action_ranges": ranges,
            "rollout_log_probs": logprobs,
            "truncated": truncated,
            "extra_logs": inst.extra_logs(),
        }


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def _eos_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in eos} if isinstance(eos, (list, tuple)) else {int(eos)}


def _action_logprobs(comp: Any, action: list[int]) -> list[float]:
    """The sampled tokens' log-probs of one completion (vLLM: one ``{token: Logprob}``
    per position)."""
    steps = comp.logprobs
    if steps is None or len(steps) != len(action):
        raise ValueError(
            f"the engine returned {None if steps is None else len(steps)} log-prob entries for "
            f"{len(action)} tokens; was SamplingParams.logprobs set?"
        )
    return [
        float(getattr(step[tok], "logprob", step[tok]))
        for tok, step in zip(action, steps, strict=True)
    ]


__all__ = [
    "EXTRA_LOG_KEYS",
    "AgentExecutor",
    "CRLAgentInstance",
    "ConditionAssigner",
    "EpisodeRuntime",
    "TaskLabel",
    "default_runtime",
    "set_default_runtime",
]
