"""Near-duplicate refusal at insertion (EDGE; any method through ``manager.dedup_similarity``)."""

from __future__ import annotations

import numpy as np
import pytest

from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.config import ManagerConfig
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.protocol import AddOp, UpdateOp


def _manager(threshold: float | None) -> ExperienceManager:
    emb = HashingEmbedder(64)
    return ExperienceManager(ExperienceBank(None, dim=64), emb, ManagerConfig(dedup_similarity=threshold))


def test_an_entry_as_close_as_the_threshold_is_refused_and_counted() -> None:
    mgr = _manager(0.95)
    try:
        first = mgr.apply_ops([AddOp("walk east to the stairs")])
        assert first.added and first.refused == 0
        # the same text (cosine 1), then the same text twice in one batch beside a different one
        again = mgr.apply_ops([AddOp("walk east to the stairs"), AddOp("avoid the lava"), AddOp("avoid the lava")])
        assert again.refused == 2 and len(again.added) == 1 and len(mgr.bank) == 2
        assert sorted(e.text for e in mgr.bank) == ["avoid the lava", "walk east to the stairs"]
        # an Update is never refused (it replaces its own entry), and its vector still lines up
        eid = again.added[0]
        upd = mgr.apply_ops([UpdateOp(eid, "walk east to the stairs"), AddOp("push the box left")])
        assert upd.updated == [eid] and upd.refused == 0 and len(upd.added) == 1
        entry = mgr.bank.get(eid)
        assert entry is not None and entry.text == "walk east to the stairs"
    finally:
        mgr.close()


def test_threshold_by_hand_and_off_by_default() -> None:
    emb = HashingEmbedder(64)
    a, b = emb.encode(["walk east to the stairs", "walk east to the door"])
    cos = float(np.dot(a, b))  # both L2-normalised
    assert 0.0 < cos < 1.0
    below, above = _manager(cos + 1e-3), _manager(cos - 1e-3)
    off = ExperienceManager(ExperienceBank(None, dim=64), emb)
    try:
        for mgr, refused in ((below, 0), (above, 1), (off, 0)):
            mgr.apply_ops([AddOp("walk east to the stairs")])
            assert mgr.apply_ops([AddOp("walk east to the door")]).refused == refused
    finally:
        for mgr in (below, above, off):
            mgr.close()
    with pytest.raises(ValueError, match="dedup_similarity"):
        ManagerConfig(dedup_similarity=1.5)


def test_ops_on_entries_that_went_since_are_stale_not_malformed() -> None:
    from crl_gym.protocol import DeleteOp

    mgr = _manager(None)
    try:
        a, b, c = mgr.apply_ops([AddOp("walk east"), AddOp("go east"), AddOp("avoid lava")]).added
        # a Merge folded b into a; c was discarded
        mgr.apply_ops([DeleteOp(b), DeleteOp(c)])
        mgr.note_merge({a: [a, b]})
        res = mgr.apply_ops([UpdateOp(b, "walk east, then north"), UpdateOp(c, "lava burns"), DeleteOp(c)])
        assert (res.stale, res.malformed, res.updated, len(res.added)) == (3, 0, [a], 1)
        entry = mgr.bank.get(a)
        assert entry is not None and entry.text == "walk east, then north"  # the update reached the anchor
        assert sorted(e.text for e in mgr.bank) == ["lava burns", "walk east, then north"]  # c's advice kept
        never = mgr.apply_ops([UpdateOp(999, "x")])  # an id this bank never had: the answer was wrong
        assert (never.stale, never.malformed) == (0, 1)
    finally:
        mgr.close()
