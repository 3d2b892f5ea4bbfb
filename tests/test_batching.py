"""The one search batcher's core (crl_gym.experience.batching): when a batch leaves, how many are
out at once, and that each caller gets its own result or its own error."""

from __future__ import annotations

import threading

import pytest

from crl_gym.experience.batching import BatchLine, answer


def test_next_batch_leaves_at_batch_size_without_waiting_for_the_window() -> None:
    line: BatchLine[int] = BatchLine(64, batch_size=4, max_wait_s=3600.0, adaptive=False)
    for i in range(6):
        assert line.put(i)
    # a full batch is due at once (a wait of the window would hang this test for an hour)
    assert line.next_batch() == [0, 1, 2, 3]


def test_next_batch_takes_what_waits_once_the_window_ends_and_drains_after_close() -> None:
    line: BatchLine[int] = BatchLine(3, batch_size=16, max_wait_s=0.0)
    for i in range(5):
        line.put(i)
    assert line.next_batch() == [0, 1, 2]  # adaptive: all waiting, up to max_batch
    assert line.close() and not line.close() and not line.put(9)  # closed: nothing new is queued
    assert line.next_batch() == [3, 4] and line.next_batch() is None


def test_a_waiting_dispatcher_wakes_for_the_first_item() -> None:
    line: BatchLine[str] = BatchLine(8, batch_size=2, max_wait_s=0.0)
    got: list[list[str] | None] = []
    dispatcher = threading.Thread(target=lambda: got.append(line.next_batch()))
    dispatcher.start()
    line.put("q")
    dispatcher.join(10)
    assert got == [["q"]]


def test_start_and_finish_keep_at_most_max_inflight_batches_out() -> None:
    line: BatchLine[int] = BatchLine(2, max_inflight=2)
    assert line.offer(0) == [0] and line.offer(1) == [1]  # two out: the next ones queue
    assert line.offer(2) is None and line.offer(3) is None and line.offer(4) is None
    assert line.waiting == 3 and line.inflight == 2 and line.start() is None
    assert line.finish() == [2, 3] and line.inflight == 2  # handed on in the finished one's place
    assert line.finish() == [4] and line.finish() is None
    line.release()
    assert line.inflight == 0 and line.waiting == 0


def test_answer_isolated_gives_each_caller_its_own_error() -> None:
    calls: list[list[int]] = []

    def inverse(xs: list[int]) -> list[float]:
        calls.append(list(xs))
        return [1 / x for x in xs]

    out = answer(inverse, [2, 0, 4], isolate=True)
    assert out[0] == 0.5 and isinstance(out[1], ZeroDivisionError) and out[2] == 0.25
    assert calls == [[2, 0, 4], [2], [0], [4]]


def test_answer_not_isolated_runs_once_and_hands_the_failure_to_every_caller() -> None:
    calls: list[list[int]] = []

    def down(xs: list[int]) -> list[int]:
        calls.append(list(xs))
        raise ConnectionError("down")

    out = answer(down, [1, 2, 3], isolate=False)
    assert calls == [[1, 2, 3]] and all(isinstance(e, ConnectionError) for e in out) and len(out) == 3
    # an item's own exception among the results stays that item's
    mixed = answer(lambda xs: [ValueError("bad") if x == 2 else x for x in xs], [1, 2], isolate=False)
    assert mixed[0] == 1 and isinstance(mixed[1], ValueError)


def test_an_answer_of_the_wrong_length_fails_the_batch_for_every_caller() -> None:
    out = answer(lambda xs: xs[:1], [1, 2], isolate=False)
    assert [type(e) for e in out] == [ValueError, ValueError]
    assert "a batch of 2 got 1 answers" in str(out[0])


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        BatchLine(0)
