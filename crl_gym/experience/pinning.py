"""Which entries stay their author's: a user's entries are pinned.

An entry written without an extractor sample (``provenance is None``: added through
``apply_ops`` / ``AddOp`` from a client, ``crl-experience`` or a config's ``seed_entries``) is a
user's. With ``ManagerConfig.pin_user_entries`` (the default) it is *pinned*: the extractor may
cite it (retrieve, credit, write new entries beside it) but never rewrite or delete it. An
extractor Update of a pinned entry is kept as a new entry beside it, a Delete does nothing (both
counted in ``ApplyResult.pinned``), and the Merge leaves it out of its windows. One entry is
unpinned by its tag :data:`UNPINNED_TAG` (``AddOp(text, tags=("crl:unpinned",))``); all of them
by ``pin_user_entries: false``.

>>> from crl_gym.experience.entry import ExperienceEntry
>>> mine = ExperienceEntry(id=1, text="Mine.")
>>> editable = ExperienceEntry(id=2, text="Edit me.", tags=(UNPINNED_TAG,))
>>> is_pinned(mine), is_pinned(editable)
(True, False)
"""

from __future__ import annotations

from crl_gym.experience.entry import ExperienceEntry

UNPINNED_TAG = "crl:unpinned"
"""The tag of a user's entry that the extractor may rewrite, merge or delete."""


def is_pinned(entry: ExperienceEntry) -> bool:
    """Whether ``entry`` is a user's (no extractor sample) and not tagged :data:`UNPINNED_TAG`."""
    return entry.provenance is None and UNPINNED_TAG not in entry.tags


__all__ = ["UNPINNED_TAG", "is_pinned"]
