"""Who wrote an entry, and when: the provenance a quarantine selects by.

Every Add and Update records the writer of the entry's current text in the bank's
``entry_origin`` table (beside ``entries``, so a bank written before it opens as it was; its
entries read as written by ``unknown``):

* ``user``: ops sent from outside (``apply_ops`` over HTTP or in process, a seeding script);
* ``extractor``: ops the service's own extractor distilled, with its model step
  (``ExtractorSample.extractor_version``) in ``model_step``;
* ``merge``: the entries a Merge rewrote;
* ``import``: :meth:`~crl_gym.experience.bank.ExperienceBank.import_jsonl`.

``quarantined`` entries stay in the database but are hidden from retrieval, the entry list and
every write (:meth:`~crl_gym.experience.bank.ExperienceBank.quarantine`); undoing it brings
them back.

>>> Origin("extractor", model_step=12).describe()
'extractor (model step 12)'
>>> Origin.parse_writer("robot")
Traceback (most recent call last):
...
ValueError: written_by must be one of user, extractor, merge, import, unknown; got 'robot'
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, TypedDict, get_args

Writer = Literal["user", "extractor", "merge", "import", "unknown"]
WRITERS: tuple[str, ...] = get_args(Writer)


class OriginRecord(TypedDict):
    """One entry's row of the bank's ``entry_origin`` table (``ExperienceBank.origins``)."""

    written_by: str
    model_step: int | None
    step: int
    """The rollout step of the write."""
    written_at: float
    quarantined: bool


@dataclass(frozen=True)
class Origin:
    """The writer of one entry's current text (see the module docstring)."""

    written_by: str = "user"
    model_step: int | None = None
    """The extractor's model step (its ``extractor_version``) when ``written_by``
    is ``extractor``."""
    written_at: float = field(default_factory=time.time)
    """Unix time of the write."""

    def __post_init__(self) -> None:
        self.parse_writer(self.written_by)

    @staticmethod
    def parse_writer(name: str) -> str:
        if name not in WRITERS:
            raise ValueError(f"written_by must be one of {', '.join(WRITERS)}; got {name!r}")
        return name

    def describe(self) -> str:
        return self.written_by + (
            "" if self.model_step is None else f" (model step {self.model_step})"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "written_by": self.written_by,
            "model_step": self.model_step,
            "written_at": self.written_at,
        }


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """``"A:B"`` (both ends included; either may be left out) as ``(A, B)``.

    >>> parse_steps("10:20"), parse_steps(":5"), parse_steps("7")
    ((10, 20), (None, 5), (7, 7))
    """
    a, sep, b = text.partition(":")
    try:
        lo = int(a) if a.strip() else None
        hi = (int(b) if b.strip() else None) if sep else lo
    except ValueError:
        raise ValueError(
            f"steps must be A:B (integers, either end may be left out), got {text!r}"
        ) from None
    if lo is not None and hi is not None and hi < lo:
        raise ValueError(f"steps {text!r}: the end {hi} is before the start {lo}")
    return lo, hi
