"""An asynchronous extractor update never trains on a sample whose entry is mid-write.

No fence is needed here, unlike the authors' ROLL fork (their PR #3 flushes pending bank writes and
suspends the manager before each update): the background track applies its own ops, takes credits
and runs updates in one thread, one after the other; every other writer's batch is atomic under the
bank's writer lock; and a credited sample is copied out of the bank (under its reader lock) when the
credit is taken, so the update trains on exactly the version that was credited. These tests show it
with real components: a tiny extractor's CISPO updates, a real bank, and a writer thread.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
from _trainer_fixtures import manager, tiny_policy

from crl_gym.protocol import AddOp, DeleteOp, ExtractorSample, UpdateOp
from crl_train.config import ExtractorSettings
from crl_train.extractor import BufferItem, Extractor
from crl_train.service.track import BackgroundTrack, Credit


@pytest.fixture(scope="module")
def extractor() -> Extractor:
    return Extractor(
        tiny_policy(1, loss_scale="tokens"),
        ExtractorSettings(
            max_new_tokens=8,
            max_context_tokens=512,
            max_prompt_chars=400,
            constrained=True,
            cooldown=0,
        ),
    )


def _spy(extractor: Extractor, seen: list[list[BufferItem]]) -> None:
    real = extractor.update

    def update(items: list[BufferItem], bank: object, step: int) -> dict[str, float]:
        seen.append(list(items))
        return real(items, bank, step)  # type: ignore[arg-type]

    extractor.update = update  # type: ignore[method-assign]


def _version(sample: ExtractorSample, n: int) -> ExtractorSample:
    return dataclasses.replace(sample, response=f"version {n}")


def test_the_update_trains_the_credited_version_even_if_the_entry_changed_since(extractor: Extractor) -> None:
    mgr = manager()
    sample = extractor.generate(["advice?"])[0]
    kept, gone = mgr.apply_ops([AddOp("version 0"), AddOp("short lived")], sample=_version(sample, 0)).added
    seen: list[list[BufferItem]] = []
    _spy(extractor, seen)
    try:
        track = BackgroundTrack(mgr, extractor, buffer_size=2, distill=False, asynchronous=False)
        track.credit([Credit(0, 1.0, entry_id=kept), Credit(0, -1.0, entry_id=gone)])
        track.train = False
        track.run_once()  # credits taken: B_φ holds the two samples as the bank had them
        mgr.apply_ops([UpdateOp(kept, "version 1")], sample=_version(sample, 1))
        mgr.apply_ops([DeleteOp(gone)])
        track.train = True
        track.run_once()
    finally:
        del extractor.update  # type: ignore[misc]
    assert [[(it.entry_id, it.sample.response) for it in batch] for batch in seen] == [
        [(kept, "version 0"), (gone, "version 0")]]
    # the update's training count lands on the live entry (its new version), not on the deleted one
    entry = mgr.bank.get(kept)
    assert entry is not None and entry.version == 1 and entry.train_count == 1
    mgr.close()


def test_updates_under_a_concurrent_writer_see_only_committed_versions(extractor: Extractor) -> None:
    mgr = manager()
    base = extractor.generate(["advice?"])[0]
    target = mgr.apply_ops([AddOp("version 0")], sample=_version(base, 0)).added[0]
    stop = threading.Event()
    written: list[int] = []

    def writer() -> None:  # another face's writes (HTTP apply_ops, EDGE's prune): Updates, Adds, Deletes
        n = 0
        while not stop.is_set():
            n += 1
            mgr.apply_ops([UpdateOp(target, f"version {n}"), AddOp(f"other entry {n}")], sample=_version(base, n))
            written.append(n)
            others = [i for i in mgr.bank.ids() if i != target]
            if len(others) > 3:
                mgr.apply_ops([DeleteOp(others[0])])
            stop.wait(0.002)  # a busy service's pace, not a loop that starves the track of the GIL

    seen: list[list[BufferItem]] = []
    _spy(extractor, seen)
    thread = threading.Thread(target=writer)
    thread.start()
    try:
        track = BackgroundTrack(mgr, extractor, buffer_size=2, distill=False, asynchronous=False)
        for step in range(4):
            track.credit([Credit(step, 1.0, entry_id=target), Credit(step, -1.0, entry_id=target)])
            track.run_once()
    finally:
        stop.set()
        thread.join()
        del extractor.update  # type: ignore[misc]
    assert len(seen) == 4 and len(written) > 0
    entry = mgr.bank.get(target)
    assert entry is not None
    texts = {*entry.history, entry.text}
    for batch in seen:
        for it in batch:
            # each trained sample is the provenance of a version the bank committed (text and sample
            # were written together: a torn read would pair one version's text with another's sample)
            assert it.sample.response in texts
            n = int(it.sample.response.split()[-1])
            assert n == 0 or mgr.bank.read_sql(
                "SELECT count(*) FROM entry_events WHERE entry_id = ? AND kind = 'update' AND version = ?",
                (target, n))[0][0] == 1
    # no training count was lost to a concurrent rewrite of the entry (an Update copies the counters)
    assert entry.train_count == 4 and entry.version == len(written)
    mgr.close()
