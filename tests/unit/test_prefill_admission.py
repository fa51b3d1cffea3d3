"""Prefill admission per decode worker: KV waiting for one slow or full decode worker never takes every
slot from the others, and claimed KV is not subject to kv_ttl (scheduler level; the engine decides when a
claimant is gone)."""

from __future__ import annotations

import random

from xpyd.prefill_worker.scheduler import PrefillScheduler, PrefillSeq
from xpyd.worker.request import RequestState
from tests.unit.kv_fixtures import kv_cache, next_prefill

S = RequestState


def _prefill(sched: PrefillScheduler, live_peers: int = 1, now: float = 0.0) -> PrefillSeq | None:
    seq = next_prefill(sched, live_peers)
    if seq is not None:
        sched.prefilled(seq, 7, now)
    return seq


def test_one_decode_worker_alone_may_use_every_slot():
    sched = PrefillScheduler(batch_size=4, kv=kv_cache(4))
    for i in range(5):
        sched.add(PrefillSeq(f"a{i}", [1], peer="A"))
    assert [_prefill(sched).request_id for _ in range(4)] == ["a0", "a1", "a2", "a3"]
    assert _prefill(sched) is None  # full
    sched.check_invariants()


def test_a_slot_stays_free_for_each_other_live_decode_worker():
    sched = PrefillScheduler(batch_size=4, kv=kv_cache(4))
    for i in range(6):
        sched.add(PrefillSeq(f"a{i}", [1], peer="A"))
    ran = [_prefill(sched, live_peers=2) for _ in range(4)]
    assert [s.request_id for s in ran if s] == ["a0", "a1", "a2"]  # A (stuck, never pulls) stops at 3 of 4
    sched.add(PrefillSeq("b0", [1], peer="B"))
    assert _prefill(sched, live_peers=2).request_id == "b0"  # B is served at once despite A's backlog
    sched.check_invariants()


def test_while_several_decode_workers_wait_each_gets_a_fair_share_oldest_first():
    sched = PrefillScheduler(batch_size=4, kv=kv_cache(4))
    for i in range(4):
        sched.add(PrefillSeq(f"a{i}", [1], peer="A"))
    for i in range(2):
        sched.add(PrefillSeq(f"b{i}", [1], peer="B"))
    order = [_prefill(sched, live_peers=2).request_id for _ in range(4)]
    assert order == ["a0", "a1", "b0", "b1"]  # A may hold 2 of 4 while B waits; then B's two run
    sched.check_invariants()


def test_a_decode_worker_holds_at_most_its_share_of_the_kv_blocks():
    """Places are not the only share: A's three long prompts (5 blocks each) would take 15 of 16 blocks with
    the 3 places A may hold beside one other live decode worker; A's block share is 16 * 3 // 4 = 12, so its
    third waits and B's prompt (2 blocks) starts at once."""
    sched = PrefillScheduler(batch_size=4, kv=kv_cache(16))
    for i in range(3):
        sched.add(PrefillSeq(f"a{i}", list(range(20)), peer="A"))
    assert [s.request_id for s in (_prefill(sched, live_peers=2) for _ in range(3)) if s] == ["a0", "a1"]
    sched.add(PrefillSeq("b0", list(range(8)), peer="B"))
    assert _prefill(sched, live_peers=2).request_id == "b0"
    assert sched.kv.allocator.num_free == 16 - 2 * 5 - 2
    sched.check_invariants()


def test_a_prompt_larger_than_its_share_runs_alone():
    sched = PrefillScheduler(batch_size=4, kv=kv_cache(16))
    sched.add(PrefillSeq("long", list(range(56)), peer="A"))  # 14 blocks > A's share of 12
    sched.add(PrefillSeq("next", list(range(4)), peer="A"))
    assert _prefill(sched, live_peers=2).request_id == "long"
    assert _prefill(sched, live_peers=2) is None  # A is over its share: its next one waits
    sched.release("long", S.FINISHED)
    assert _prefill(sched, live_peers=2).request_id == "next"
    sched.check_invariants()


def test_claimed_kv_never_expires_on_kv_ttl_unclaimed_does():
    sched = PrefillScheduler(batch_size=2, kv=kv_cache(2))
    sched.add(PrefillSeq("claimed", [1], peer="A", claimed=True))
    sched.add(PrefillSeq("unclaimed", [1], peer="A"))
    _prefill(sched, now=0.0)
    _prefill(sched, now=0.0)
    assert [s.request_id for s in sched.expired(now=100.0, ttl=30.0)] == ["unclaimed"]
    assert {s.request_id for s in sched.held()} == {"claimed", "unclaimed"}


def test_random_arrivals_from_several_decode_workers_keep_the_invariants():
    rng = random.Random(3)
    slots = kv_cache(6)
    sched = PrefillScheduler(batch_size=6, kv=slots)
    peers = ["A", "B", "C"]
    n = 0
    for _ in range(2000):
        op = rng.random()
        if op < 0.4:
            sched.add(PrefillSeq(f"r{n}", [1], peer=rng.choice(peers)))
            n += 1
        elif op < 0.7:
            _prefill(sched, live_peers=rng.randint(1, 3))
        elif sched.held():
            sched.release(rng.choice(sched.held()).request_id, S.FINISHED)
        sched.check_invariants()
        held = [s.peer for s in sched.held()]
        waiting_peers = {s.peer for s in sched._waiting}
        if len(waiting_peers) > 1 and len(held) == 6:  # full while others wait: no single peer holds all
            assert max(held.count(p) for p in peers) < 6
    for s in list(sched.held()):
        sched.release(s.request_id, S.FINISHED)
    while sched.num_waiting:
        _prefill(sched)
        for s in list(sched.held()):
            sched.release(s.request_id, S.FINISHED)
    assert slots.allocator.num_referenced == 0 and not sched.has_work()
