"""Our wrapped text envs as TRL 1.16 environments: ``GRPOTrainer(environment_factory=...)``.

TRL's multi-turn contract (``trl/trainer/grpo_trainer.py``, ``GRPOTrainer.__init__`` and
``_generate_and_score_completions``): ``environment_factory()`` builds one instance per rollout
(pooled and reused); ``reset(**row)`` gets the dataset row and returns text appended to the last
user message; every public method of the class other than ``reset`` / ``get_reward`` is a tool,
described to the model by its type hints and Google-style docstring; ``get_reward()`` is called
once per finished rollout and its float is the rollout's reward.

:class:`TRLExperience` is what the envs of one run share (the client, how to make the env, the
open rollout step); its :meth:`~TRLExperience.environment_factory` makes :class:`ExperienceEnv`
instances, each a Gymnasium text env under ``ExperienceWrapper`` (and ``SearchAndAskWrapper``
when asked: :class:`SearchAndAskEnv` adds the ``search_and_ask`` tool) played by an
:class:`~crl_gym.episode.EpisodeDriver`: the texts the model reads are the driver's (the same as
under every other loop), the env's action is the ``take_action`` tool's argument.
:meth:`~TRLExperience.callback` is a ``TrainerCallback`` that closes each
TRL optimizer step with ``client.end_step``.

Guided or free comes from the row's ``experience`` column: ``"guided"`` or ``"free"`` for every
generation of the row, or ``"split"`` (the default when the column is absent) for the paper's
half guided, half free, which ``crl_train.integrations.trl.ComplementaryGRPOTrainer`` resolves
per generation before ``reset`` sees the row (TRL's own trainer cannot: a row's generations get
identical rows, so ``reset`` refuses ``"split"``). The row's ``seed`` seeds the env's reset, so
all generations of one row play the same task: one rollout group.

>>> from crl_gym.clients import LocalClient
>>> from crl_gym.experience.bank import ExperienceBank
>>> from crl_gym.experience.embedders import HashingEmbedder
>>> from crl_gym.experience.manager import ExperienceManager
>>> from crl_gym.experience.service import RetrievalService
>>> from crl_gym.protocol import AddOp
>>> from crl_gym.wrappers.examples import CorridorEnv
>>> service = RetrievalService(ExperienceManager(ExperienceBank(None, dim=64), HashingEmbedder(64)))
>>> client = LocalClient(service)
>>> _ = client.apply_ops([AddOp("Walk east until the exit.")])
>>> session = TRLExperience(client, lambda: CorridorEnv(length=1))
>>> env = session.environment_factory()
>>> print(env.reset(prompt=[], seed=0, experience="guided"))
Experience from similar tasks (use it if it helps):
Walk east until the exit.
<BLANKLINE>
You are at cell 0 of a corridor; the exit is at cell 1, to the east.
Valid actions: east, west
>>> print(env.take_action("east"))
You are at cell 1 of a corridor; the exit is at cell 1, to the east.
The episode is over: success.
>>> env.get_reward(), env.condition, service.stats().queue_depth
(1.0, 'guided', 1)
>>> client.end_step(0).step
0
>>> client.close()
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import gymnasium as gym

from crl_gym.clients.keeping import KeepingClient
from crl_gym.clients.run_steps import RunSteps
from crl_gym.episode import Answer, EpisodeDriver, EpisodeSpec, condition_of
from crl_gym.experience.results import StepEnded
from crl_gym.integrations.episodes import check_reward, rollout_reward
from crl_gym.protocol import CONDITIONS, FREE_CONDITION, Condition, DistillationRequest
from crl_gym.templates import SYSTEM_TOOLS
from crl_gym.wrappers import wrap

try:  # transformers is in the [train] extra; the callback subclasses its TrainerCallback
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "crl_gym.integrations.trl needs transformers and trl: pip install 'complementary-rl[train]'"
    ) from exc

if TYPE_CHECKING:
    from crl_gym.clients import ExperienceClient

logger = logging.getLogger(__name__)

SPLIT = "split"
"""Row value of ``experience``: half of the row's generations guided, half free (the trainer
decides which)."""
EXPERIENCE_VALUES: tuple[str, ...] = (*CONDITIONS, SPLIT)
DEFAULT_INSTRUCTION = SYSTEM_TOOLS
"""The system message :func:`dataset_rows` puts in each prompt (the episode driver's for a model
that answers by calling tools: :func:`crl_gym.episode.system_text`)."""
OVER = "The episode is over: {outcome}."


class TRLRow(TypedDict):
    """One TRL dataset row of :func:`dataset_rows`."""

    prompt: list[dict[str, str]]
    seed: int
    experience: str


def dataset_rows(
    seeds: list[int],
    *,
    experience: str = SPLIT,
    instruction: str = DEFAULT_INSTRUCTION,
) -> list[TRLRow]:
    """One TRL dataset row per seed: a conversational ``prompt`` whose user turn ``reset`` fills
    with the first observation, the ``seed``, and ``experience`` (``"split"``, ``"guided"``
    or ``"free"``).

    >>> dataset_rows([3], experience="free")[0]["prompt"][1]
    {'role': 'user', 'content': ''}
    >>> dataset_rows([3])[0]["seed"], dataset_rows([3])[0]["experience"]
    (3, 'split')
    """
    if experience not in EXPERIENCE_VALUES:
        raise ValueError(f"experience must be one of {EXPERIENCE_VALUES}, got {experience!r}")
    return [
        {
            "prompt": [{"role": "system", "content": instruction}, {"role": "user", "content": ""}],
            "seed": int(seed),
            "experience": experience,
        }
        for seed in seeds
    ]


def split_conditions(
    experience: list[object], positions: list[int], num_generations: int, *, guided: bool = True
) -> list[Condition]:
    """The condition of each generation: a ``"split"`` (or missing) row's first
    ``num_generations // 2`` copies are guided, the rest free (every copy free when not
    ``guided``: a method without experience; :func:`crl_gym.episode.condition_of`);
    ``"guided"`` / ``"free"`` rows keep theirs.

    >>> split_conditions(["split"] * 4 + ["free", None], [0, 1, 2, 3, 0, 1], 4)
    ['guided', 'guided', 'free', 'free', 'free', 'guided']
    >>> split_conditions(["split"] * 2, [0, 1], 2, guided=False)
    ['free', 'free']
    """
    out: list[Condition] = []
    for value, j in zip(experience, positions, strict=True):
        if value is None or value == SPLIT:
            out.append(condition_of(j, num_generations, guided=guided))
        elif value in CONDITIONS:
            out.append(value)
        else:
            raise ValueError(
                f"a row's experience must be 'split', "
                f"{' or '.join(map(repr, CONDITIONS))}, got {value!r}"
            )
    return out


class TRLExperience:
    """What the TRL environments of one run share.

    Args:
        client: the experience service (``RemoteClient`` to ``crl-experience serve``, or
            ``LocalClient``).
        make_env: a Gymnasium env id (made with ``crl_gym.envs.make(make_env, **env_kwargs)``) or a
            callable returning a new text env.
        env_kwargs: keyword arguments of ``gym.make`` for an id.
        search_and_ask: also wrap in ``SearchAndAskWrapper`` and offer its ``search_and_ask`` tool.
        max_calls: ``search_and_ask`` calls per episode.
        reward: ``"success"`` (1.0 when the episode succeeded, else 0.0: the paper's R) or
            ``"return"`` (the sum of the env's rewards).
        spill_path: where the wrappers keep requests the client could not take
            (``ExperienceWrapper``).

    ``step`` is the open rollout step: the TRL optimizer step being generated (set by
    :meth:`callback` at each step's start); every episode's request carries it, and the callback's
    ``end_step(t)`` at the end of step ``t`` credits the entries those episodes used. The run has
    its own step space on the service (:attr:`steps`, a :class:`~crl_gym.clients.RunSteps`): its
    step ``t`` is the service's ``steps.base + t``, so runs started one after another against one
    long-lived ``crl-experience serve`` never end a step twice (``ended`` holds the
    service's numbers).
    """

    def __init__(
        self,
        client: ExperienceClient,
        make_env: str | Callable[[], gym.Env],
        *,
        env_kwargs: Mapping[str, Any] | None = None,
        search_and_ask: bool = False,
        max_calls: int = 2,
        reward: str = "success",
        spill_path: str | Path | None = None,
    ) -> None:
        check_reward(reward)
        if not isinstance(make_env, str) and not callable(make_env):
            raise TypeError(
                f"make_env must be an env id or a callable, got {type(make_env).__name__}"
            )
        self.client = client
        self._make = make_env
        self._env_kwargs = dict(env_kwargs or {})
        self.search_and_ask = search_and_ask
        self.max_calls = max_calls
        self.reward = reward
        self.spill_path = spill_path
        self.step = 0
        self.steps = RunSteps(client)
        """This run's step space on the service (read at the first episode or ``end_step``)."""
        self.ended: list[StepEnded] = []
        """What each ``end_step`` answered, in order (``step``, ``credited``, ...)."""
        self.envs_made = 0

    def make_env(self) -> gym.Env:
        """A new base env (before the wrappers)."""
        if isinstance(self._make, str):
            # any Gymnasium id, "module:EnvId-v0" and entry points included
            from crl_gym.envs import make

            return make(self._make, **self._env_kwargs)
        return self._make()

    def environment_factory(self) -> ExperienceEnv:
        """A new rollout env: pass this method as ``GRPOTrainer(environment_factory=...)``."""
        self.envs_made += 1
        return SearchAndAskEnv(self) if self.search_and_ask else ExperienceEnv(self)

    def end_step(self, step: int) -> StepEnded:
        """``end_step`` of this run's ``step`` on the service: it credits every entry used in
        that step."""
        result = self.steps.end_step(step)
        self.ended.append(result)
        return result

    def callback(self) -> EndStepCallback:
        """The ``TrainerCallback`` that keeps ``step`` and calls :meth:`end_step` once per
        optimizer step."""
        return EndStepCallback(self)


class EndStepCallback(TrainerCallback):
    """Sets the open rollout step at each TRL optimizer step's start; ends it at its end.

    ``on_step_begin`` runs before the step's first micro-batch, where GRPOTrainer generates (its
    ``_prepare_inputs``), so the episodes of step ``t`` carry ``rollout_step = t``;
    ``on_step_end`` runs after the optimizer step (``state.global_step`` is then ``t + 1``).
    """

    def __init__(self, session: TRLExperience) -> None:
        self.session = session

    def on_step_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: object,
    ) -> None:
        self.session.step = int(state.global_step)

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: object,
    ) -> None:
        result = self.session.end_step(int(state.global_step) - 1)
        logger.info("experience: step %d ended: %s", state.global_step - 1, result)


class ExperienceEnv:
    """One TRL rollout: a wrapped text env whose action is the ``take_action`` tool, played by an
    :class:`~crl_gym.episode.EpisodeDriver` (this class only translates TRL's calls).

    Public methods are TRL tools; everything else is private or a property on purpose.
    """

    def __init__(self, session: TRLExperience) -> None:
        self._session = session
        self._wrapper = wrap(
            session.make_env(),
            KeepingClient(session.client, spill_path=session.spill_path),
            search_and_ask=session.search_and_ask,
            max_calls=session.max_calls,
        )
        self._driver = EpisodeDriver(self._wrapper, tools=True)
        self._open = False

    # ------------------------------------------------------------------ TRL's contract
    def reset(self, **row: Any) -> str:
        """Start an episode for one generation of ``row`` (TRL passes the dataset row's columns)."""
        experience = row.get("experience", SPLIT)
        if experience == SPLIT:
            raise ValueError(
                "row says experience='split' (or has no 'experience' column): the per-generation "
                "split is made by crl_train.integrations.trl.ComplementaryGRPOTrainer; with TRL's "
                "own GRPOTrainer give each row experience='guided' or 'free' (one row of each per "
                "task gives TRL's per-row groups the two halves)"
            )
        if experience not in CONDITIONS:
            raise ValueError(
                f"row's experience must be one of {EXPERIENCE_VALUES}, got {experience!r}"
            )
        seed = row.get("seed")
        if seed is not None and type(seed) is not int:
            seed = int(seed)
        if (
            self._open
        ):  # TRL reuses instances: an episode left open (no get_reward) still gets distilled
            self._end()
        session = self._session
        spec = EpisodeSpec(
            self._wrapper.env_id,
            seed,
            experience,
            rollout_step=session.steps.service_step(session.step),
        )
        first = self._driver.reset(spec)
        self._open = True
        return first

    def take_action(self, action: str) -> str:
        """Take one action in the environment (one turn of the episode).

        Args:
            action: The action to take, written exactly as one of the admissible actions.

        Returns:
            The next observation, or the outcome once the episode is over.
        """
        if not self._open:
            return self._over()
        return self._step(Answer(str(action), readable=True, tool_call=False))

    def get_reward(self) -> float:
        """The rollout's reward; ends the episode (as truncated) when the model stopped before
        the env did."""
        if self._open:
            self._end()
        episode = self._driver.episode
        if episode is None:
            return rollout_reward(self._session.reward, success=False, ret=0.0)
        return rollout_reward(self._session.reward, success=episode.success, ret=episode.ret)

    # ------------------------------------------------------------------ what the trainer reads
    @property
    def condition(self) -> str:
        """``"guided"`` or ``"free"``: the condition the episode ran under (its request's,
        once ended)."""
        episode = self._driver.episode
        return FREE_CONDITION if episode is None else episode.condition

    @property
    def request(self) -> DistillationRequest | None:
        """The episode's distillation request once it ended (``None`` before, or when refused)."""
        episode = self._driver.episode
        return None if episode is None else episode.request

    @property
    def turns(self) -> int:
        """Env steps taken by the episode (``search_and_ask`` calls included)."""
        episode = self._driver.episode
        return 0 if episode is None else len(episode.turns)

    # ------------------------------------------------------------------ internals
    def _step(self, answer: Answer) -> str:
        shown = self._driver.step(answer)
        if shown is not None:
            return shown
        self._open = False
        return f"{self._driver.observation}\n{self._over()}"

    def _over(self) -> str:
        episode = self._driver.episode
        won = episode is not None and episode.success
        return OVER.format(outcome="success" if won else "failure")

    def _end(self) -> None:
        self._open = False
        self._driver.end()


class SearchAndAskEnv(ExperienceEnv):
    """:class:`ExperienceEnv` with the ``search_and_ask`` tool
    (``SearchAndAskWrapper`` underneath)."""

    def search_and_ask(self, query: str) -> str:
        """Ask the experience bank for advice when stuck; does not take a turn in the environment.

        Args:
            query: What you are stuck on, in a sentence.

        Returns:
            The advice found for the query, followed by the current observation.
        """
        if not self._open:
            return self._over()
        return self._step(Answer(f"search_and_ask[{query}]", readable=True, tool_call=True))


__all__ = [
    "DEFAULT_INSTRUCTION",
    "EXPERIENCE_VALUES",
    "SPLIT",
    "EndStepCallback",
    "ExperienceEnv",
    "split_conditions",
    "SearchAndAskEnv",
    "TRLExperience",
    "TRLRow",
    "dataset_rows",
]
