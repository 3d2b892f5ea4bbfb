"""Client write ids: each submit (its requests' ``request_id``) and each ``apply_ops`` call (its
``write_id``) is applied at most once, so a client that resends after a lost answer or a refusal
never duplicates it.

An ``apply_ops`` id is stored in the bank's ``write_ids`` table in the transaction that applies
the ops (with the call's answer, which a repeat gets back): exactly once, across restarts. A
submit's ids are stored right after its requests are on disk; a kill between the two may let a
resend queue them a second time (the documented window). Ids are kept for
:data:`~crl_gym.experience.store.WRITE_ID_KEEP_S` in the database (at most about
:data:`~crl_gym.experience.store.WRITE_ID_KEEP` of them), and the latest
:data:`MEMORY` in memory too, which covers a write whose id could not be stored (a full disk:
logged and counted in :attr:`WriteIds.unrecorded`).

>>> from crl_gym.experience.bank import ExperienceBank
>>> ids = WriteIds(ExperienceBank(None, dim=2))
>>> ids.remember([WriteRecord("a1", "submit")], durable=True)
>>> sorted(ids.seen(["a1", "b2"]))
['a1']
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.store import WriteRecord

log = logging.getLogger(__name__)

MEMORY = 200_000
"""Write ids remembered in memory besides the database (the latest ones)."""

__all__ = ["MEMORY", "WriteIds", "WriteRecord"]


class WriteIds:
    """The write ids a service applied (see the module docstring)."""

    def __init__(self, bank: ExperienceBank, memory: int = MEMORY) -> None:
        self.bank = bank
        self.memory = int(memory)
        self.unrecorded = 0
        """Ids that could not be stored in the database (kept in memory only)."""
        self._recent: OrderedDict[str, WriteRecord] = OrderedDict()
        self._lock = threading.Lock()

    def seen(self, ids: Sequence[str], *, stored: bool = True) -> dict[str, WriteRecord]:
        """The already applied writes among ``ids``; ``stored=False`` looks in memory only (an
        in-process submit, whose ids are never stored, skips the database on its hot path)."""
        with self._lock:
            out = {i: r for i in ids if (r := self._recent.get(i)) is not None}
        rest = [i for i in ids if i not in out]
        if rest and stored:
            out.update(self.bank.find_writes(rest))
        return out

    def forget(self) -> None:
        """Drop the ids kept in memory (the bank was restored: its own table is the truth now)."""
        with self._lock:
            self._recent.clear()

    def remember(self, records: Iterable[WriteRecord], *, durable: bool) -> None:
        """Note ``records`` as applied; ``durable`` also stores them in the bank's database (a
        failure there is logged and counted, not raised: the writes themselves are applied)."""
        records = list(records)
        with self._lock:
            for r in records:
                self._recent[r.id] = r
                self._recent.move_to_end(r.id)
            while len(self._recent) > self.memory:
                self._recent.popitem(last=False)
        if durable and records:
            try:
                self.bank.record_writes(records)
            except Exception:  # noqa: BLE001 - the memory copy still answers repeats while the process lives
                self.unrecorded += len(records)
                log.exception(
                    "remembering %d write ids failed; a resend after a restart may apply "
                    "them again",
                    len(records),
                )
