"""The transfer listener's door (``listener.Door``): how many connections that proved nothing may stay, and how long.

Real sockets (socket pairs: the listener's end goes through the door, the test holds the peer's end, which
sees EOF once the door shuts a connection down); the door's decisions are synchronous, so each check is
exact. The listeners under a real flood: tests/integration/test_transfer_listener_flood.py.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

import pytest

from xpyd.transfer.listener import Door, DoorConn, source_of
from xpyd.transfer.tcp_wire import Unproven, pack_frame

log = logging.getLogger(__name__)


class Guests:
    """Connections let through one door, with the peers' ends."""

    def __init__(self, door: Door, opening_frames: int = 1) -> None:
        self.door, self.opening_frames = door, opening_frames
        self.wake = os.pipe()
        self.conns: list[DoorConn] = []
        self.peers: list[socket.socket] = []

    def enter(self, source: str) -> int:
        mine, peer = socket.socketpair()
        mine.setblocking(False)
        peer.setblocking(False)
        self.conns.append(self.door.enter(mine, (source, 40000 + len(self.conns)), self.wake[0], 30.0,
                                          self.opening_frames, log))
        self.peers.append(peer)
        return len(self.conns) - 1

    def shut(self, i: int) -> bool:
        """Has the door shut connection ``i`` down (its peer reads EOF)? (never waits)"""
        try:
            return self.peers[i].recv(1) == b""
        except BlockingIOError:
            return False

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        for peer in self.peers:
            peer.close()
        for fd in self.wake:
            os.close(fd)


@pytest.fixture
def guests():
    made = []

    def make(door: Door, opening_frames: int = 1) -> Guests:
        made.append(Guests(door, opening_frames))
        return made[-1]

    yield make
    for g in made:
        g.close()


def test_one_source_keeps_at_most_its_cap_pending_and_evicts_its_own_oldest(guests):
    g = guests(Door(max_pending=64, max_per_source=16))
    ids = [g.enter("10.0.0.9") for _ in range(20)]
    assert g.door.pending == 16
    assert [g.shut(i) for i in ids] == [True] * 4 + [False] * 16  # the four oldest, and only they


def test_many_sources_keep_the_total_cap_and_the_biggest_source_pays(guests):
    g = guests(Door(max_pending=8, max_per_source=4))
    flood = [g.enter("10.0.0.66") for _ in range(4)] + [g.enter("10.0.0.67") for _ in range(3)]
    real = g.enter("10.0.0.1")  # 8 pending: the door is full
    assert g.door.pending == 8 and not any(g.shut(i) for i in flood + [real])
    late = [g.enter("10.0.0.2"), g.enter("10.0.0.3")]  # each evicts the oldest of the biggest source
    assert g.door.pending == 8
    # the first from .66 (4 pending), then (.66 and .67 both had 3) the next from .66, the first of them
    assert [g.shut(i) for i in flood] == [True, True, False, False, False, False, False]
    assert not g.shut(real) and not any(g.shut(i) for i in late)


def test_an_ipv6_prefix_is_one_source(guests):
    """Whoever holds one address of an IPv6 /64 usually holds them all: the /64 shares one cap."""
    assert source_of("2001:db8:1:2::a") == source_of("2001:db8:1:2:ffff::1%eth0") == "2001:db8:1:2::/64"
    assert source_of("2001:db8:1:3::a") != source_of("2001:db8:1:2::a")
    assert source_of("::ffff:10.1.2.3") == source_of("10.1.2.3") == "10.1.2.3"
    g = guests(Door(max_pending=64, max_per_source=4))
    flood = [g.enter(f"2001:db8:1:2::{i:x}") for i in range(1, 7)]
    other = g.enter("2001:db8:1:3::1")
    assert g.door.pending_by_source() == {"2001:db8:1:2::/64": 4, "2001:db8:1:3::/64": 1}
    assert [g.shut(i) for i in flood] == [True, True, False, False, False, False] and not g.shut(other)


def test_a_connection_that_sent_its_opening_frames_is_never_evicted(guests):
    g = guests(Door(max_pending=4, max_per_source=2), opening_frames=2)
    real = g.enter("10.0.0.1")
    g.peers[real].sendall(pack_frame({"hello": 1}) + pack_frame({"offer": 1}))
    assert g.conns[real].read_frame(1 << 10) == {"hello": 1}
    assert g.door.pending == 1  # one frame of two: still pending
    assert g.conns[real].read_frame(1 << 10) == {"offer": 1}
    assert g.door.pending == 0 and g.conns[real].deadline is None  # in: waits as any connection
    flood = [g.enter(src) for src in ("10.0.0.1", "10.0.0.7") for _ in range(50)]
    assert g.door.pending == 4
    assert not g.shut(real)
    g.peers[real].sendall(pack_frame({"offer": 2}))
    assert g.conns[real].read_frame(1 << 10) == {"offer": 2}  # still served
    assert sum(g.shut(i) for i in flood) == 96
    for i in flood:
        g.conns[i].close()
    assert g.door.dropped == 96  # each evicted one, counted when its reader closed it
    assert g.door.pending == 0


def test_an_evicted_reader_wakes_and_is_told_why(guests):
    g = guests(Door(max_pending=4, max_per_source=1))
    first = g.enter("10.0.0.9")
    raised: list[BaseException] = []

    def read() -> None:
        try:
            g.conns[first].read_frame(1 << 10)
        except BaseException as e:
            raised.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    g.enter("10.0.0.9")  # evicts the first, whose reader waits in poll
    reader.join(timeout=30)
    assert not reader.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], Unproven) and "newer connection" in str(raised[0])


@pytest.mark.parametrize("sent", [b"", pack_frame({"hello": 1})[:3]], ids=["nothing", "part-of-a-frame"])
def test_a_connection_that_proves_nothing_in_time_is_dropped(guests, sent):
    g = guests(Door(open_timeout=0.05))
    i = g.enter("10.0.0.9")
    g.peers[i].sendall(sent)
    with pytest.raises(Unproven, match="did not come in time"):
        g.conns[i].read_frame(1 << 10, first_byte_timeout=600)
    g.conns[i].close()
    assert g.door.dropped == 1 and g.door.pending == 0


def test_a_connection_that_hangs_up_is_not_counted_as_dropped(guests):
    g = guests(Door())
    i = g.enter("10.0.0.9")
    g.peers[i].close()
    assert g.conns[i].read_frame(1 << 10) is None
    g.conns[i].close()
    assert g.door.dropped == 0 and g.door.pending == 0


@pytest.mark.parametrize("kw", [{"open_timeout": 0}, {"max_pending": 4, "max_per_source": 5},
                                {"max_per_source": 0}])
def test_bad_limits_are_refused(kw):
    with pytest.raises(ValueError):
        Door(**kw)
