"""The dataset rows ``crl_agent`` reads, and what each row's columns mean (no verl import).

verl repeats every dataset row ``actor_rollout_ref.rollout.n`` times under one ``uid`` and
normalises advantages per ``uid``; a row here is one task *and one condition*: for Complementary
RL's split, two rows per task (``"guided"`` and ``"free"``, each run ``n = K/2`` times), so every
copy of a row runs the row's condition whatever process runs it (verl spreads the copies of a row
over its agent-loop workers, so no per-process counter could split them). A method without
experience gets one ``"free"`` row per task, run ``n = K`` times.

Columns (a parquet file of these rows is verl's ``data.train_files`` / ``data.val_files``; verl's
``RLHFDataset`` hands each to ``AgentLoopBase.run`` with ``prompt`` as ``raw_prompt``):
``agent_name`` (the loop: ``"crl_agent"``), ``prompt`` (the instruction messages; the loop
appends the first observation as the user turn), ``data_source``, and ``extra_info`` with
``index`` (the row's number), ``seed`` (the env's reset seed: the task), ``group`` (the task's
number, shared by its rows), ``experience`` (``"guided"`` / ``"free"``), ``evaluation`` (True on
held-out rows: their episodes carry ``rollout_step = -1`` and are never credited) and optionally
``env_id`` (else the loop's own).

>>> rows = task_rows([7], ["guided", "free"])
>>> [(r["extra_info"]["seed"], r["extra_info"]["experience"], r["agent_name"]) for r in rows]
[(7, 'guided', 'crl_agent'), (7, 'free', 'crl_agent')]
>>> task_rows([7], ["free"], evaluation=True)[0]["extra_info"]["evaluation"]
True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from crl_gym.protocol import CONDITIONS
from crl_gym.templates import SYSTEM_REACT

AGENT_NAME = "crl_agent"
"""The name ``ExperienceAgentLoop`` is registered under (``agent_name`` column, agent-loop YAML)."""
DEFAULT_INSTRUCTION = SYSTEM_REACT
"""The system message of :func:`task_rows`' prompts: the episode driver's for an answer with its
action inside ``<action>...</action>`` (:func:`crl_gym.episode.system_text`), as in every loop."""


class ExtraInfo(TypedDict, total=False):
    """A row's ``extra_info`` (the module docstring names each key)."""

    index: int
    seed: int
    group: int
    experience: str
    evaluation: bool
    env_id: str


class TaskRow(TypedDict):
    """One dataset row of :func:`task_rows`."""

    data_source: str
    agent_name: str
    prompt: list[dict[str, str]]
    extra_info: ExtraInfo


def task_rows(
    seeds: Sequence[int],
    conditions: Sequence[str],
    *,
    evaluation: bool = False,
    instruction: str = DEFAULT_INSTRUCTION,
    env_id: str | None = None,
    data_source: str = "crl",
) -> list[TaskRow]:
    """One row per (seed, condition), the conditions of a task next to each other; ``group`` is the
    seed's position in ``seeds``. ``conditions`` is ``["guided", "free"]`` for the split,
    ``["free"]`` for a method without experience."""
    for c in conditions:
        if c not in CONDITIONS:
            raise ValueError(f"a row's condition is one of {CONDITIONS}, got {c!r}")
    if not conditions:
        raise ValueError("conditions must name at least one condition")
    rows: list[TaskRow] = []
    for group, seed in enumerate(seeds):
        for condition in conditions:
            extra: ExtraInfo = {
                "index": len(rows),
                "seed": int(seed),
                "group": group,
                "experience": condition,
                "evaluation": bool(evaluation),
            }
            if env_id is not None:
                extra["env_id"] = env_id
            rows.append(
                {
                    "data_source": data_source,
                    "agent_name": AGENT_NAME,
                    "prompt": [{"role": "system", "content": instruction}],
                    "extra_info": extra,
                }
            )
    return rows


def row_extra(row: Mapping[str, Any]) -> dict[str, Any]:
    """The row's ``extra_info`` as a plain dict (verl hands a dict; a parquet round trip may give a
    numpy-backed mapping); a row without one gets ``{}``."""
    extra = row.get("extra_info")
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise TypeError(f"a row's extra_info must be a mapping, got {type(extra).__name__}")
    return dict(extra)


__all__ = ["AGENT_NAME", "DEFAULT_INSTRUCTION", "ExtraInfo", "TaskRow", "row_extra", "task_rows"]
