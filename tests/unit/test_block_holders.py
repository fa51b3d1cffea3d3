"""The index's block table (``BlockHolders`` over ``BlockTable``): numpy open addressing checked against a
plain dict of sets, through rebuilds, tombstones, long probe runs, spare rows running out, many slots and
hash 0; batches in array passes and events one by one."""

from __future__ import annotations

import random

import numpy as np
import pytest

from xpyd.proxy import block_holders, block_table
from xpyd.proxy.block_holders import BlockHolders

TOP = 2**64 - 1


class Model:
    """What the table must answer: hash -> the slots holding it."""

    def __init__(self) -> None:
        self.held: dict[int, set[int]] = {}

    def apply(self, slot: int, events) -> int:
        change = 0
        for kind, h in events:
            holders = self.held.setdefault(h, set())
            if kind == "stored" and slot not in holders:
                holders.add(slot)
                change += 1
            elif kind == "removed" and slot in holders:
                holders.discard(slot)
                change -= 1
            if not holders:
                del self.held[h]
        return change

    def walk(self, chain, slots) -> list[int]:
        out = []
        for s in slots:
            n = 0
            while s is not None and n < len(chain) and s in self.held.get(chain[n], ()):
                n += 1
            out.append(n)
        return out


def check(holders: BlockHolders, model: Model, slots, rng: random.Random) -> None:
    assert holders.hashes() == set(model.held)
    assert holders.table._used == probed_keys(holders) >= len(model.held) - (0 in model.held)
    assert holders.distinct() == len(model.held)
    for h in rng.sample(sorted(model.held), min(50, len(model.held))):
        assert holders.mask(h) == sum(1 << s for s in model.held[h])
    chains = [sorted(model.held)[:5], [h for h in model.held if slots[0] in model.held[h]][:300]]
    for chain in chains:
        chain = chain + [rng.getrandbits(64)]
        assert holders.walk(chain, slots + [None]) == model.walk(chain, slots + [None])


@pytest.mark.parametrize("seed, wide", [(1, False), (2, False), (3, True), (4, True)])
def test_random_events_and_snapshots_match_a_dict_of_sets(seed, wide):
    rng = random.Random(seed)
    holders, model = BlockHolders(), Model()
    if wide:  # two mask words a block
        made = [holders.take(i) for i in range(70)]
        slots = [made[i] for i in (0, 63, 64, 65, 69)]
        assert holders.words == 2
    else:
        slots = [holders.take(i) for i in range(5)]
    pool = [0, 1, TOP, 2**63] + [rng.getrandbits(64) for _ in range(6000)]  # hash 0 and the extremes too
    for round_ in range(60):
        slot = rng.choice(slots)
        if round_ % 20 == 19:  # a snapshot: the slot holds exactly these (as the index does: a fresh slot)
            fresh = set(rng.sample(pool, 1500))
            model.apply(slot, [("removed", h) for h in list(model.held) if slot in model.held[h]])
            holders.retire(slot, ())
            new = holders.take(len(slots) - 1)
            slots[slots.index(slot)] = new
            holders.sweep()  # (the model forgot the old slot's blocks at once; the table once swept)
            model.apply(new, [("stored", h) for h in fresh])
            assert holders.store(new, fresh, len(fresh)) == len(fresh)
        else:
            n = rng.choice((1, 7, 400))  # one by one, or in array passes
            events = [(rng.choice(("stored", "stored", "removed")), rng.choice(pool)) for _ in range(n)]
            assert holders.apply(slot, events) == model.apply(slot, events)
        check(holders, model, slots, rng)
    assert holders.table._capacity > block_table._MIN_CAPACITY  # it grew on the way


def test_one_batch_applies_each_hashs_last_event():
    holders = BlockHolders()
    s = holders.take(0)
    assert holders.apply(s, [("stored", 5), ("removed", 5), ("removed", 6), ("stored", 6), ("stored", 6)]) == 1
    assert holders.hashes() == {6}
    assert holders.apply(s, [("removed", 6), ("stored", 6), ("removed", 6)]) == -1
    assert holders.hashes() == set() and holders.distinct() == 0


def _same_home(holders: BlockHolders, home: int, n: int, seed: int = 0) -> list[int]:
    """``n`` hashes whose first row is ``home`` (in the table as it is)."""
    gen = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < n:
        q = gen.integers(1, 2**64, 1 << 20, dtype=np.uint64, endpoint=False)
        out += q[holders.table._home(q, holders.table._capacity) == home].tolist()
    return out[:n]


def probed_keys(holders: BlockHolders) -> int:
    return int(np.count_nonzero(holders.table._keys[:holders.table._capacity + block_table._PAD]))


@pytest.mark.parametrize("wide", [False, True])
def test_a_long_probe_run_with_tombstones_reused(wide):
    assert block_holders._SMALL < 100  # (batches of 100 or more go in array passes, of 10 or fewer one by one)
    holders = BlockHolders()
    made = [holders.take(i) for i in range(66 if wide else 2)]
    a, b = made[0], made[-1]  # wide: two mask words a block
    run = _same_home(holders, 100, 200)  # one home: a run of 200 rows, found past the first window
    assert holders.apply(a, [("stored", h) for h in run]) == 200
    assert holders.walk(run, [a, b]) == [200, 0] and holders.table._used == probed_keys(holders) == 200
    assert holders.apply(a, [("removed", h) for h in run[:120]]) == -120  # tombstones in front of the rest
    assert holders.walk(run[120:], [a]) == [80] and holders.walk(run, [a]) == [0]
    assert holders.apply(b, [("stored", h) for h in run[:10]]) == 10  # their own rows again, one by one
    others = _same_home(holders, 100, 105, seed=1)
    assert holders.apply(b, [("stored", h) for h in others[:100]]) == 100  # new hashes in tombstones, in arrays
    assert holders.apply(b, [("stored", h) for h in others[100:]]) == 5  # and one by one
    assert holders.table._used == probed_keys(holders) == 200  # no row taken but tombstones
    assert holders.walk(run[:10] + others, [a, b]) == [0, 115] and holders.walk(run[120:], [a, b]) == [80, 0]
    assert holders.hashes() == set(run[:10] + run[120:] + others)
    more = _same_home(holders, 100, 10, seed=2)
    assert holders.apply(b, [("stored", h) for h in more]) == 10  # the last 5 tombstones, then 5 rows past the run
    assert holders.table._used == probed_keys(holders) == 205


def test_a_batch_finds_tombstones_far_along_a_run():
    holders = BlockHolders()
    a, b = holders.take(0), holders.take(1)
    run = _same_home(holders, 100, 200)
    holders.apply(a, [("stored", h) for h in run])
    holders.apply(a, [("removed", h) for h in run[150:190]])  # tombstones 150 rows along the run only
    rng = random.Random(3)
    elsewhere = [h for h in (rng.getrandbits(64) for _ in range(300))  # homes away from the run, found at once
                 if 400 < holders.table._home(np.array([h], np.uint64), holders.table._capacity)[0] < 900][:70]
    holders.apply(b, [("stored", h) for h in elsewhere])
    used = holders.table._used
    new = _same_home(holders, 100, 10, seed=4)
    # One batch in array passes: 70 hashes found in their first window, 10 new ones whose way is long.
    assert holders.apply(b, [("stored", h) for h in new] + [("removed", h) for h in elsewhere]) == 10 - 70
    assert holders.table._used == probed_keys(holders) == used  # the 10 went into tombstones
    assert holders.walk(tuple(new), [b]) == [10] and holders.hashes() == set(run[:150] + run[190:] + new)


def test_events_one_by_one_go_on_in_the_table_rebuilt_under_them():
    holders = BlockHolders()
    s = holders.take(0)
    capacity = holders.table._capacity
    first = list(range(1, int(capacity * block_table._MAX_LOAD) - 2))
    holders.apply(s, [("stored", h) for h in first])  # in array passes, just under the load that rebuilds
    assert holders.table._capacity == capacity
    last = list(range(10**6, 10**6 + 10))
    events = [("stored", h) for h in last] + [("removed", first[0]), ("removed", last[0])]
    assert holders.apply(s, events) == 8  # one by one: the table grows at the 4th
    assert holders.table._capacity > capacity
    assert holders.hashes() == set(first[1:] + last[1:]) and holders.walk(tuple(last[1:]), [s]) == [9]


def test_spare_rows_running_out_rebuild_larger(monkeypatch):
    monkeypatch.setattr(block_table, "_PAD", 16)
    holders = BlockHolders()
    s = holders.take(0)
    capacity = holders.table._capacity
    tail = _same_home(holders, capacity - 1, 40)  # 40 rows from the last home: past the 16 spare ones
    assert holders.apply(s, [("stored", h) for h in tail]) == 40
    assert holders.table._capacity > capacity
    assert holders.walk(tail, [s]) == [40] and holders.hashes() == set(tail)


def test_many_slots_widen_the_masks_and_a_sweep_comes_before_another_word():
    holders = BlockHolders()
    slots = [holders.take(i) for i in range(130)]
    assert slots == list(range(130)) and holders.words == 3
    chain = [7, 0, TOP]
    for s, n in {0: 1, 63: 1, 64: 2, 129: 3}.items():
        holders.store(s, chain[:n], n)
    assert holders.walk(chain, [0, 63, 64, 129, 128, None]) == [1, 1, 2, 3, 0, 0]
    assert holders.mask(7) == (1 << 0) | (1 << 63) | (1 << 64) | (1 << 129)
    holders.retire(63, ())
    holders.retire(129, ())
    assert holders.mask(0) == (1 << 64) | (1 << 129)  # retired bits linger ...
    assert holders.apply(64, [("removed", 0)]) == -1 and holders.mask(0) == 0  # ... until the block is written
    assert holders.apply(64, [("stored", 0)]) == 1 and holders.mask(0) == 1 << 64
    # Slots up to 2 x 128 + 32 may be made before a sweep; 192 (a fourth word) is not made while some are retired.
    made = [holders.take(128 + i) for i in range(62)]
    assert made == list(range(130, 192)) and holders.words == 3
    assert holders.take(190) == 63 and holders.mask(7) == (1 << 0) | (1 << 64)  # swept, not widened
    assert holders.walk(chain, [63, 129]) == [0, 0]


def test_memory_per_distinct_block():
    holders = BlockHolders()
    slots = [holders.take(i) for i in range(64)]
    gen = np.random.default_rng(5)
    for s in slots:
        hashes = gen.integers(0, 2**64, 5000, dtype=np.uint64, endpoint=False).tolist()
        holders.store(s, hashes, len(hashes))
    assert holders.distinct() == 64 * 5000
    assert holders.nbytes() / holders.distinct() <= (8 + 8) / block_table._REBUILD_LOAD + 1


def test_a_chain_looked_up_again_sees_every_change_since():
    """A request's chain (one tuple) is walked and expected several times: the masks looked up for it are
    kept only while nothing was written."""
    holders = BlockHolders()
    a, b = holders.take(0), holders.take(1)
    chain = tuple(range(1, 301))
    assert holders.walk(chain, [a, b]) == [0, 0] and holders.holds(a, chain) == [False] * 300
    holders.apply(a, [("stored", h) for h in chain[:100]])  # in array passes
    assert holders.walk(chain, [a, b]) == [100, 0]
    holders.apply(a, [("stored", 101)])  # one by one
    assert holders.walk(chain, [a, b]) == [101, 0] and holders.holds(a, chain) == [True] * 101 + [False] * 199
    holders.store(b, chain[:5], 5)
    assert holders.walk(chain, [a, b]) == [101, 5]
    holders.retire(a, ())
    holders.sweep()
    c = holders.take(1)
    assert c == a and holders.walk(chain, [c, b]) == [0, 5] and holders.holds(c, chain[:3]) == [False] * 3
    listed = list(chain)  # (a list may change in place: never remembered)
    assert holders.walk(listed, [b]) == [5]
    listed[0] = 999
    assert holders.walk(listed, [b]) == [0]
