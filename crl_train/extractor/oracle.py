"""The oracle extractor (``extractor.model: oracle``): a reference line, not a model.

It writes each successful episode's env actions verbatim as one Add entry and nothing for a
failure (a Return), so the bank holds exactly what worked, for every task the actor has solved
once. On an env like ``crl/Recall-v0``, where one success holds the whole answer, this is the best
any extractor can do: the gap between a guided run with the oracle and one with π_φ measures what
the learnt extractor loses, and a guided run with the oracle that does not beat GRPO says the
actor cannot use even perfect experience. It is never a default.

It has the interface the service drives (:class:`~crl_train.extractor.Extractor`'s), without
weights: ``trainable`` is False (the service runs no CISPO on it), ``save``/``load`` write and read
nothing, ``refine`` returns the entry unchanged, ``merge_generate`` keeps every entry (its entries
are exact: nothing to compact), ``reflect`` (EDGE) adds the winning actions of the category's
successful episodes. Its samples carry no tokens, so its entries are never credited to a model.

>>> from crl_gym.protocol import DistillationRequest, Step, Trajectory
>>> steps = [Step("", "north"), Step("", "jump", info={"invalid_action": True}), Step("", "east")]
>>> req = DistillationRequest("Task amber falcon: repeat the 2 secret actions of amber falcon.",
...                           Trajectory(steps), 1.0, True, None)
>>> (sample, ops), = OracleExtractor().distill([req])
>>> print(ops[0].text)
Task amber falcon: repeat the 2 secret actions of amber falcon. Winning actions, one per line:
north
east
>>> sample.token_ids
[]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crl_gym.json_types import JSONDict
from crl_gym.protocol import (
    AddOp,
    DistillationRequest,
    ExperienceOp,
    ExperienceRef,
    ExtractorSample,
    ReturnOp,
)

if TYPE_CHECKING:
    from crl_gym.experience.bank import ExperienceBank
    from crl_train.extractor.model import BufferItem

ENTRY_TEMPLATE = "{task} Winning actions, one per line:\n{actions}"
"""An oracle entry: the task text (ended with a full stop) and the episode's env actions in order,
one per line. Each action then starts its line as it starts the actor's answer, so a byte-level BPE
tokeniser writes it with the very tokens the actor emits (``" north"`` after a space is another
token than ``"north"``): with tied embeddings even a tiny random-initialised actor leans towards
the tokens its context holds, so a copyable entry is one it can use from the first step."""
NO_ACTIONS = "(none)"


def winning_actions(request: DistillationRequest) -> list[str]:
    """The env actions of ``request``'s episode, in order: search_and_ask turns and actions the env
    refused (``info["invalid_action"]``: they changed nothing) are left out."""
    return [
        s.action.strip()
        for s in request.trajectory.steps
        if s.kind == "env" and not (isinstance(s.info, dict) and s.info.get("invalid_action"))
    ]


def oracle_entry(request: DistillationRequest) -> str:
    """The entry the oracle writes for a successful episode.

    >>> from crl_gym.protocol import Step, Trajectory
    >>> oracle_entry(DistillationRequest("Reach the exit", Trajectory([Step("", "east")]), 1.0,
    ...                                  True, None))
    'Reach the exit. Winning actions, one per line:\\neast'
    """
    task = request.task.strip()
    if task and task[-1] not in ".!?":
        task += "."
    return ENTRY_TEMPLATE.format(
        task=task, actions="\n".join(winning_actions(request)) or NO_ACTIONS
    ).strip()


def _sample(prompt: str, response: str) -> ExtractorSample:
    """Provenance without tokens: nothing a model could be trained on."""
    return ExtractorSample(prompt=prompt, response=response)


class OracleExtractor:
    """See the module docstring. Thread-safe: it keeps no state."""

    trainable = False
    """No weights: the service never runs a CISPO update on it."""
    alive = True
    """Nothing runs in another process."""
    version = 0

    def distill(
        self, requests: Sequence[DistillationRequest]
    ) -> list[tuple[ExtractorSample, list[ExperienceOp]]]:
        """One Add per successful request (its winning actions), one Return per failed one."""
        out: list[tuple[ExtractorSample, list[ExperienceOp]]] = []
        for r in requests:
            if r.success:
                text = oracle_entry(r)
                out.append((_sample(r.task, text), [AddOp(text)]))
            else:
                out.append(
                    (
                        _sample(r.task, ""),
                        [ReturnOp("oracle: the episode failed, nothing to write")],
                    )
                )
        return out

    def refine(
        self, query: str, entry: ExperienceRef, context: str
    ) -> tuple[str, ExtractorSample | None]:
        """search_and_ask: the entry as it is (it is already exact)."""
        return entry.text, None

    def reflect(
        self,
        category: str,
        failures: Sequence[DistillationRequest],
        successes: Sequence[DistillationRequest],
        max_entries: int = 3,
    ) -> tuple[ExtractorSample, list[ExperienceOp]]:
        """EDGE's reflection: the distinct winning entries of ``successes`` (at most
        ``max_entries``), or a Return when none of the category's episodes succeeded."""
        texts = list(dict.fromkeys(oracle_entry(r) for r in successes if r.success))[:max_entries]
        ops: list[ExperienceOp] = [AddOp(t) for t in texts]
        return _sample(category, "\n".join(texts)), ops or [
            ReturnOp("oracle: no successful episode to copy")
        ]

    def merge_generate(self, prompts: list[str]) -> list[ExtractorSample]:
        """A Merge window's answer: keep every entry of the window (its labels, when it
        carries them)."""
        return [
            _sample(str(p), json.dumps({"keep": list(getattr(p, "labels", ()))})) for p in prompts
        ]

    def update(
        self, items: Sequence[BufferItem], bank: ExperienceBank, step: int
    ) -> dict[str, float]:
        """Nothing to train (the service does not call it: ``trainable`` is False)."""
        return {"skipped": 1.0}

    def train(
        self, items: Sequence[BufferItem], counts: Sequence[int], lasts: Sequence[int], step: int
    ) -> dict[str, float]:
        return {"skipped": 1.0}

    def count_tokens(self, text: str) -> int:
        """About four characters per token (what a Merge window's budget is counted in)."""
        return len(text) // 4 + 1

    def save(self, directory: str | Path) -> None:
        """No weights: nothing is written (a checkpoint of an oracle run has no ``extractor/``)."""

    def load(self, directory: str | Path) -> None:
        """No weights: nothing to read."""

    def get_state(self) -> JSONDict:
        return {"version": 0}

    def set_state(self, d: dict[str, Any]) -> None:
        """Stateless: a checkpoint's extractor state has nothing the oracle needs."""

    def close(self) -> None:
        """Nothing to release."""


__all__ = ["ENTRY_TEMPLATE", "OracleExtractor", "oracle_entry", "winning_actions"]
