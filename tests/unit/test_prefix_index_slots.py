"""The index's per-block worker masks: one walk gives every worker's match, slots are reused cleanly."""

from __future__ import annotations

from xpyd.discovery.types import Role, WorkerInfo
from xpyd.proxy.block_holders import BlockHolders
from xpyd.proxy.prefix_index import KVUpdate, PrefixIndex


def worker(i: int, role: Role = Role.PREFILL) -> WorkerInfo:
    return WorkerInfo(role, f"http://10.0.0.{i}:8000", f"10.0.0.{i}:9000", "m", 1, 4)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def snapshot(index: PrefixIndex, w: WorkerInfo, hashes, epoch: str = "e", seq: int = 1) -> bool:
    return index.apply(w, index.entry(w), KVUpdate(epoch, seq, snapshot=set(hashes)))


def events(index: PrefixIndex, w: WorkerInfo, seq: int, *evs: tuple[str, int], epoch: str = "e") -> bool:
    return index.apply(w, index.entry(w), KVUpdate(epoch, seq, events=tuple(evs)))


CHAIN = [2**64 - 1 - i for i in range(6)]  # full-width hashes


def test_one_walk_gives_each_workers_match():
    index = PrefixIndex()
    ws = [worker(i) for i in range(5)]
    for i, w in enumerate(ws[:4]):
        snapshot(index, w, CHAIN[:i * 2])  # 0, 2, 4, 6 leading blocks
    snapshot(index, ws[3], CHAIN[:3] + CHAIN[4:])  # a hole at block 3: only 3 count
    stranger = worker(9)  # never heard of
    assert index.match_all(CHAIN, ws + [stranger]) == [0, 2, 4, 3, 0, 0]
    assert index.match_all(CHAIN, []) == []
    assert index.match_all([], ws) == [0] * 5
    assert [index.match(w, CHAIN) for w in ws] == [0, 2, 4, 3, 0]
    assert index.match_all(CHAIN[1:], ws) == [0, 1, 3, 2, 0]  # leading blocks of the chain asked about
    assert index.match_all(CHAIN[:2], [ws[2], ws[2], ws[1]]) == [2, 2, 2]  # a worker twice, shorter chain
    # Another role at the same URL is another worker.
    assert index.match(WorkerInfo(Role.DECODE, ws[2].http_url, "x:1", "m", 1, 4), CHAIN) == 0


def test_events_and_counts_per_worker():
    index = PrefixIndex()
    a, b = worker(1), worker(2)
    snapshot(index, a, CHAIN[:2])
    snapshot(index, b, CHAIN[:2])
    assert events(index, a, 2, ("stored", CHAIN[2]), ("stored", CHAIN[2]), ("removed", CHAIN[0]), ("removed", 5))
    assert index.blocks(a) == 2 and index.blocks(b) == 2  # stored twice counts once; removing a stranger: nothing
    assert index.match_all(CHAIN, [a, b]) == [0, 2]
    assert index.match_all(CHAIN[1:], [a, b]) == [2, 1]
    assert events(index, b, 3, ("removed", CHAIN[0]), ("removed", CHAIN[1]))
    assert index.blocks(b) == 0 and index.match_all(CHAIN[1:], [a, b]) == [2, 0]


def test_a_snapshot_replaces_the_workers_blocks_and_only_its():
    index = PrefixIndex()
    a, b = worker(1), worker(2)
    snapshot(index, a, CHAIN)
    snapshot(index, b, CHAIN[:3])
    assert snapshot(index, a, CHAIN[:1] + [7, 8], epoch="e2", seq=4)  # restarted
    assert index.match_all(CHAIN, [a, b]) == [1, 3] and index.blocks(a) == 3
    assert index.match(a, [CHAIN[0], 7, 8]) == 3 and index.match(b, [CHAIN[0], 7, 8]) == 1
    assert index.match(a, [8, 9]) == 1


def test_events_that_do_not_follow_on_clear_only_that_worker():
    index = PrefixIndex()
    a, b = worker(1), worker(2)
    snapshot(index, a, CHAIN)
    snapshot(index, b, CHAIN)
    assert not events(index, a, 9, ("stored", 1), epoch="other")
    assert index.match_all(CHAIN, [a, b]) == [0, 6] and index.blocks(a) is None
    assert snapshot(index, a, CHAIN[:2], seq=10)
    assert index.match_all(CHAIN, [a, b]) == [2, 6] and index.blocks(a) == 2


def test_expected_blocks_count_for_their_worker_until_confirmed_removed_or_lapsed():
    clock = Clock()
    index = PrefixIndex(expect_seconds=10, clock=clock)
    a, b = worker(1), worker(2)
    snapshot(index, a, CHAIN[:2])
    index.expect(a, CHAIN[:4])  # 2 held already, 2 expected
    assert list(index.entry(a).expected) == CHAIN[2:4]
    assert index.match_all(CHAIN, [a, b]) == [4, 0]
    clock.now += 6
    index.expect(b, CHAIN[:3])
    assert index.match_all(CHAIN, [a, b]) == [4, 3]
    events(index, a, 2, ("stored", CHAIN[2]))  # confirmed: no longer expected, held
    events(index, b, 1, ("removed", CHAIN[1]), epoch="e")  # b had reported nothing: refused
    assert index.match_all(CHAIN, [a, b]) == [4, 3]
    clock.now += 4  # a's expectations (from 100) lapse at 110; b's (from 106) hold until 116
    assert index.match_all(CHAIN, [a, b]) == [3, 3] and index.entry(a).expected == {}
    snapshot(index, b, [])
    events(index, b, 2, ("removed", CHAIN[1]))  # an eviction report ends b's expectation of block 1
    assert index.match_all(CHAIN, [a, b]) == [3, 1]
    clock.now += 6
    assert index.match_all(CHAIN, [a, b]) == [3, 0] and index.entry(b).expected == {}


def test_renewed_expectations_lapse_with_the_latest():
    clock = Clock()
    index = PrefixIndex(expect_seconds=10, clock=clock)
    a = worker(1)
    index.expect(a, CHAIN[:2])
    clock.now += 8
    index.expect(a, CHAIN[:1])  # block 0 renewed until 118; block 1 lapses at 110
    clock.now += 3
    assert index.match(a, CHAIN) == 1
    clock.now += 7
    assert index.match(a, CHAIN) == 0 and index.entry(a).expected == {}


def test_a_snapshot_keeps_expectations_it_does_not_confirm():
    clock = Clock()
    index = PrefixIndex(expect_seconds=10, clock=clock)
    a = worker(1)
    snapshot(index, a, CHAIN[:1])
    index.expect(a, CHAIN[:3])
    snapshot(index, a, CHAIN[:2], seq=5)  # confirms block 1; block 2 still on its way
    assert list(index.entry(a).expected) == [CHAIN[2]]
    assert index.match(a, CHAIN) == 3
    clock.now += 10
    assert index.match(a, CHAIN) == 2


def test_a_dropped_workers_slot_is_reused_without_its_old_blocks():
    index = PrefixIndex()
    ws = [worker(i) for i in range(40)]
    for w in ws:
        snapshot(index, w, CHAIN)
    index.expect(ws[0], [42])
    index.drop(ws[0])
    index.retain(ws[2:])  # ws[1] left the registry
    assert index.get(ws[0]) is None and index.match_all(CHAIN, ws[:3]) == [0, 0, 6]
    # Many workers come and go: slots are swept and reused, and no newcomer inherits a block.
    for round_ in range(200):
        w = worker(100 + round_ % 3, Role.DECODE)
        assert index.match(w, CHAIN) == 0 and index.match(w, [42]) == 0
        snapshot(index, w, CHAIN[:1] + [round_])
        assert index.match(w, CHAIN) == 1 and index.match(w, [round_]) == 1
        index.drop(w)
    assert index._blocks.slots <= 64  # swept instead of growing (or widening the masks)
    assert index.match_all(CHAIN, ws[2:]) == [6] * 38
    index._blocks.sweep()
    assert index._blocks.hashes() == set(CHAIN)  # the departed workers' own blocks are gone once swept


def test_late_answers_for_a_dropped_worker_change_nothing():
    index = PrefixIndex()
    a, b = worker(1), worker(2)
    snapshot(index, a, CHAIN)
    old = index.entry(a)
    index.drop(a)
    snapshot(index, b, [])  # b may take a's slot later
    assert not index.apply(a, old, KVUpdate("e", 2, events=(("stored", 1),)))
    assert index.match_all(CHAIN + [1], [a, b]) == [0, 0]


def test_holders_walk_and_sweep():
    holders = BlockHolders()
    s0, s1 = holders.take(0), holders.take(1)
    assert (s0, s1) == (0, 1)
    assert holders.store(s0, [10, 11, 12], 3) == 3
    assert holders.apply(s1, [("stored", 10)]) == 1
    assert holders.apply(s1, [("stored", 10), ("removed", 99)]) == 0  # held already; never held
    holders.expect(s1, 11)
    assert holders.walk([10, 11, 12], [s0, s1, None]) == [3, 2, 0]
    holders.unexpect(s1, 11)
    assert holders.walk([10, 11, 12], [s0, s1]) == [3, 1]
    holders.retire(s0, ())
    assert holders.mask(10) == 0b11 and holders.distinct() == 3  # a retired bit lingers until written or swept
    assert holders.walk([10], [s0]) == [1]  # (callers never pass a retired slot)
    assert holders.apply(s1, [("removed", 10)]) == -1
    assert holders.mask(10) == 0 and holders.hashes() == {11, 12}  # ... its last live holder left: gone
    holders.sweep()
    assert holders.hashes() == set() and holders.distinct() == 0
    assert holders.take(1) == s0  # swept slot reused, lowest first


def test_long_chains_match_and_expect_past_the_blocks_looked_up_one_by_one():
    clock = Clock()
    index = PrefixIndex(expect_seconds=10, clock=clock)
    a, b = worker(1), worker(2)
    chain = [2**64 - 1 - i for i in range(700)]  # (the first 64 looked up one by one, then 256, then the rest)
    snapshot(index, a, chain[:500])
    snapshot(index, b, chain[:70] + chain[71:])
    assert index.match_all(chain, [a, b]) == [500, 70]
    index.expect(a, chain[:650])  # 500 held, 150 expected
    assert list(index.entry(a).expected) == chain[500:650]
    assert index.match_all(chain, [a, b]) == [650, 70]
    clock.now += 10
    assert index.match_all(chain, [a, b]) == [500, 70]
