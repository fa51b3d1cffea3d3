"""The prefill worker's rules for giving up on held KV and on sends (xpyd.prefill_worker.expiry)."""

from __future__ import annotations

from xpyd.prefill_worker.expiry import claim_ttl, late_kv, orphaned
from xpyd.prefill_worker.peers import DecodePeers
from xpyd.prefill_worker.scheduler import PrefillSeq

D0, D1 = "10.0.0.2:8201", "10.0.0.3:8201"
TTL, GRACE, CLAIM_TTL = 30.0, 5.0, 120.0


def seq(rid: str, peer: str, held_since: float, claimed: bool = False) -> PrefillSeq:
    return PrefillSeq(rid, [1, 2, 3], peer=peer, held_since=held_since, claimed=claimed)


def peers_heard(**last: float) -> DecodePeers:
    peers = DecodePeers()
    for name, t in last.items():
        peers.accept({"d0": D0, "d1": D1}[name], t)
    return peers


def why(decisions) -> dict[str, str]:
    return {s.request_id: reason for s, reason in decisions}


def test_unclaimed_kv_waits_kv_ttl_claimed_kv_however_long_its_decode_worker_is_quiet():
    """Claimed KV waits for its pull while its decode worker's session is open, whether or not that worker
    sent anything lately (its engine thread may be starved; a dead or cut-off one loses its session)."""
    peers = peers_heard(d0=100.0)
    held = [seq("unclaimed", D0, 80.0), seq("claimed", D0, 50.0, claimed=True), seq("young", D0, 95.0)]
    assert why(late_kv(held, peers, 109.9, TTL, GRACE, CLAIM_TTL)) == {}
    assert why(late_kv(held, peers, 110.0, TTL, GRACE, CLAIM_TTL)) == {"unclaimed": "not pulled within kv_ttl=30s"}
    assert set(why(late_kv(held, peers, 169.9, TTL, GRACE, CLAIM_TTL))) == {"unclaimed", "young"}  # 70 s quiet


def test_kv_of_a_decode_worker_that_left_the_cluster_gets_a_short_grace():
    peers = peers_heard(d0=100.0, d1=100.0)
    held = [seq("to-d0", D0, 99.0, claimed=True), seq("to-d1", D1, 99.0)]
    peers.leave(D0, 101.0)
    assert why(late_kv(held, peers, 105.9, TTL, GRACE, CLAIM_TTL)) == {}
    assert why(late_kv(held, peers, 106.0, TTL, GRACE, CLAIM_TTL)) == {
        "to-d0": "its decode worker left the cluster and did not pull it within 5s"}
    late = seq("prefilled-after-it-left", D0, 104.0)
    assert why(late_kv([late], peers, 108.9, TTL, GRACE, CLAIM_TTL)) == {}  # the grace runs from the prefill
    peers.joined(D0)  # back in the cluster: an ordinary peer again
    assert why(late_kv(held, peers, 106.0, TTL, GRACE, CLAIM_TTL)) == {}


def test_claimed_kv_that_is_never_pulled_expires_though_its_decode_worker_keeps_talking():
    peers = peers_heard(d0=0.0)
    held = [seq("claimed", D0, 100.0, claimed=True)]
    peers.heard_from(D0, 219.0)  # heartbeats all along
    assert why(late_kv(held, peers, 219.9, TTL, GRACE, CLAIM_TTL)) == {}
    assert why(late_kv(held, peers, 220.0, TTL, GRACE, CLAIM_TTL)) == {
        "claimed": f"its decode worker {D0} claimed it but did not pull it within 120s"}


def test_a_closed_session_orphans_its_claimed_kv_and_its_sends_but_not_unclaimed_kv():
    held = [seq("claimed", D0, 1.0, claimed=True), seq("unclaimed", D0, 1.0), seq("other", D1, 1.0, claimed=True)]
    sending = [seq("pulling", D0, 1.0), seq("dropping", D0, 1.0), seq("theirs", D1, 1.0)]
    sending[1].cancel_requested = True
    claimed, sends = orphaned(held, sending, D0)
    assert [s.request_id for s in claimed] == ["claimed"] and [s.request_id for s in sends] == ["pulling"]


def test_claims_wait_long_whatever_kv_ttl_is():
    assert claim_ttl(0.3) == 600.0 and claim_ttl(30.0) == 600.0 and claim_ttl(300.0) == 1200.0
