"""A user's entries stay theirs: the extractor's Update / Delete ops and the Merge never rewrite or
delete a pinned entry (the Update's advice goes beside it); a tag or the config unpins them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.config import ManagerConfig
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.merge import approx_tokens
from crl_gym.experience.pinning import UNPINNED_TAG, is_pinned
from crl_gym.protocol import AddOp, DeleteOp, ExtractorSample, UpdateOp

EMB = HashingEmbedder(64)
SAMPLE = ExtractorSample("prompt", "UPDATE", [-0.5])
MINE = "Always read the whole board first."


def bank_with(config: ManagerConfig | None = None, tags: tuple[str, ...] = ()) -> tuple[ExperienceManager, int, int]:
    """A manager whose bank holds a user's entry (returned first) and one the extractor wrote."""
    manager = ExperienceManager(ExperienceBank(None, dim=64), EMB, config or ManagerConfig())
    (mine,) = manager.apply_ops([AddOp(MINE, tags=tags)]).added
    (its,) = manager.apply_ops([AddOp("go east at the fork")], sample=SAMPLE).added
    return manager, mine, its


def test_the_extractor_cites_a_users_entry_but_never_rewrites_or_deletes_it() -> None:
    manager, mine, its = bank_with()
    try:
        assert is_pinned(manager.bank.get(mine)) and not is_pinned(manager.bank.get(its))  # type: ignore[arg-type]
        res = manager.apply_ops([UpdateOp(mine, "Read the board, then count the boxes."), DeleteOp(mine),
                                 UpdateOp(its, "go east at the second fork")], sample=SAMPLE)
        assert res.pinned == 2 and res.updated == [its] and len(res.added) == 1
        assert manager.bank.get(mine).text == MINE and manager.bank.get(mine).version == 0  # type: ignore[union-attr]
        assert manager.bank.get(res.added[0]).text == "Read the board, then count the boxes."  # type: ignore[union-attr]
        # the user edits their own entry freely (no extractor sample)
        assert manager.apply_ops([UpdateOp(mine, "Read the board.")]).updated == [mine]
        assert manager.bank.get(mine).text == "Read the board."  # type: ignore[union-attr]
    finally:
        manager.close()


@pytest.mark.parametrize("how", ["tag", "config"])
def test_a_tag_or_the_config_lets_the_extractor_rewrite_a_users_entry(how: str) -> None:
    manager, mine, _ = (bank_with(tags=(UNPINNED_TAG,)) if how == "tag"
                        else bank_with(ManagerConfig(pin_user_entries=False)))
    try:
        res = manager.apply_ops([UpdateOp(mine, "Read the board, then count the boxes.")], sample=SAMPLE)
        assert res.pinned == 0 and res.updated == [mine]
        assert manager.apply_ops([DeleteOp(mine)], sample=SAMPLE).deleted == [mine]
    finally:
        manager.close()


class _DiscardingExtractor:
    """The extractor side of a Merge that answers by discarding every entry it is shown."""

    alive = True
    trainable = False

    def count_tokens(self, text: str) -> int:
        return approx_tokens(text)

    def merge_generate(self, prompts: list[Any]) -> list[str]:
        return [json.dumps({"discard": list(p.labels)}) for p in prompts]


def test_the_track_counts_the_ops_its_extractor_aimed_at_pinned_entries() -> None:
    from crl_gym.protocol import DistillationRequest, Trajectory
    from crl_train.service.track import BackgroundTrack

    manager, mine, _ = bank_with()

    class Rewriting(_DiscardingExtractor):
        def distill(self, reqs: list[Any]) -> list[tuple[ExtractorSample, list[Any]]]:
            return [(SAMPLE, [UpdateOp(mine, "rewritten"), DeleteOp(mine)]) for _ in reqs]

    track: Any = BackgroundTrack(manager, Rewriting(), asynchronous=False)  # type: ignore[arg-type]
    try:
        request = DistillationRequest(task="t", trajectory=Trajectory(initial_observation="o", steps=[]), outcome=0.0,
                                      success=False, experience=None, condition="free")
        track._distill([request])
        assert track.stats.pinned == 2 and manager.bank.get(mine).text == MINE  # type: ignore[union-attr]
    finally:
        manager.close()


def test_the_merge_leaves_pinned_entries_out() -> None:
    from crl_train.service.track import BackgroundTrack

    manager, mine, its = bank_with()
    (loose,) = manager.apply_ops([AddOp("west is a dead end", tags=(UNPINNED_TAG,))]).added
    track: Any = BackgroundTrack(manager, _DiscardingExtractor(), asynchronous=False)  # type: ignore[arg-type]
    try:
        track._merge(step=5)
        assert [e.id for e in manager.bank] == [mine]  # the extractor's and the unpinned user entry went
        assert loose not in manager.bank and its not in manager.bank
    finally:
        manager.close()
