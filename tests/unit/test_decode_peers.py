"""The prefill worker's record of decode workers: liveness, departures, eviction, sessions that end."""

from __future__ import annotations

from xpyd.prefill_worker.peers import DecodePeers, PeerMap
from xpyd.transfer.base import BackendDescriptor

DESC = BackendDescriptor("tcp", "127.0.0.1:9", 4096)


def test_only_handshaken_peers_are_heard_from_and_live_counts_open_sessions_still_in_the_cluster():
    peers = DecodePeers()
    assert not peers.heard_from("a", 1.0)  # no handshake yet
    peers.accept("a", 0.0)
    peers.accept("b", 0.0)
    assert peers.heard_from("a", 8.0) and peers.last_heard("a") == 8.0
    assert peers.live() == 2  # (b said nothing since its handshake: its session is open, it is live)
    peers.leave("a", 12.0)
    assert peers.live() == 1 and peers.left_at("a") == 12.0
    peers.forget_left(before=13.0)
    assert peers.left_at("a") is None
    peers.leave("b", 14.0)
    peers.accept("b", 15.0)  # restarted on the same address: back
    assert peers.left_at("b") is None and peers.live() == 2
    peers.leave("b", 20.0)
    peers.joined("b")  # listed again without a new handshake (its etcd lease was lost, then it registered again)
    assert peers.left_at("b") is None and peers.live() == 2
    assert peers.close("b") and peers.live() == 1  # its session ended


def test_the_least_recently_heard_from_is_forgotten_beyond_the_limit_with_its_pool():
    peers = DecodePeers(max_peers=2)
    for i, name in enumerate("abc"):
        peers.accept(name, float(i))
        peers.register(name, PeerMap(DESC, 64, 8))
    assert peers.num_handshaken == 2 and peers.pool("a") is None and not peers.heard_from("a", 5.0)
    assert peers.pool("c") == PeerMap(DESC, 64, 8) and peers.leave("c", 6.0) == PeerMap(DESC, 64, 8)


def test_a_closed_session_forgets_the_handshake_and_the_pool_until_the_next_one():
    peers = DecodePeers()
    peers.accept("a", 0.0)
    peers.register("a", PeerMap(DESC, 64, 8))
    assert peers.close("a") and not peers.close("a")  # (the second time: nothing to forget)
    assert peers.pool("a") is None and not peers.heard_from("a", 1.0) and peers.last_heard("a") is None
    assert peers.num_handshaken == 0 and peers.num_registered == 0
    peers.accept("a", 2.0)  # its next session
    assert peers.heard_from("a", 3.0) and peers.pool("a") is None  # (it maps its pool again)
