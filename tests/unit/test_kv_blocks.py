"""BlockAllocator: lifecycles with exact states, then seeded random runs against a model of the requests.

Every test ends with no block referenced.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from xpyd.model.kv_blocks import AllocatorCorrupt, BlockAllocator, PoolFull


def refs(a: BlockAllocator) -> list[int]:
    return [a.ref(b) for b in range(a.num_blocks)]


def hashes(a: BlockAllocator) -> list[int | None]:
    return [a.hash_of(b) for b in range(a.num_blocks)]


def counts(a: BlockAllocator) -> tuple[int, int, int, int]:
    return a.num_free, a.num_referenced, a.num_cached, a.num_evictable


def ended(a: BlockAllocator) -> None:
    a.check()
    assert a.num_referenced == 0 and a.num_free == a.num_blocks


def test_allocate_and_release_plain_blocks():
    a = BlockAllocator(4)
    assert (a.num_blocks, a.caching) == (4, True)
    assert counts(a) == (4, 0, 0, 0)
    assert a.allocate(0) == []
    blocks = a.allocate(3)
    assert blocks == [0, 1, 2]
    assert refs(a) == [1, 1, 1, 0] and hashes(a) == [None] * 4
    assert counts(a) == (1, 3, 0, 0)
    assert a.can_allocate(1) and not a.can_allocate(2)
    a.check()
    a.release(blocks)
    assert refs(a) == [0] * 4 and counts(a) == (4, 0, 0, 0)
    assert a.take_events() == ([], [])  # nothing was cached
    assert a.allocate(1) == [0]  # the most recently freed block first
    a.release([0])
    ended(a)


def test_commit_match_and_reuse():
    a = BlockAllocator(5)
    first = a.allocate(3)  # two full blocks and a partial one
    assert a.commit(first[0], 100) and a.commit(first[1], 101)
    assert a.commit(first[1], 101)  # committing again is a no-op that still says "cached"
    assert a.take_events() == ([100, 101], [])
    assert hashes(a) == [100, 101, None, None, None]
    assert a.match([100, 101, 102]) == [0, 1]
    assert a.match([999, 100]) == []  # a prefix: the first miss ends it
    assert a.match([]) == []
    assert refs(a) == [1, 1, 1, 0, 0]  # match takes no reference

    a.release(first)
    assert refs(a) == [0] * 5
    assert counts(a) == (5, 0, 2, 2)  # the cached pair is evictable, the partial block plainly free

    second = a.match([100, 101, 777])
    assert second == [0, 1]
    a.acquire(second)
    assert refs(a) == [1, 1, 0, 0, 0] and counts(a) == (3, 2, 2, 0)
    second += a.allocate(2)  # plain free blocks, the cache is left alone
    assert second == [0, 1, 2, 3]
    assert hashes(a)[:2] == [100, 101] and a.take_events() == ([], [])

    third = a.match([100])  # a third request shares the head
    a.acquire(third)
    assert refs(a) == [2, 1, 1, 1, 0]
    a.release(second)
    assert refs(a) == [1, 0, 0, 0, 0] and counts(a) == (4, 1, 2, 1)
    a.release(third)
    assert counts(a) == (5, 0, 2, 2)
    ended(a)


def test_duplicate_commit_keeps_the_first_block():
    a = BlockAllocator(3)
    (x,), (y,) = a.allocate(1), a.allocate(1)  # two requests computed the same block at once
    assert a.commit(x, 7) is True
    assert a.commit(y, 7) is False
    assert hashes(a) == [7, None, None] and a.match([7]) == [x]
    assert a.take_events() == ([7], [])
    a.release([y])  # freed plainly: it names nothing
    assert counts(a) == (2, 1, 1, 0)
    with pytest.raises(ValueError, match="already cached under hash"):
        a.commit(x, 8)
    a.release([x])
    assert counts(a) == (3, 0, 1, 1)
    with pytest.raises(ValueError, match="not referenced"):
        a.commit(x, 7)  # an evictable block is nobody's to commit
    with pytest.raises(ValueError, match="not referenced"):
        a.commit(y, 9)
    (z,) = a.allocate(1)
    for bad in (-1, 2**64, 1.0, True, None):
        with pytest.raises(ValueError, match=r"\[0, 2\*\*64\)"):
            a.commit(z, bad)
    assert a.hash_of(z) is None and a.take_events() == ([], [])
    a.release([z])
    ended(a)


def test_lru_tail_first_within_a_release_oldest_release_first_across():
    a = BlockAllocator(6)
    first, second = a.allocate(3), a.allocate(3)
    for i, b in enumerate(first):
        a.commit(b, 10 + i)
    for i, b in enumerate(second):
        a.commit(b, 20 + i)
    a.take_events()
    a.release(first)  # evictable, oldest first: 2 1 0
    a.release(second)  # then 5 4 3
    assert counts(a) == (6, 0, 6, 6)
    assert a.match([10, 11, 12]) == [0, 1, 2]  # match does not refresh anything

    assert a.allocate(1) == [2]  # the tail of the least recently released prompt
    assert a.take_events() == ([], [12])
    assert a.match([10, 11, 12]) == [0, 1]
    assert a.allocate(2) == [1, 0]
    assert a.take_events() == ([], [11, 10])
    assert a.match([10]) == [] and a.match([20, 21, 22]) == [3, 4, 5]
    assert a.allocate(1) == [5]
    a.release([2, 1, 0, 5])
    ended(a)


def test_reacquire_makes_a_block_most_recently_released():
    a = BlockAllocator(4)
    blocks = a.allocate(4)
    for b in blocks:
        a.commit(b, 40 + b)
    a.release(blocks)  # evictable: 3 2 1 0
    a.acquire([3])
    assert a.num_evictable == 3
    a.release([3])  # now 2 1 0 3
    assert a.allocate(3) == [2, 1, 0]
    assert a.match([43]) == [3]
    a.release([2, 1, 0])
    ended(a)


def test_eviction_takes_only_unreferenced_blocks():
    a = BlockAllocator(4)
    held, done = a.allocate(2), a.allocate(2)
    for i, b in enumerate(held + done):
        a.commit(b, 50 + i)
    a.release(done)
    a.take_events()
    assert counts(a) == (2, 2, 4, 2)
    assert a.allocate(2) == [3, 2]
    assert a.take_events() == ([], [53, 52])
    assert refs(a) == [1, 1, 1, 1] and hashes(a) == [50, 51, None, None]
    assert not a.can_allocate(1)
    with pytest.raises(PoolFull):
        a.allocate(1)
    assert a.match([50, 51]) == held and refs(a) == [1, 1, 1, 1]
    a.release(held + [3, 2])
    ended(a)


def test_pool_full_changes_nothing():
    a = BlockAllocator(5)
    cached = a.allocate(3)
    for i, b in enumerate(cached):
        a.commit(b, 60 + i)
    a.release(cached[1:])  # evictable: 2 1
    held = a.allocate(1) + cached[:1]  # block 3 plain, block 0 cached
    assert a.num_free == 3  # block 4 plain, blocks 1 and 2 evictable
    before = (refs(a), hashes(a), counts(a), a.take_events())
    with pytest.raises(PoolFull, match="4 KV blocks needed, 3 of 5 free"):
        a.allocate(4)
    assert (refs(a), hashes(a), counts(a), a.take_events()) == (before[0], before[1], before[2], ([], []))
    assert a.allocate(3) == [4, 2, 1]  # the LRU order survived too
    a.release(held + [4, 2, 1])
    ended(a)


def test_double_release_and_foreign_ids_change_nothing():
    a = BlockAllocator(3)
    x, y = a.allocate(2)
    a.commit(x, 1)
    a.release([y])
    with pytest.raises(ValueError, match="double release"):
        a.release([y])
    with pytest.raises(ValueError, match="double release"):
        a.release([x, x])  # duplicates count twice: x has one reference
    with pytest.raises(ValueError, match="double release"):
        a.release([x, y])
    assert refs(a) == [1, 0, 0]
    for bad in (3, -1, 1.0, True, "0", None):
        with pytest.raises(ValueError, match="does not exist"):
            a.release([x, bad])
        with pytest.raises(ValueError, match="does not exist"):
            a.acquire([x, bad])
        with pytest.raises(ValueError, match="does not exist"):
            a.ref(bad)
        with pytest.raises(ValueError, match="does not exist"):
            a.hash_of(bad)
        with pytest.raises(ValueError, match="does not exist"):
            a.commit(bad, 5)
    with pytest.raises(ValueError, match="is free"):
        a.acquire([x, y])  # y is neither referenced nor cached
    assert refs(a) == [1, 0, 0] and counts(a) == (2, 1, 1, 0)
    a.acquire([x, x])  # duplicates count twice
    assert a.ref(x) == 3
    a.release([x, x])
    assert a.ref(x) == 1
    a.release([x])
    ended(a)


def test_caching_off():
    a = BlockAllocator(3, caching=False)
    assert a.caching is False
    blocks = a.allocate(2)
    assert a.commit(blocks[0], 5) is False
    assert a.hash_of(blocks[0]) is None and a.match([5]) == []
    a.release(blocks)
    assert counts(a) == (3, 0, 0, 0) and a.take_events() == ([], []) and a.clear_cache() == 0
    with pytest.raises(ValueError, match="is free"):
        a.acquire([blocks[0]])
    with pytest.raises(ValueError, match="not referenced"):
        a.commit(blocks[0], 5)
    ended(a)


def test_clear_cache_drops_only_unreferenced_blocks():
    a = BlockAllocator(4)
    blocks = a.allocate(3)
    for i, b in enumerate(blocks):
        a.commit(b, 70 + i)
    a.release(blocks[1:])
    a.take_events()
    assert a.clear_cache() == 2
    assert a.take_events() == ([], [72, 71])
    assert hashes(a) == [70, None, None, None] and counts(a) == (3, 1, 1, 0)
    assert a.match([70, 71]) == [0]
    assert a.clear_cache() == 0
    a.release(blocks[:1])
    assert a.clear_cache() == 1
    ended(a)


def test_events_are_net_changes():
    a = BlockAllocator(1)
    (b,) = a.allocate(1)
    a.commit(b, 1)
    a.release([b])
    assert a.allocate(1) == [b]  # evicts hash 1, which was stored since the last take: no event at all
    assert a.take_events() == ([], [])
    a.commit(b, 1)
    a.release([b])
    assert a.take_events() == ([1], [])
    a.allocate(1)
    a.commit(b, 1)  # removed, then stored again: the published cache is still right
    assert a.take_events() == ([], [])
    a.allocate(0)
    a.release([b])
    a.allocate(1)
    a.commit(b, 2)
    assert a.take_events() == ([2], [1])
    a.release([b])
    ended(a)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4", None])
def test_bad_sizes(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(bad)


@pytest.mark.parametrize("bad", [-1, 1.0, True, None])
def test_bad_counts(bad):
    a = BlockAllocator(2)
    with pytest.raises(ValueError, match="block count"):
        a.allocate(bad)
    with pytest.raises(ValueError, match="block count"):
        a.can_allocate(bad)
    ended(a)


def _evictable_with_hash(a: BlockAllocator) -> int:
    (b,) = a.allocate(1)
    a.commit(b, 99)
    a.release([b])
    return b


@pytest.mark.parametrize("corrupt", [
    lambda a, b: a._free.append(b),  # free and evictable at once
    lambda a, b: a._evictable.pop(b),  # leaked: ref 0 but nowhere
    lambda a, b: a._ref.__setitem__(b, 1),  # referenced and evictable
    lambda a, b: a._cached.__setitem__(98, b),  # a second hash for a block
    lambda a, b: a._hash.__setitem__(b, None),  # evictable without a hash
    lambda a, b: a._free.append(a._free[-1]),  # on the free list twice
])
def test_check_finds_corruption(corrupt):
    a = BlockAllocator(3)
    b = _evictable_with_hash(a)
    a.check()
    corrupt(a, b)
    with pytest.raises(AllocatorCorrupt):
        a.check()
    assert issubclass(AllocatorCorrupt, ValueError)


# --- seeded random runs -------------------------------------------------------------------------------

NUM_BLOCKS = 24
PREFIXES = 3  # shared prompt heads (a system prompt, a few documents)
PREFIX_BLOCKS = 6


class Model:
    """What the live requests hold, and the cache as its published events describe it."""

    def __init__(self, rng: random.Random, a: BlockAllocator) -> None:
        self.rng, self.a = rng, a
        self.live: dict[int, tuple[list[int], list[int]]] = {}  # request -> (blocks, hashes of its full blocks)
        self.next_id = 0
        self.next_hash = 1000
        self.published: set[int] = set()
        self.seen = Counter()  # what the run exercised

    def chain(self) -> tuple[list[int], bool]:
        """The hashes of a new request's full blocks, and whether a partial block follows them."""
        rng = self.rng
        head = rng.randrange(PREFIX_BLOCKS + 1)
        prefix = rng.randrange(PREFIXES)
        hashes = [prefix * 100 + i for i in range(head)]  # chained: equal hashes mean equal heads
        for _ in range(rng.randrange(4)):
            hashes.append(self.next_hash)
            self.next_hash += 1
        return hashes, rng.random() < 0.5

    def arrive(self) -> None:
        a = self.a
        hashes, partial = self.chain()
        held = self.held()
        hits = a.match(hashes)
        assert [a.hash_of(b) for b in hits] == hashes[:len(hits)]
        if len(hits) < len(hashes):  # the longest prefix: the next hash is not cached
            assert a.match([hashes[len(hits)]]) == []
        a.acquire(hits)
        need = len(hashes) + partial - len(hits)
        fits = a.can_allocate(need)
        cached = a.num_cached
        try:
            new = a.allocate(need)
        except PoolFull:
            assert not fits and a.num_cached == cached
            a.release(hits)
            self.seen["pool full"] += 1
            return
        assert fits
        self.seen["hit blocks"] += len(hits)
        self.seen["evicted"] += cached - a.num_cached
        assert not held & set(new), "allocate handed out a referenced block"
        assert all(a.ref(b) == 1 and a.hash_of(b) is None for b in new)
        self.live[self.next_id] = (hits + new, hashes)
        self.next_id += 1

    def end(self, commit: bool) -> None:
        a = self.a
        rid = self.rng.choice(sorted(self.live))
        blocks, hashes = self.live.pop(rid)
        if commit:
            for b, h in zip(blocks, hashes):
                other = a.match([h])
                stored = a.commit(b, h)
                assert stored == (other in ([], [b]))
                assert a.match([h]) == ([b] if stored else other)
                self.seen["duplicate commits"] += not stored
        a.release(blocks)

    def clear_cache(self) -> None:
        evictable = self.a.num_evictable
        assert self.a.clear_cache() == evictable
        assert self.a.num_evictable == 0

    def take_events(self) -> None:
        stored, removed = self.a.take_events()
        assert not set(stored) & set(removed)
        assert not set(stored) & self.published and set(removed) <= self.published
        self.published = (self.published | set(stored)) - set(removed)
        assert len(self.published) == self.a.num_cached
        for h in self.published:
            assert self.a.match([h]) != []

    def held(self) -> set[int]:
        return {b for blocks, _ in self.live.values() for b in blocks}

    def verify(self) -> None:
        a = self.a
        a.check()
        model_refs = Counter(b for blocks, _ in self.live.values() for b in blocks)
        assert refs(a) == [model_refs[b] for b in range(NUM_BLOCKS)]
        assert a.num_referenced == len(model_refs)
        assert a.num_referenced + a.num_free == NUM_BLOCKS


@pytest.mark.parametrize("seed", range(5))
def test_random_lifecycles(seed):
    rng = random.Random(seed)
    a = BlockAllocator(NUM_BLOCKS)
    m = Model(rng, a)
    ops = Counter()
    for _ in range(3000):
        r = rng.random()
        if r < 0.45 or not m.live:
            op = "arrive"
            m.arrive()
        elif r < 0.75:
            op = "finish"
            m.end(commit=True)
        elif r < 0.88:
            op = "abort"
            m.end(commit=False)
        elif r < 0.90:
            op = "clear_cache"
            m.clear_cache()
        else:
            op = "take_events"
            m.take_events()
        ops[op] += 1
        m.verify()
    while m.live:
        m.end(commit=rng.random() < 0.5)
        m.verify()
    m.take_events()
    ended(a)
    # the run did what it is for: sharing, eviction, a full pool, duplicate commits
    assert ops["arrive"] > 1000 and ops["clear_cache"] > 20 and m.next_id > 500
    assert min(m.seen[k] for k in ("pool full", "hit blocks", "evicted", "duplicate commits")) > 20, m.seen
