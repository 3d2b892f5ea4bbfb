"""One text, one embedding: entries of the bank that hold the same text share one vector.

An embedding is a function of its text, but an embedder's output is not quite: MiniLM gives a text
vectors that differ in the last bits with the batch it was encoded in (up to ~1e-7 per component,
measured when the text sits next to a longer one), and the manager embeds each answer's texts
together. So an extractor that writes one advice a hundred times would leave a hundred vectors a
hair apart; the vector index keys *equal* vectors once (:mod:`crl_gym.experience.vector_index`),
and it is this module that makes copies equal: a text already in the bank is stored with the
vector it already has.

>>> import numpy as np
>>> shared = SharedEmbeddings()
>>> old = ExperienceEntry(id=1, text="go east", embedding=np.array([1.0, 0.0], np.float32))
>>> shared.load({1: old}) == {}
True
>>> copy = ExperienceEntry(id=2, text="go east",
...                        embedding=np.array([0.9999999, 0.0001], np.float32))
>>> [e.embedding.tolist() for e in shared.share([copy], {1: old}, gone=())]
[[1.0, 0.0]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping, Sequence

import numpy as np

from crl_gym.experience.entry import ExperienceEntry


class SharedEmbeddings:
    """Which ids hold each text of the bank (the bank's writer lock guards it)."""

    def __init__(self) -> None:
        self._ids: dict[str, set[int]] = {}

    def load(self, entries: Mapping[int, ExperienceEntry]) -> dict[int, ExperienceEntry]:
        """Index ``entries``; returns the ones to replace, with the vector of the smallest id of
        their text (a bank written before copies shared a vector)."""
        self._ids.clear()
        self.added(entries.values())
        fixed: dict[int, ExperienceEntry] = {}
        for ids in self._ids.values():
            if len(ids) < 2:
                continue
            first = entries[min(ids)].embedding
            if first is None:
                continue
            for i in ids:
                e = entries[i]
                if (
                    e.embedding is not None
                    and e.embedding is not first
                    and not np.array_equal(e.embedding, first)
                ):
                    fixed[i] = dataclasses.replace(e, embedding=first)
        return fixed

    def share(
        self,
        upserts: Sequence[ExperienceEntry],
        entries: Mapping[int, ExperienceEntry],
        gone: Collection[int],
    ) -> list[ExperienceEntry]:
        """``upserts`` with the vector their text already has: an entry's of ``entries`` (not
        ``gone``: deleted, or rewritten by this batch) or an earlier upsert's."""
        out: list[ExperienceEntry] = []
        in_batch: dict[str, np.ndarray] = {}
        for e in upserts:
            vector = in_batch.get(e.text)
            if vector is None:
                holders = [i for i in self._ids.get(e.text, ()) if i not in gone]
                vector = entries[min(holders)].embedding if holders else None
            if vector is not None and vector is not e.embedding:
                e = dataclasses.replace(e, embedding=vector)
            out.append(e)
            if e.embedding is not None:
                in_batch.setdefault(e.text, e.embedding)
        return out

    def added(self, entries: Iterable[ExperienceEntry]) -> None:
        for e in entries:
            self._ids.setdefault(e.text, set()).add(e.id)

    def removed(self, entries: Iterable[ExperienceEntry]) -> None:
        for e in entries:
            ids = self._ids.get(e.text)
            if ids is not None:
                ids.discard(e.id)
                if not ids:
                    del self._ids[e.text]
