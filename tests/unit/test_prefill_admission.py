"""Prefill admission per decode worker: places go only to decode workers with work here (one alone may take the
whole batch, however many others are live); while several have requests waiting each holds at most its fair
share, so KV waiting for one slow or full decode worker never keeps every place from the others; and claimed
KV is not subject to kv_ttl (scheduler level; the engine decides when a claimant is gone)."""

from __future__ import annotations

import random
from collections import Counter

from xpyd.prefill_worker.scheduler import PrefillScheduler, PrefillSeq
from xpyd.worker.request import RequestState
from tests.unit.kv_fixtures import kv_cache, next_prefill

S = RequestState


def _prefill(sched: PrefillScheduler, now: float = 0.0) -> PrefillSeq | None:
    seq = next_prefill(sched)
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


def _held_by(sched: PrefillScheduler) -> dict[str, int]:
    return dict(Counter(s.peer for s in sched.held()))


def _served_each(sched: PrefillScheduler, peers: list[str]) -> None:
    """Every decode worker in ``peers`` had one request here that ran and was pulled: 48 live decode workers,
    all known to this prefill worker, none with work here any more."""
    for p in peers:
        sched.add(PrefillSeq(f"{p}-old", [1], peer=p))
        sched.release(_prefill(sched).request_id, S.FINISHED)
    assert not sched.has_work()


PEERS_48 = [f"d{i}" for i in range(48)]


def test_at_48_decode_workers_one_with_8_waiting_gets_all_8_places():
    sched = PrefillScheduler(batch_size=8, kv=kv_cache(64))
    _served_each(sched, PEERS_48)
    for i in range(9):
        sched.add(PrefillSeq(f"a{i}", [1], peer="d0"))
    assert [_prefill(sched).request_id for _ in range(8)] == [f"a{i}" for i in range(8)]
    assert _prefill(sched) is None and _held_by(sched) == {"d0": 8}  # the batch is full, not d0's share
    sched.check_invariants()


def test_at_48_decode_workers_two_with_work_get_4_places_each():
    sched = PrefillScheduler(batch_size=8, kv=kv_cache(64))
    _served_each(sched, PEERS_48)
    for i in range(8):
        sched.add(PrefillSeq(f"a{i}", [1], peer="d0"))
    for i in range(8):
        sched.add(PrefillSeq(f"b{i}", [1], peer="d1"))
    order = [_prefill(sched).request_id for _ in range(8)]
    assert order == ["a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3"]
    assert _prefill(sched) is None and _held_by(sched) == {"d0": 4, "d1": 4}
    sched.check_invariants()


def test_a_newcomer_with_demand_takes_the_next_place_that_frees():
    """d0 (slow: it pulls nothing) took the whole batch and has more waiting; d1 asks: d0 is now above its
    share (4 of 8), so the first place that frees goes to d1, and the next ones too until d1 has its share."""
    sched = PrefillScheduler(batch_size=8, kv=kv_cache(64))
    _served_each(sched, PEERS_48)
    for i in range(12):
        sched.add(PrefillSeq(f"a{i}", [1], peer="d0"))
    assert [_prefill(sched).request_id for _ in range(8)] == [f"a{i}" for i in range(8)]
    sched.add(PrefillSeq("b0", [1], peer="d1"))
    sched.add(PrefillSeq("b1", [1], peer="d1"))
    assert _prefill(sched) is None  # (no place is free yet)
    sched.release("a0", S.FINISHED)
    assert _prefill(sched).request_id == "b0"  # ahead of a8, waiting longer
    sched.release("a1", S.FINISHED)
    assert _prefill(sched).request_id == "b1"
    assert _held_by(sched) == {"d0": 6, "d1": 2}
    for rid in ("a2", "a3", "a4"):  # d0 pulls: it is over its share only while d1 waits
        sched.release(rid, S.FINISHED)
    assert [_prefill(sched).request_id for _ in range(3)] == ["a8", "a9", "a10"]
    sched.check_invariants()


def test_a_decode_worker_holding_kv_keeps_no_place_for_itself():
    """Work here is requests waiting or held: d1's held request takes a place, and nothing else is kept
    for d1 (d0 alone with demand may take every free place)."""
    sched = PrefillScheduler(batch_size=4, kv=kv_cache(16))
    sched.add(PrefillSeq("b0", [1], peer="d1"))
    _prefill(sched)
    for i in range(4):
        sched.add(PrefillSeq(f"a{i}", [1], peer="d0"))
    assert [s.request_id for s in (_prefill(sched) for _ in range(4)) if s] == ["a0", "a1", "a2"]
    assert _held_by(sched) == {"d0": 3, "d1": 1}
    sched.check_invariants()


def test_while_several_decode_workers_wait_each_gets_a_fair_share_oldest_first():
    sched = PrefillScheduler(batch_size=4, kv=kv_cache(4))
    for i in range(4):
        sched.add(PrefillSeq(f"a{i}", [1], peer="A"))
    for i in range(2):
        sched.add(PrefillSeq(f"b{i}", [1], peer="B"))
    order = [_prefill(sched).request_id for _ in range(4)]
    assert order == ["a0", "a1", "b0", "b1"]  # A may hold 2 of 4 while B waits; then B's two run
    sched.check_invariants()


def test_a_decode_worker_holds_at_most_its_share_of_the_kv_blocks():
    """Places are not the only share: while B waits, A may hold 2 of 4 places and 16 * 2 // 4 = 8 of the 16
    blocks; A's long prompts take 5 blocks each, so its second waits (10 > 8) and B's prompt (2 blocks),
    younger, starts beside the first. Then B has nothing waiting and A is alone: its second starts."""
    sched = PrefillScheduler(batch_size=4, kv=kv_cache(16))
    for i in range(3):
        sched.add(PrefillSeq(f"a{i}", list(range(20)), peer="A"))
    sched.add(PrefillSeq("b0", list(range(8)), peer="B"))
    assert [_prefill(sched).request_id for _ in range(2)] == ["a0", "b0"]
    assert sched.kv.allocator.num_free == 16 - 5 - 2
    assert _prefill(sched).request_id == "a1"
    assert _prefill(sched) is None  # (a2: 5 blocks, 4 free)
    sched.check_invariants()


def test_alone_a_decode_worker_may_use_the_whole_pool():
    sched = PrefillScheduler(batch_size=4, kv=kv_cache(16))
    for i in range(3):
        sched.add(PrefillSeq(f"a{i}", list(range(20)), peer="A"))
    assert [s.request_id for s in (_prefill(sched) for _ in range(3)) if s] == ["a0", "a1", "a2"]
    assert sched.kv.allocator.num_free == 16 - 3 * 5
    sched.check_invariants()


def test_a_prompt_larger_than_its_share_runs_alone():
    sched = PrefillScheduler(batch_size=4, kv=kv_cache(32))
    sched.add(PrefillSeq("long", list(range(80)), peer="A"))  # 20 blocks > A's share of 16 while B waits
    sched.add(PrefillSeq("next", list(range(4)), peer="A"))
    sched.add(PrefillSeq("b0", list(range(4)), peer="B"))
    sched.add(PrefillSeq("b1", list(range(4)), peer="B"))
    assert _prefill(sched).request_id == "long"  # A held nothing: it starts
    order = [_prefill(sched).request_id for _ in range(3)]
    assert order == ["b0", "b1", "next"]  # A is over its share while B waits: its next one waits for B's
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
    n = admitted = 0
    for _ in range(2000):
        op = rng.random()
        if op < 0.4:
            sched.add(PrefillSeq(f"r{n}", [1], peer=rng.choice(peers)))
            n += 1
        elif op < 0.7:
            held, waiting_peers = _held_by(sched), {s.peer for s in sched._waiting}
            seq = _prefill(sched)
            if seq is not None:  # it took a place only if its decode worker was under its fair share
                assert held.get(seq.peer, 0) < -(-6 // len(waiting_peers))
                admitted += 1
        elif sched.held():
            sched.release(rng.choice(sched.held()).request_id, S.FINISHED)
        sched.check_invariants()
    assert admitted > 300
    for s in list(sched.held()):
        sched.release(s.request_id, S.FINISHED)
    while sched.num_waiting:
        _prefill(sched)
        for s in list(sched.held()):
            sched.release(s.request_id, S.FINISHED)
    assert slots.allocator.num_referenced == 0 and not sched.has_work()
