"""KeepingClient: the outbox that keeps what a client could not take (by hand)."""

from __future__ import annotations

import json
from pathlib import Path

from crl_gym.clients import KeepingClient
from crl_gym.protocol import DistillationRequest, Trajectory


def request(task: str) -> DistillationRequest:
    return DistillationRequest(task, Trajectory(), 0.0, False, None)


class Flaky:
    """Down until ``up`` is set; refuses a request whose task is ``"bad"`` as malformed."""

    def __init__(self) -> None:
        self.up = False
        self.got: list[str] = []

    def submit(self, r: DistillationRequest) -> None:
        if r.task == "bad":
            raise ValueError("malformed")
        if not self.up:
            raise ConnectionError("down")
        self.got.append(r.task)


def test_kept_in_memory_then_delivered_in_order_and_malformed_dropped() -> None:
    client = Flaky()
    keeping = KeepingClient(client)
    first = keeping.offer(request("a"))
    assert (first.sent, first.kept) == (False, True)
    assert first.outages == ("submit failed: ConnectionError: down",)
    second = keeping.offer(request("b"))  # the retry of "a" fails: "b" is kept without a try
    assert second.kept and len(second.outages) == 1
    assert [r.task for r in keeping.unsent] == ["a", "b"]
    bad = keeping.offer(request("bad"))
    assert bad.kept  # the client is still down: "bad" waits behind the others
    client.up = True
    done = keeping.retry()
    assert client.got == ["a", "b"] and done.still_unsent == 0 and len(done.rejections) == 1
    assert keeping.submitted == 2
    assert keeping.offer(request("bad")).rejections and not keeping.unsent  # dropped, never kept
    assert keeping.offer(request("c")).sent and client.got == ["a", "b", "c"]


def test_kept_requests_go_to_the_spill_file(tmp_path: Path) -> None:
    spill = tmp_path / "unsent.jsonl"
    keeping = KeepingClient(Flaky(), spill_path=spill)
    assert keeping.offer(request("a")).kept and not keeping.unsent
    assert [json.loads(line)["task"] for line in spill.read_text().splitlines()] == ["a"]


def test_memory_holds_at_most_max_unsent() -> None:
    keeping = KeepingClient(Flaky(), max_unsent=2)
    for task in "abc":
        keeping.offer(request(task))
    assert [r.task for r in keeping.unsent] == ["b", "c"]
