"""Tests of crl_gym.spill: the one way requests are kept on disk (queue, client outbox, wrapper)."""

from __future__ import annotations

import doctest
import json
import multiprocessing
import os
from pathlib import Path

import crl_gym.spill as spill


def _writer(path: str, who: int) -> None:
    for i in range(200):
        spill.append(Path(path), [json.dumps({"who": who, "i": i, "pad": "x" * 5000})])


def test_appends_of_concurrent_processes_never_mix(tmp_path: Path) -> None:
    path = tmp_path / "unsent.jsonl"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(path), w)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs)
    got, end, bad = spill.read(path, 0, 10_000, json.loads)
    assert bad == [] and end == path.stat().st_size
    for w in range(3):  # every line whole, each writer's in its order
        assert [v["i"] for v, _ in got if v["who"] == w] == list(range(200))


def test_an_offset_names_its_file_and_a_rewrite_voids_it(tmp_path: Path) -> None:
    path = tmp_path / "pending.jsonl"
    spill.append(path, ['{"a": 1}', '{"a": 2}'])
    offset = spill.SpillOffset(path)
    assert offset.load() == 0
    got, end, _ = spill.read(path, 0, 1, json.loads)
    offset.store(end)
    assert spill.SpillOffset(path).load() == end == got[0][1]
    spill.rewrite(path, [b'{"a": 3}\n'], fsync=True)  # a new inode: the old offset is not applied
    assert spill.SpillOffset(path).load() == 0
    assert (tmp_path / "pending.jsonl.offset").read_text().split()[0] == str(os.stat(path).st_ino)


def test_a_partial_last_line_waits_and_a_crash_leftover_is_closed_and_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "pending.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": ')
    got, end, bad = spill.read(path, 0, 10, json.loads)
    assert [v for v, _ in got] == [{"a": 1}] and end == len(b'{"a": 1}\n') and bad == []
    spill.terminate_partial_line(path)  # what an owner does on open: the writer is gone
    got, _, bad = spill.read(path, end, 10, json.loads)
    assert got == [] and [line for _, line, _ in bad] == [b'{"a": \n']
    spill.set_aside(path, [line for _, line, _ in bad])
    assert spill.rejected_path(path).read_bytes() == b'{"a": \n'


def test_docstring_examples_run() -> None:
    result = doctest.testmod(spill)
    assert result.attempted > 0 and result.failed == 0
