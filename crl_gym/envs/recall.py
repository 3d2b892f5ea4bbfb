"""Recall: a diagnostic text env in which one successful episode holds the whole answer.

Each task has a two-word name ("amber falcon") and a secret sequence of ``length`` actions over
``num_actions`` action words; the secret depends only on the task (its index and ``secret_seed``),
never on the episode's seed. The agent plays the sequence one action per turn: the first wrong
action ends the episode with reward 0, the last right one ends it with reward 1. A random agent
succeeds with probability (1/A)^L; an agent shown the winning actions of an earlier episode of the
same task succeeds every time, if it copies them. So experience provably helps here: with a bank
and retrieval that work, a guided method beats GRPO on tasks it has seen before as soon as the
actor copies (docs/environments.md says when the tiny actor does).

``reset(seed=s)`` plays task ``s % num_tasks`` (the same task for every seed of that residue);
``reset()`` without a seed draws the task from the env's RNG. ``noise`` is the probability that an
observation hides the actions taken so far (drawn per observation from the episode's RNG).

>>> env = RecallEnv(num_tasks=4, length=2, num_actions=3)
>>> obs, info = env.reset(seed=1)
>>> info["task"]
'Task bold falcon: repeat the 2 secret actions of bold falcon.'
>>> info["admissible_actions"]
('north', 'east', 'south')
>>> for action in env.secret:
...     obs, reward, terminated, truncated, info = env.step(action)
>>> reward, terminated, info["success"]
(1.0, True, True)
"""

from __future__ import annotations

import re

import numpy as np

from crl_gym.envs.base import TextEnv, lookup_action
from crl_gym.json_types import EnvInfo, EnvOptions

ACTION_WORDS: tuple[str, ...] = ("north", "east", "south", "west", "up", "down", "left", "right")
"""The action vocabulary; a task with ``num_actions=A`` uses the first A words."""
FIRST_WORDS: tuple[str, ...] = (
    "amber", "bold", "coral", "dusty", "eager", "fuzzy", "gentle", "hollow",
    "ivory", "jolly", "keen", "lunar", "misty", "noble", "olive", "plush",
)  # fmt: skip
SECOND_WORDS: tuple[str, ...] = (
    "badger", "falcon", "heron", "lynx", "otter", "panda", "quail", "raven",
    "salmon", "tiger", "viper", "walrus", "yak", "zebra", "bison", "crane",
)  # fmt: skip
"""Task names are one word of each list; the first 16 tasks share no word, so retrieval by the
task text can tell them apart (see :func:`task_name`)."""
MAX_TASKS = len(FIRST_WORDS) * len(SECOND_WORDS)
HIDDEN = "(hidden this turn)"
"""What an observation shows instead of the history when the noise hides it."""


def task_name(index: int) -> str:
    """The name of task ``index`` (0 ≤ index < :data:`MAX_TASKS`), distinct for every index.

    Task i pairs first word ``i mod 16`` with second word ``(i + i div 16) mod 16``: within each
    block of 16 tasks no word repeats, and no pair repeats below 256.

    >>> [task_name(i) for i in (0, 1, 16)]
    ['amber badger', 'bold falcon', 'amber falcon']
    """
    if not 0 <= index < MAX_TASKS:
        raise ValueError(f"task index must be in [0, {MAX_TASKS}), got {index}")
    n1, n2 = len(FIRST_WORDS), len(SECOND_WORDS)
    return f"{FIRST_WORDS[index % n1]} {SECOND_WORDS[(index % n1 + index // n1) % n2]}"


def task_secret(index: int, length: int, num_actions: int, secret_seed: int = 0) -> tuple[str, ...]:
    """The secret of task ``index``: ``length`` action words drawn from its own RNG stream
    (``secret_seed``, ``index``), so it never depends on the episode's seed.

    >>> task_secret(3, 4, 2) == task_secret(3, 4, 2)
    True
    """
    rng = np.random.default_rng([secret_seed, index])
    return tuple(ACTION_WORDS[int(i)] for i in rng.integers(num_actions, size=length))


_NAME_INDEX = {task_name(i): i for i in range(MAX_TASKS)}
_TASK_IN_TEXT = re.compile(r"Task (\w+ \w+): repeat the \d+ secret actions")


def holds_secret(
    entry: str, context: str, *, length: int, num_actions: int, secret_seed: int = 0
) -> bool | None:
    r"""Whether an experience entry holds its task's secret: the action words it names, in order,
    are exactly the secret of the Recall task named in ``context`` (the entry's distillation prompt,
    or the task text). ``None`` when ``context`` names no Recall task. Only the task's own A action
    words are read (prose such as "the right move" is not an action when A < 8); an entry that names
    any other of them, or the right ones in another order, does not hold it.

    >>> holds_secret("Winning actions:\nnorth\nsouth",
    ...              "Task amber badger: repeat the 2 secret actions of amber badger.",
    ...              length=2, num_actions=4) == (task_secret(0, 2, 4) == ("north", "south"))
    True
    >>> holds_secret("go north", "a MiniHack room", length=1, num_actions=2) is None
    True
    """
    found = _TASK_IN_TEXT.search(context)
    if found is None or found.group(1) not in _NAME_INDEX:
        return None
    secret = task_secret(_NAME_INDEX[found.group(1)], length, num_actions, secret_seed)
    words = re.compile(r"\b(" + "|".join(ACTION_WORDS[:num_actions]) + r")\b", re.IGNORECASE)
    return tuple(w.lower() for w in words.findall(entry)) == secret


class RecallEnv(TextEnv):
    """Repeat a task's secret action sequence (see the module docstring).

    Args:
        num_tasks: how many distinct tasks the seeds cycle through (≤ 256).
        length: L, actions in each secret.
        num_actions: A, action words in use (2–8): ``north east south west up down left right``.
        noise: probability that an observation hides the actions taken so far.
        secret_seed: seed of the secrets (the same for every episode of a task).
        max_turns: turns before truncation; invalid actions count (default ``2 * length``).
        render_mode: ``None`` or ``"ansi"``.

    An invalid action is a turn that changes nothing: its observation lists the valid actions and
    ``info["invalid_action"]`` is True. Info keys: ``task`` (the task text: the retrieval query),
    ``task_category`` (the task name), ``task_index``, ``admissible_actions``, ``turn``,
    ``progress`` (right actions so far), ``history_hidden``, ``success``, ``invalid_action``.
    """

    def __init__(
        self,
        num_tasks: int = 16,
        length: int = 4,
        num_actions: int = 4,
        noise: float = 0.0,
        secret_seed: int = 0,
        max_turns: int | None = None,
        render_mode: str | None = None,
    ) -> None:
        if not 1 <= num_tasks <= MAX_TASKS:
            raise ValueError(f"num_tasks must be in [1, {MAX_TASKS}], got {num_tasks}")
        if length < 1:
            raise ValueError(f"length must be >= 1, got {length}")
        if not 2 <= num_actions <= len(ACTION_WORDS):
            raise ValueError(f"num_actions must be in [2, {len(ACTION_WORDS)}], got {num_actions}")
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise must be in [0, 1], got {noise}")
        super().__init__(
            max_turns=2 * length if max_turns is None else max_turns, render_mode=render_mode
        )
        self.num_tasks = num_tasks
        self.length = length
        self.num_actions = num_actions
        self.noise = noise
        self.secret_seed = secret_seed
        # One shared immutable tuple: per-step copies would be kept alive by recorders (GC cost).
        self._admissible = ACTION_WORDS[:num_actions]
        self._index = {a: a for a in self._admissible}
        self.task_index = 0
        self.name = ""
        self.secret: tuple[str, ...] = ()
        self.taken: list[str] = []
        self.history_hidden = False
        self._done = False
        self._success = False

    @property
    def task(self) -> str:
        """The task text (``info["task"]``): what retrieval searches the bank with. The name comes
        twice: the text is then mostly the name, so even a bag-of-n-grams embedder tells 256
        tasks apart."""
        return f"Task {self.name}: repeat the {self.length} secret actions of {self.name}."

    def reset(
        self, *, seed: int | None = None, options: EnvOptions | None = None
    ) -> tuple[str, EnvInfo]:
        super().reset(seed=seed)
        self.task_index = (
            seed % self.num_tasks
            if seed is not None
            else int(self.np_random.integers(self.num_tasks))
        )
        self.name = task_name(self.task_index)
        self.secret = task_secret(self.task_index, self.length, self.num_actions, self.secret_seed)
        self.taken = []
        self.turn = 0
        self._done = self._success = False
        self._last_obs = self._observation("")
        return self._last_obs, self._info(False)

    def step(self, action: str) -> tuple[str, float, bool, bool, EnvInfo]:
        if not self.secret:
            raise RuntimeError("call reset() before step()")
        if self._done or self.turn >= self.max_turns:
            # Stepping a finished episode changes nothing; the terminal result is repeated.
            return self._last_obs, 0.0, self._done, not self._done, self._info(False)
        self.turn += 1
        name = lookup_action(self._index, action)
        reward = 0.0
        if name is None:
            message = self.invalid_action_observation(action, list(self._admissible)) + "\n"
        elif name != self.secret[len(self.taken)]:
            self._done = True
            message = (
                f"Wrong action: {name} is not action {len(self.taken) + 1} of the secret sequence. "
                "The episode is over.\n"
            )
        else:
            self.taken.append(name)
            if len(self.taken) == self.length:
                self._done = self._success = True
                reward = 1.0
                message = "Correct: that was the whole secret sequence. Task complete!\n"
            else:
                message = f"Correct: {name} is action {len(self.taken)} of the secret sequence.\n"
        self._last_obs = self._observation(message)
        truncated = not self._done and self.turn >= self.max_turns
        return self._last_obs, reward, self._done, truncated, self._info(name is None)

    def _observation(self, message: str) -> str:
        # one draw per observation, from the episode's RNG: the same seed hides the same turns
        self.history_hidden = (
            bool(self.np_random.random() < self.noise) if self.noise > 0 else False
        )
        history = HIDDEN if self.history_hidden else (", ".join(self.taken) or "(none)")
        status = (
            "The episode is over."
            if self._done
            else f"Turn {self.turn + 1}: action {len(self.taken) + 1} of {self.length}?"
        )
        # The action words are not listed (they are info["admissible_actions"], which a free-text
        # actor's runner appends): in a guided prompt the entry is then the only place they appear.
        return (
            f"{message}Task: {self.name}. Play its secret sequence of {self.length} actions, one "
            f"per turn; a wrong action ends the episode.\nActions so far: {history}\n{status}"
        )

    def _info(self, invalid: bool) -> EnvInfo:
        return {
            "task": self.task,
            "task_category": self.name,
            "task_index": self.task_index,
            "admissible_actions": self._admissible,
            "turn": self.turn,
            "progress": len(self.taken),
            "history_hidden": self.history_hidden,
            "success": self._success,
            "invalid_action": invalid,
        }
