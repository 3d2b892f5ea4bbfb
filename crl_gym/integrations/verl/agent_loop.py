"""``crl_agent``: a verl agent loop that plays one episode of a wrapped env per sample.

verl (``verl.experimental.agent_loop.agent_loop``) builds the loop with ``hydra.utils.instantiate``
for every sample, passing the trainer config, ``server_manager`` (the inference servers), the
tokenizer and the keys of the loop's entry in the YAML at
``actor_rollout_ref.rollout.agent.agent_loop_config_path`` (``env_id``, ``service_url``, ...: the
keyword arguments of :class:`ExperienceAgentLoop`), then awaits ``run(sampling_params, **row)``.

One episode:

* the env (``crl_gym.envs.make(env_id, **env_kwargs)``: any ``crl/`` id, or a user's text env by id,
  by ``"module:EnvId-v0"`` or through an entry point) under ``ExperienceWrapper`` (and
  ``SearchAndAskWrapper`` when ``search_and_ask``) over the process's
  :func:`~crl_gym.integrations.verl.service.service_client`;
* reset with the row's seed as ``extra_info.experience`` says (guided: the wrapper puts the best
  entry in front of the first observation; :mod:`~crl_gym.integrations.verl.rows`), with
  ``rollout_step`` = the row's ``global_steps`` (verl's v1 trainer puts the step in every row), or
  -1 for an ``evaluation`` row, which the service never credits;
* then ``server_manager.generate`` and ``env.step`` alternate, the episode played by
  :class:`~crl_gym.integrations.verl.episode.VerlEpisode` (the episode driver: its user turns, its
  reading of the reply, its cuts; :mod:`crl_gym.episode`). Tokens go through verl's
  Continuous Token helpers (``ct_merge_assistant_token`` / ``ct_merge_context_msg``): generated
  tokens have ``response_mask`` 1, observation tokens (a ``search_and_ask`` answer included) 0; the
  experience entry sits in the first user turn, in the prompt, never trained on.
* The episode ends when the env ends it (the wrapper submits its request), or is cut by
  ``max_turns`` or ``rollout.response_length`` (:meth:`ExperienceWrapper.end_episode` submits
  it, as a failure); the client is then flushed, so the request is at the service before the
  trainer's ``end_step`` for the step.

``reward_score`` is 1.0 on success else 0.0 (the paper's R), or the return with ``reward="return"``.
``extra_fields`` (per-sample columns of verl's batch): ``crl_condition`` (the condition the
episode ran: a guided row whose search failed, the service down, ran free), ``crl_entry`` (the shown
entry's id), ``crl_group``, ``crl_valid`` (False: the env raised; the episode is a failure and gets
no advantage), ``crl_success``, ``crl_turns``, ``crl_rollout_step``, ``crl_cut`` (``"turns"`` /
``"context"`` / None), and what the server reported (``min_global_steps`` / ``max_global_steps``:
the weight versions, which verl's v1 trainer reads). An env error in ``step`` never raises out of
``run`` (it would fail the whole ``asyncio.gather`` of the worker's batch); one in ``reset`` does (a
wrong env id or seed is a set-up error).
"""

from __future__ import annotations

import asyncio
import logging
import warnings
from collections.abc import Mapping
from typing import Any
from uuid import uuid4

import gymnasium as gym

from crl_gym.integrations.verl import verl_required

with verl_required(__name__):
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopBase,
        AgentLoopMetrics,
        AgentLoopOutput,
        _agent_loop_registry,
    )
    from verl.utils.profiler import simple_timer

from crl_gym.episode import read_answer
from crl_gym.integrations.episodes import check_reward, rollout_reward, with_actions
from crl_gym.integrations.verl.episode import VerlEpisode, row_spec
from crl_gym.integrations.verl.rows import AGENT_NAME, row_extra
from crl_gym.integrations.verl.service import DEFAULT_TIMEOUT_S, service_client
from crl_gym.wrappers import wrap
from crl_gym.wrappers.experience import ExperienceWrapper

logger = logging.getLogger(__name__)

DEFAULT_MAX_TURNS = 16


def parse_action(text: str) -> str:
    """Deprecated: the action the episode driver reads in ``text``
    (:func:`crl_gym.episode.read_answer`): the last ``<action>...</action>``, else all of
    ``text`` stripped.

    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", DeprecationWarning)
    ...     parse_action("I think <action>east</action>"), parse_action(" north ")
    ('east', 'north')
    """
    warnings.warn(
        "crl_gym.integrations.verl.agent_loop.parse_action is deprecated: use "
        "crl_gym.episode.read_answer",
        DeprecationWarning,
        stacklevel=2,
    )
    return read_answer(text).action


def _plain(value: object) -> object:
    """An OmegaConf node from the YAML as plain Python (hydra passes nested config
    as DictConfig)."""
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


class ExperienceAgentLoop(AgentLoopBase):
    """One episode of a wrapped env per sample (module docstring).

    Args (the YAML entry's keys, besides verl's own):
        env_id: the Gymnasium id of the env (a row's ``extra_info.env_id`` overrides it).
        env_kwargs: keyword arguments of ``gym.make``.
        service_url: ``crl-experience serve``'s url (else ``$CRL_EXPERIENCE_URL``).
        token_file: the service's token (else ``$CRL_EXPERIENCE_TOKEN``).
        search_and_ask: wrap in ``SearchAndAskWrapper``: an action ``search_and_ask[<query>]`` is
            answered from the bank without stepping the env.
        max_calls: ``search_and_ask`` calls per episode.
        max_turns: env steps before the episode is cut (a failure).
        reward: ``"success"`` (1.0 / 0.0) or ``"return"`` (the sum of the env's rewards).
        timeout_s: the client's timeout per call.
    """

    def __init__(
        self,
        *args: Any,
        env_id: str | None = None,
        env_kwargs: Mapping[str, Any] | None = None,
        service_url: str | None = None,
        token_file: str | None = None,
        search_and_ask: bool = False,
        max_calls: int = 2,
        max_turns: int = DEFAULT_MAX_TURNS,
        reward: str = "success",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("name", None)  # the registry entry's own key, passed along by hydra
        super().__init__(*args, **kwargs)
        check_reward(reward)
        if int(max_turns) < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.env_id = env_id
        plain_kwargs = _plain(env_kwargs) or {}
        if not isinstance(plain_kwargs, Mapping):
            raise TypeError(f"env_kwargs: a mapping, got {type(plain_kwargs).__name__}")
        self.env_kwargs = dict(plain_kwargs)
        self.client = service_client(service_url, token_file, timeout_s=float(timeout_s))
        self.search_and_ask = bool(search_and_ask)
        self.max_calls = int(max_calls)
        self.max_turns = int(max_turns)
        self.reward = reward
        self.response_length = int(self.rollout_config.response_length)

    def make_env(self, env_id: str | None) -> ExperienceWrapper:
        """The env of ``env_id`` (else the loop's), under our wrappers."""
        env_id = env_id or self.env_id
        if not env_id:
            raise ValueError(
                "no env: give env_id in the agent loop's config or extra_info.env_id in the row"
            )
        # any Gymnasium id, "module:EnvId-v0" and entry points included
        from crl_gym.envs import make

        return wrap(
            make(env_id, **self.env_kwargs),
            self.client,
            search_and_ask=self.search_and_ask,
            max_calls=self.max_calls,
            env_id=env_id,
        )

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        extra = row_extra(kwargs)
        env_id = extra.get("env_id") or self.env_id
        spec = row_spec(extra, str(env_id or ""), kwargs.get("global_steps"))
        metrics: dict[str, float] = {}
        env = await asyncio.to_thread(self.make_env, extra.get("env_id"))
        episode = _Episode(spec.condition)
        played = VerlEpisode(env, max_turns=self.max_turns)
        try:
            prompt = _plain(kwargs.get("raw_prompt")) or []
            if not isinstance(prompt, list):
                raise TypeError(f"raw_prompt: a list of chat messages, got {type(prompt).__name__}")
            with simple_timer("tool_calls", metrics):
                messages = await asyncio.to_thread(played.start, spec, prompt)
            shown = played.played.experience
            episode.entry = None if shown is None else shown.id
            ids = episode.ids = await self.ct_build_initial_tokens(list(messages))
            await self._play(played, episode, ids, sampling_params, metrics)
        finally:
            await asyncio.to_thread(_close, env)
        if played.driver.episode is not None:
            done = played.played
            episode.success, episode.ret, episode.turns = done.success, done.ret, len(done.turns)
            episode.request, episode.cut = done.request, played.cut_label
            episode.condition = str(done.condition)
        await asyncio.to_thread(self.client.flush)
        return self._output(episode, extra, spec.rollout_step, metrics)

    async def _play(
        self,
        played: VerlEpisode,
        episode: _Episode,
        ids: list[int],
        sampling_params: dict[str, Any],
        metrics: dict[str, float],
    ) -> None:
        request_id = uuid4().hex
        while True:
            with simple_timer("generate_sequences", metrics):
                out = await self.server_manager.generate(
                    request_id=request_id, prompt_ids=ids, sampling_params=sampling_params
                )
            merged, episode.mask, logprobs = await self.ct_merge_assistant_token(
                ids,
                list(out.token_ids),
                episode.mask,
                episode.logprobs if (episode.logprobs or out.log_probs) else None,
                assistant_logprobs=list(out.log_probs) if out.log_probs else None,
            )
            ids = episode.ids = list(merged.token_ids)
            episode.logprobs = list(logprobs or [])
            episode.server_fields(dict(out.extra_fields or {}))
            text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            try:
                with simple_timer("tool_calls", metrics):
                    previous = await asyncio.to_thread(played.answer, text)
            except Exception as exc:  # noqa: BLE001 - an env error ends this episode, never the batch
                logger.warning(
                    "crl_agent: the env raised on step %d (%s: %s); the episode ends as a failure",
                    len(played.played.turns),
                    type(exc).__name__,
                    exc,
                )
                episode.valid = False
                return
            if previous is None:  # the env ended it, or the driver's turn cap cut it
                return
            if len(episode.mask) >= self.response_length:
                await asyncio.to_thread(played.cut_context)
                return
            merged, mask, logprobs = await self.ct_merge_context_msg(
                previous, list(played.messages), ids, episode.mask, episode.logprobs or None
            )
            if len(mask) >= self.response_length:  # the observation does not fit: stop before it
                await asyncio.to_thread(played.cut_context)
                return
            ids = episode.ids = list(merged.token_ids)
            episode.mask = list(mask)
            episode.logprobs = list(logprobs or [])

    def _output(
        self,
        episode: _Episode,
        extra: Mapping[str, Any],
        step: int | None,
        metrics: dict[str, float],
    ) -> AgentLoopOutput:
        n_response = len(episode.mask)
        prompt_ids = episode.ids[: len(episode.ids) - n_response]
        response_ids = episode.ids[len(episode.ids) - n_response :]
        cap = self.response_length
        score = (
            rollout_reward(self.reward, success=episode.success, ret=episode.ret)
            if episode.valid
            else 0.0
        )
        group = extra.get("group")
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids[:cap],
            response_mask=episode.mask[:cap],
            response_logprobs=episode.logprobs[:cap] if episode.logprobs else None,
            reward_score=score,
            num_turns=2 * episode.turns + 1,
            metrics=AgentLoopMetrics(
                **{k: v for k, v in metrics.items() if k in AgentLoopMetrics.model_fields}
            ),
            extra_fields={
                **episode.server,
                "turn_scores": [],
                "tool_rewards": [],
                "crl_condition": episode.condition,
                "crl_entry": episode.entry,
                "crl_group": None if group is None else int(group),
                "crl_valid": episode.valid,
                "crl_success": episode.success,
                "crl_turns": episode.turns,
                "crl_rollout_step": step,
                "crl_cut": episode.cut,
            },
        )


def register_loop() -> None:
    """Register :class:`ExperienceAgentLoop` as ``crl_agent`` in this process (done on import).

    What verl's ``@register`` does, except that an entry the YAML already put there is kept: hydra
    imports this module while the worker's first sample is built, after the worker loaded the YAML,
    and ``@register`` would replace the YAML's entry (its env and service) for every later sample.
    """
    target = f"{ExperienceAgentLoop.__module__}.{ExperienceAgentLoop.__qualname__}"
    _agent_loop_registry.setdefault(AGENT_NAME, {"_target_": target})


register_loop()


class _Episode:
    """What one ``run`` keeps while it plays."""

    def __init__(self, condition: str) -> None:
        self.condition = condition
        self.entry: int | None = None
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.turns = 0
        self.ret = 0.0
        self.success = False
        self.valid = True
        self.cut: str | None = None
        self.request: Any = None
        self.server: dict[str, object] = {}
        """What the inference server reported (``min_global_steps`` / ``max_global_steps``: the
        weight versions the episode was generated with, which verl's v1 trainer reads
        for staleness)."""

    def server_fields(self, fields: Mapping[str, object]) -> None:
        """Keep the first generation's fields, then the latest ``max_global_steps`` (as
        ``ToolAgentLoop``)."""
        if not self.server:
            self.server.update(fields)
        elif fields.get("max_global_steps") is not None:
            self.server["max_global_steps"] = fields["max_global_steps"]


def _close(env: gym.Env) -> None:
    try:
        env.close()
    except Exception:  # noqa: BLE001 - closing is best effort
        logger.debug("closing an env raised", exc_info=True)


__all__ = ["ExperienceAgentLoop", "parse_action", "register_loop", "with_actions"]
