"""The reader actor (``actor.model: reader``): a scripted policy that plays what its
experience names.

A reference actor, not a model, and never a default (like the oracle extractor of
:mod:`crl_train.extractor.oracle`). It reads **only the experience section** of a guided episode's
first observation — the text a guided template (``GUIDED_OBSERVATION_TEMPLATE`` /
``EXPERIENCE_TEMPLATE`` of :mod:`crl_gym.templates`) puts between its header and the blank line
before the observation — never the task text, the observations or its own trajectory, and plays:

* at its turn ``t`` (``t`` = the responses it already gave in this conversation), the ``t``-th
  occurrence, in reading order, of an action that is admissible at this turn: one action named
  in the entry is played at turn 0; for a multi-action secret (Recall's ``length > 1``) the
  entry's action list is played in order, one per turn ("the action named at this turn's
  position");
* else (a free episode, an entry that names no admissible action, or fewer than ``t + 1`` of
  them) one admissible action drawn uniformly by its own seeded generator: the same seed gives
  the same fallback actions, call after call.

So with the reader an entry's reward says only whether the entry is right: the actor never
learns, never guesses better than chance, and follows an entry exactly. Actions are matched as
whole words, case-insensitively (``north`` in "go north", not in "northern"), the longest
admissible action first where two start at one place.

**Never trained.** It has no weights: :func:`crl_train.policy.factory.trains` is False for it, the
trainer consults that once and builds no actor objective, and :meth:`ReaderPolicy.train_step`,
:meth:`~ReaderPolicy.train_objective`, :meth:`~ReaderPolicy.logprobs` raise if called anyway. The
config refuses it with what needs an actor's distribution (EDGE, self-distillation, the gate, the
perplexity bonus).

**Log-probs.** Each :class:`~crl_train.policy.base.Generation` carries the log-probs of the
reader's own choice, not of a temperature-scaled softmax: a named action has probability 1
(every token 0.0); a fallback action has probability 1/n among the n admissible actions, split
over its tokens as the conditional share of the admissible actions that start with the tokens so
far (they sum to log(1/n)). They are honest but never used: nothing trains the reader.

Tokens: a byte-level tokenizer with ChatML turns and no merges (every string round-trips
exactly, and no env texts are needed to build it). An episode's context is then counted one token
per byte: on envs with long observations raise ``actor.max_context_tokens`` (the reader's cost
does not grow with it), or the runner ends long episodes as context-truncated failures.

>>> reader = ReaderPolicy(seed=0)
>>> prompt = reader.apply_chat([{"role": "user", "content":
...     "Experience from similar tasks (use it if it helps):\\n"
...     "Winning actions: south then east.\\n\\n"
...     "Task: amber badger. Play north or west?"}])
>>> gen, = reader.generate([prompt], 16, allowed=[["north", "east", "south", "west"]])
>>> gen.text, sum(gen.logprobs)
('south', 0.0)
>>> experience_section(reader.tokenizer.decode(prompt))
'Winning actions: south then east.'
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import torch

from crl_gym.episode.prompt import ACTIONS_LINE
from crl_gym.templates import EXPERIENCE_TEMPLATE, GUIDED_OBSERVATION_TEMPLATE

from .base import (
    AllowedRow,
    FinishReason,
    Generation,
    Generator,
    LossFn,
    LossScale,
    LossTerm,
    SamplingConfig,
    TrainBatch,
)
from .chat import ChatFormatter

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .grammar import JsonGrammar

READER_NAME = "reader (scripted: plays the actions its experience names; no weights)"
"""The name the reader carries in logs, metrics and checkpoints."""
EXPERIENCE_HEADERS: tuple[str, ...] = tuple(
    t.split("{experience}", 1)[0] for t in (GUIDED_OBSERVATION_TEMPLATE, EXPERIENCE_TEMPLATE)
)
"""What a guided first observation starts with before its entry (taken from the templates)."""
SECTION_END = "\n\n"
"""The templates' separator between the entry and the observation. The section ends at its first
occurrence: an entry's own text after a blank line is not read, which never shows the reader the
observation (reading too little is safe; reading too much would not be)."""
RNG_FILE, RNG_KEY = "reader_rng.safetensors", "rng_state"
"""A checkpoint's only tensor: the fallback generator's state (``model/reader_rng.safetensors``)."""
_USER_OPEN, _ASSISTANT_OPEN, _TURN_END = (
    "<|im_start|>user\n",
    "<|im_start|>assistant\n",
    "<|im_end|>",
)
_VALID_ACTIONS = ACTIONS_LINE  # the episode driver's actions line, for an unconstrained runner


class ReaderNotTrainable(RuntimeError):
    """A training call on the reader: it has no weights (the trainer never makes one)."""


def experience_section(prompt: str) -> str:
    """The entry text of a rendered conversation's first user turn, or ``""`` when that turn is not
    a guided one (it does not start with a guided template's header).

    >>> experience_section("<|im_start|>user\\nTask: go north.<|im_end|>\\n")
    ''
    """
    start = prompt.find(_USER_OPEN)
    if start < 0:
        return ""
    content = prompt[start + len(_USER_OPEN) :].split(_TURN_END, 1)[0]
    for header in EXPERIENCE_HEADERS:
        if content.startswith(header):
            return content[len(header) :].split(SECTION_END, 1)[0]
    return ""


def named_actions(text: str, admissible: Sequence[str]) -> list[str]:
    """The admissible actions ``text`` names, in reading order (whole words, any case; at one place
    the longest action wins), each as ``admissible`` spells it.

    >>> named_actions("Go North, then north-east; never northern.", ["north", "east", "north-east"])
    ['north', 'north-east']
    """
    by_lower = {a.strip().lower(): a for a in admissible if a.strip()}
    if not by_lower or not text:
        return []
    alternatives = "|".join(re.escape(a) for a in sorted(by_lower, key=len, reverse=True))
    pattern = re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)", re.IGNORECASE)
    return [by_lower[m.group(0).lower()] for m in pattern.finditer(text)]


def _byte_tokenizer() -> PreTrainedTokenizerBase:
    from .tiny import train_tiny_tokenizer

    # 256 bytes + the 3 ChatML specials: no merges, so nothing depends on which texts it saw
    tok = train_tiny_tokenizer(["reader"], vocab_size=259)
    tok.name_or_path = READER_NAME
    return tok


class ReaderPolicy:
    """See the module docstring. ``seed`` seeds the fallback draws (None: 0)."""

    def __init__(
        self,
        *,
        seed: int | None = 0,
        tokenizer: PreTrainedTokenizerBase | None = None,
        sampling: SamplingConfig | None = None,
    ) -> None:
        self.name = READER_NAME
        self.sampling = sampling or SamplingConfig()
        """Kept for the protocol; the reader samples nothing from a softmax, so it reads none
        of it."""
        self.tokenizer: PreTrainedTokenizerBase = (
            tokenizer if tokenizer is not None else _byte_tokenizer()
        )
        self.chat = ChatFormatter(self.tokenizer)
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        self.eos_token_ids = [int(self.tokenizer.eos_token_id)]
        self.prefix_cache: bool = False
        self.generator: Generator | None = None
        self.seed = 0 if seed is None else int(seed)
        self._rng = torch.Generator().manual_seed(self.seed)
        self.fallbacks = 0
        """Turns played by the seeded fallback (no admissible action named at the
        turn's position)."""
        self.reads = 0
        """Turns played from the experience."""

    # ------------------------------------------------------------------ acting
    def apply_chat(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        return self.chat.prompt_ids(messages, add_generation_prompt=add_generation_prompt)

    def choose(self, prompt: str, admissible: Sequence[str]) -> tuple[str, bool]:
        """``(action, named)`` for one rendered prompt: the action the experience names at this
        turn's position (``named`` True), else a seeded uniform draw from ``admissible``."""
        actions = list(dict.fromkeys(a for a in admissible if a.strip()))
        if not actions:
            raise ValueError("the reader actor got no admissible action to play")
        turn = max(0, prompt.count(_ASSISTANT_OPEN) - 1)  # the last one opens this turn's answer
        named = named_actions(experience_section(prompt), actions)
        if turn < len(named):
            return named[turn], True
        return actions[int(torch.randint(len(actions), (1,), generator=self._rng))], False

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        allowed: Sequence[AllowedRow] | None = None,
        *,
        sampling: SamplingConfig | None = None,
        cache_keys: Sequence[Hashable] | None = None,
    ) -> list[Generation]:
        """One action per prompt. ``allowed[i]`` lists prompt i's admissible actions (a constrained
        runner's rows); without it they are read from the ``Valid actions:`` line of the prompt's
        last user turn and the answer is written ``<action>…</action>``. ``sampling`` and
        ``cache_keys`` change nothing (nothing is sampled, nothing is cached)."""
        if allowed is not None and len(allowed) != len(prompts):
            raise ValueError(f"allowed has {len(allowed)} rows for {len(prompts)} prompts")
        out = []
        for i, ids in enumerate(prompts):
            text = str(self.tokenizer.decode(list(ids), skip_special_tokens=False))
            row = None if allowed is None else allowed[i]
            if row is None:
                admissible, free_text = _valid_actions(text), True
            elif (
                isinstance(row, Sequence)
                and not isinstance(row, str)
                and all(isinstance(a, str) for a in row)
            ):
                admissible, free_text = list(row), False
            else:
                raise TypeError(
                    f"the reader actor plays listed actions only; prompt {i}'s allowed row is "
                    f"{type(row).__name__} (set actor.constrained=true)"
                )
            action, named = self.choose(text, admissible)
            self.reads += named
            self.fallbacks += not named
            out.append(
                self._generation(list(ids), action, admissible, named, free_text, max_new_tokens)
            )
        return out

    def _generation(
        self,
        prompt_ids: list[int],
        action: str,
        admissible: Sequence[str],
        named: bool,
        free_text: bool,
        max_new_tokens: int,
    ) -> Generation:
        def tokens(a: str) -> list[int]:
            body = f"<action>{a}</action>" if free_text else a
            return [*self.tokenizer.encode(body, add_special_tokens=False), self.eos_token_ids[0]]

        ids = tokens(action)
        if named:
            logprobs = [0.0] * len(ids)
        else:  # uniform over the distinct admissible token sequences, split token by token
            candidates = list({tuple(tokens(a)) for a in admissible})
            logprobs = []
            for n in range(len(ids)):
                before = sum(c[:n] == tuple(ids[:n]) for c in candidates)
                after = sum(c[: n + 1] == tuple(ids[: n + 1]) for c in candidates)
                logprobs.append(math.log(after / before))
        finish: FinishReason = "stop"
        if len(ids) > max_new_tokens:
            ids, logprobs, finish = ids[:max_new_tokens], logprobs[:max_new_tokens], "length"
        text = str(self.tokenizer.decode(ids, skip_special_tokens=True))
        return Generation(
            prompt_ids=prompt_ids, token_ids=ids, logprobs=logprobs, text=text, finish_reason=finish
        )

    def release_cache(self, keys: Iterable[Hashable] | None = None) -> None:
        """Nothing is cached between calls."""

    # ------------------------------------------------------------------ never trained
    def _refuse(self, what: str) -> NoReturn:
        raise ReaderNotTrainable(
            f"the reader actor has no weights: {what} is not defined for it "
            "(a run with actor.model=reader builds no actor objective)"
        )

    def replay_allowed(
        self, grammar: JsonGrammar, token_ids: Sequence[int]
    ) -> list[tuple[int, ...] | None]:
        self._refuse("replay_allowed")

    @property
    def sampled_logprobs_exact(self) -> bool:
        """True: the reader never trains, so nothing recomputes its (absent) log-probs."""
        return True

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        self._refuse("recomputing log-probs")

    def support_logprobs(
        self, batch: TrainBatch, *, k: int | None = None, ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._refuse("support_logprobs")

    def train_step(
        self,
        batch: TrainBatch,
        loss_fn: LossFn,
        *,
        loss_scale: LossScale | None = None,
        **loss_kw: object,
    ) -> dict[str, float]:
        self._refuse("train_step")

    def train_objective(self, terms: Sequence[LossTerm]) -> dict[str, float]:
        self._refuse("train_objective")

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory: str | Path) -> None:
        """A policy checkpoint (:mod:`crl_train.policy.checkpoint`'s layout, so a resume verifies it
        like any other): the tokenizer, and as the only "weights" the fallback generator's state,
        so a resumed run draws what the uninterrupted one would have."""
        from .checkpoint import write_checkpoint

        state = {
            "step": 0,
            "name": self.name,
            "sampling": None,
            "optim": None,
            "chat_kwargs": {},
            "seed": self.seed,
            "reads": self.reads,
            "fallbacks": self.fallbacks,
        }
        write_checkpoint(directory, _RngState(self._rng.get_state()), self.tokenizer, state)

    def load(self, directory: str | Path) -> None:
        from safetensors.torch import load_file

        from .checkpoint import MODEL_DIR, CheckpointError, read_state

        state = read_state(directory)
        path = Path(directory) / MODEL_DIR / RNG_FILE
        try:
            rng = load_file(str(path))[RNG_KEY]
        except Exception as exc:  # noqa: BLE001 - safetensors' own error names no file
            raise CheckpointError(
                f"{path}: not a reader checkpoint ({type(exc).__name__}: {exc})"
            ) from exc
        self.seed = int(state.get("seed", 0))
        self._rng.set_state(rng)
        self.reads, self.fallbacks = int(state.get("reads", 0)), int(state.get("fallbacks", 0))

    @classmethod
    def from_checkpoint(cls, directory: str | Path) -> ReaderPolicy:
        from transformers import AutoTokenizer

        from .checkpoint import MODEL_DIR

        reader = cls(
            seed=0, tokenizer=AutoTokenizer.from_pretrained(str(Path(directory) / MODEL_DIR))
        )
        reader.load(directory)
        return reader


class _RngState:
    """What :func:`~crl_train.policy.checkpoint.write_checkpoint` saves as the reader's model."""

    def __init__(self, state: torch.Tensor) -> None:
        self.state = state

    def save_pretrained(self, directory: Path, /) -> object:
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        save_file({RNG_KEY: self.state}, str(directory / RNG_FILE))
        return None


def _valid_actions(prompt: str) -> list[str]:
    """The admissible actions an unconstrained runner lists at the end of the last user turn."""
    last = prompt.rsplit(_USER_OPEN, 1)[-1].split(_TURN_END, 1)[0]
    if _VALID_ACTIONS not in last:
        raise ValueError(
            "the reader actor found no admissible actions: the runner passed none and the last "
            "user turn has no 'Valid actions:' line"
        )
    return [
        a.strip() for a in last.rsplit(_VALID_ACTIONS, 1)[1].splitlines()[0].split(",") if a.strip()
    ]


__all__ = [
    "EXPERIENCE_HEADERS",
    "READER_NAME",
    "ReaderNotTrainable",
    "ReaderPolicy",
    "experience_section",
    "named_actions",
]
