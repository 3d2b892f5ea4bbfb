import threading
import time

import pytest

from crl_gym.experience.rwlock import RWLock


def test_readers_share_writers_exclude():
    lock = RWLock()
    inside, peak, guard = [0], [0], threading.Lock()

    def reader():
        with lock.read():
            with guard:
                inside[0] += 1
                peak[0] = max(peak[0], inside[0])
            time.sleep(0.05)
            with guard:
                inside[0] -= 1

    ts = [threading.Thread(target=reader) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert peak[0] > 1  # readers overlapped

    log = []

    def writer(i):
        with lock.write():
            log.append(("in", i))
            time.sleep(0.01)
            log.append(("out", i))

    ws = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in ws:
        t.start()
    for t in ws:
        t.join()
    # writers never interleave: every "in" is followed by its own "out"
    assert all(log[j][0] == "in" and log[j + 1] == ("out", log[j][1]) for j in range(0, 8, 2))


def test_waiting_writer_blocks_new_readers():
    lock = RWLock()
    order = []
    lock.acquire_read()
    w = threading.Thread(target=lambda: (lock.acquire_write(), order.append("w"), lock.release_write()))
    w.start()
    time.sleep(0.05)  # writer is now waiting for our read lock
    r = threading.Thread(target=lambda: (lock.acquire_read(), order.append("r"), lock.release_read()))
    r.start()
    time.sleep(0.05)
    assert order == []  # the new reader queues behind the writer
    lock.release_read()
    w.join()
    r.join()
    assert order == ["w", "r"]


def test_reentrancy_and_errors():
    lock = RWLock()
    with lock.write(), lock.write(), lock.read():
        assert lock.write_held()
    assert not lock.write_held()
    with lock.read():
        # a re-entrant read must not deadlock even while a writer waits
        t = threading.Thread(target=lambda: (lock.acquire_write(), lock.release_write()))
        t.start()
        time.sleep(0.02)
        with lock.read():
            pass
        with pytest.raises(RuntimeError, match="upgrade"):
            lock.acquire_write()
    t.join()
    with pytest.raises(RuntimeError):
        lock.release_read()
    with pytest.raises(RuntimeError):
        lock.release_write()
