"""What an entry is retrieved by: its retrieval key, the text whose embedding the bank indexes.

The paper embeds the entry's own text (v_m = f_ψ(m)) and queries with the episode's task. An entry
whose text does not name its task is then found for any task: SmolLM2's entries rarely do, and on a
Recall bank holding one entry per task the top-1 entry was the query task's own for 0.48 of tasks
(docs/results/retrieval_quality). Keying an entry by the task it was distilled from makes the query
and the key the same kind of text.

* ``text``: the entry's text (the paper).
* ``task``: the task of the episode it was distilled from (its ``source``).
* ``task_text``: the task, a newline, then the text.

An entry without a source (a user's, a seed entry, a Merge of entries of several tasks with no
common source) is keyed by its text whatever the rule.

>>> retrieval_key("Play east.", "Task amber badger.", "task")
'Task amber badger.'
>>> retrieval_key("Play east.", "Task amber badger.", "task_text")
'Task amber badger.\\nPlay east.'
>>> retrieval_key("Play east.", "", "task")
'Play east.'
"""

from __future__ import annotations

from typing import Literal, get_args

RetrieveBy = Literal["text", "task", "task_text"]
RETRIEVE_BY: tuple[str, ...] = get_args(RetrieveBy)


def retrieval_key(text: str, source: str, by: str) -> str:
    """The text embedded for an entry of ``text`` distilled from task ``source`` under
    rule ``by``."""
    if by not in RETRIEVE_BY:
        raise ValueError(f"retrieve_by must be one of {RETRIEVE_BY}, got {by!r}")
    if by == "text" or not source:
        return text
    if by == "task":
        return source
    return f"{source}\n{text}"


def stored_key(text: str, source: str, by: str) -> str | None:
    """What the bank stores as an entry's key: ``None`` when it is the text itself (the paper's
    rule, and every entry without a source), so a bank keyed by text stores nothing twice.

    >>> stored_key("Play east.", "Task amber badger.", "text") is None
    True
    """
    key = retrieval_key(text, source, by)
    return None if key == text else key


__all__ = ["RETRIEVE_BY", "RetrieveBy", "retrieval_key", "stored_key"]
