"""Which lane a job goes to (``sender.Senders``), exactly: lanes are started only while every lane of the
address is moving a transfer, up to the bound; stopping puts one ``None`` per lane behind the jobs queued."""

from __future__ import annotations

from queue import SimpleQueue

import pytest

from xpyd.transfer.base import CompletionToken, Region, TransferState
from xpyd.transfer.sender import Senders
from xpyd.transfer.table import Transfer


def _job(tid: str) -> Transfer:
    return Transfer(CompletionToken(tid), (Region(0, 1),), 1)


class Started:
    def __init__(self) -> None:
        self.queues: list[tuple[str, SimpleQueue]] = []

    def __call__(self, address: str, queue: SimpleQueue) -> None:
        self.queues.append((address, queue))


def _drain(queue: SimpleQueue) -> list:
    out = []
    while not queue.empty():
        item = queue.get_nowait()
        out.append(item if item is None else item.token.transfer_id)
    return out


def test_lanes_open_only_while_every_lane_moves_a_transfer_and_up_to_the_bound():
    senders, start = Senders(lanes=3), Started()
    a = _job("a")
    senders.submit("p:1", a, start)
    assert senders.lanes("p:1") == 1
    b = _job("b")
    senders.submit("p:1", b, start)  # a's lane is not moving yet (connecting): no second connection
    assert senders.lanes("p:1") == 1
    a.token._advance(TransferState.TRANSFERRING)
    senders.submit("p:1", _job("c"), start)  # a moves on the only lane: a second one opens
    assert senders.lanes("p:1") == 2
    b.token._advance(TransferState.TRANSFERRING)
    senders.submit("p:1", _job("d"), start)  # 2 moving of 2 lanes
    assert senders.lanes("p:1") == 3
    for tid in "ef":
        senders.submit("p:1", _job(tid), start)  # at the bound
    assert senders.lanes("p:1") == 3
    assert len(start.queues) == 3 and all(q == start.queues[0] for q in start.queues)  # 3 lanes, one queue
    queue = start.queues[0][1]
    assert _drain(queue) == ["a", "b", "c", "d", "e", "f"]


def test_finished_jobs_free_their_lane_for_the_next_without_a_new_one():
    senders, start = Senders(lanes=4), Started()
    a = _job("a")
    senders.submit("p:1", a, start)
    a.token._advance(TransferState.TRANSFERRING)
    a.token._advance(TransferState.DONE)
    for tid in "bcd":
        senders.submit("p:1", (job := _job(tid)), start)
        job.token._advance(TransferState.TRANSFERRING)
        job.token._fail("refused") if tid == "c" else job.token._advance(TransferState.DONE)
    assert senders.lanes("p:1") == 1


def test_each_address_has_its_own_lanes_and_forget_stops_each_lane_after_the_queued_jobs():
    senders, start = Senders(lanes=2), Started()
    x, y = _job("x"), _job("y")
    senders.submit("p:1", x, start)
    x.token._advance(TransferState.TRANSFERRING)
    senders.submit("p:1", y, start)
    senders.submit("q:2", _job("z"), start)
    assert (senders.lanes("p:1"), senders.lanes("q:2")) == (2, 1)
    assert senders.forget("p:1") == 2 and senders.lanes("p:1") == 0
    assert senders.forget("p:1") == 0
    assert _drain(start.queues[0][1]) == ["x", "y", None, None]
    senders.take()
    assert _drain(start.queues[2][1]) == ["z", None] and senders.lanes("q:2") == 0


@pytest.mark.parametrize("lanes", [0, -1, 1.5, True])
def test_the_bound_is_a_positive_int(lanes):
    with pytest.raises(ValueError, match="lanes"):
        Senders(lanes)
