"""The proxy's index of who caches what: KV events and snapshots, expectations, longest-prefix matches."""

from __future__ import annotations

import json

import pytest

from xpyd.discovery.types import Role, WorkerInfo
from xpyd.model.kv_blocks import BlockAllocator
from xpyd.prefix_hash import block_hashes, hash_key, salted_seed
from xpyd.proxy.prefix_index import Cursor, KVUpdate, PrefixIndex, PromptKeys
from xpyd.worker.kv_cache import KVCache
from xpyd.worker.kv_events import KVEventLog


def worker(i: int, role: Role = Role.PREFILL) -> WorkerInfo:
    return WorkerInfo(role, f"http://10.0.0.{i}:8000", f"10.0.0.{i}:9000", "m", 1, 4)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def update(body: dict) -> KVUpdate:
    return KVUpdate.from_json(json.dumps(body))


def feed(index: PrefixIndex, w: WorkerInfo, body: dict) -> bool:
    """One poll's answer, applied as the feed does: with the entry the poll started from."""
    return index.apply(w, index.entry(w), update(body))


CHAIN = [11, 12, 13, 14]  # one request's block hashes, in order
BIG = 2**64 - 1


# ------------------------------------------------------------------ the wire


def test_updates_parse_events_and_snapshots():
    u = update({"epoch": "ab12", "seq": 7, "events": [["stored", 5], ["removed", BIG], ["stored", 0]]})
    assert (u.epoch, u.seq, u.events, u.snapshot) == ("ab12", 7, (("stored", 5), ("removed", BIG), ("stored", 0)),
                                                      None)
    u = update({"epoch": "ab12", "seq": 9, "snapshot": [1, 2, 2, BIG], "more": "ignored"})
    assert u.snapshot == {1, 2, BIG} and u.events is None
    assert update({"epoch": "e", "seq": 0, "events": []}).events == ()


@pytest.mark.parametrize("body", [
    {"seq": 1, "events": []},  # no epoch
    {"epoch": "", "seq": 1, "events": []},
    {"epoch": "e" * 65, "seq": 1, "events": []},
    {"epoch": "e", "seq": -1, "events": []},
    {"epoch": "e", "seq": True, "events": []},
    {"epoch": "e", "seq": 1},  # neither events nor a snapshot
    {"epoch": "e", "seq": 1, "events": [], "snapshot": []},  # both
    {"epoch": "e", "seq": 1, "events": [["stored", 2**64]]},
    {"epoch": "e", "seq": 1, "events": [["stored", -1]]},
    {"epoch": "e", "seq": 1, "events": [["stored", 1.0]]},
    {"epoch": "e", "seq": 1, "events": [["stored", True]]},
    {"epoch": "e", "seq": 1, "events": [["evicted", 1]]},
    {"epoch": "e", "seq": 1, "events": [["stored", 1, 2]]},
    {"epoch": "e", "seq": 1, "events": [[["stored"], 1]]},
    {"epoch": "e", "seq": 1, "events": {"stored": 1}},
    {"epoch": "e", "seq": 1, "snapshot": [1, "2"]},
    {"epoch": "e", "seq": 1, "snapshot": [1, 2**64]},
    {"epoch": "e", "seq": 1, "snapshot": {"1": 1}},
    [1, 2],
])
def test_malformed_updates_are_refused(body):
    with pytest.raises(ValueError):
        update(body)
    with pytest.raises(ValueError):
        KVUpdate.from_json(b"\xff not json")


# ------------------------------------------------------------------ events and snapshots


def test_snapshot_then_events_then_eviction():
    index, w = PrefixIndex(), worker(1)
    assert index.blocks(w) is None and index.match(w, CHAIN) == 0  # nothing heard yet
    assert index.entry(w).cursor is None  # its first poll asks for a snapshot
    assert feed(index, w, {"epoch": "e1", "seq": 3, "snapshot": [11, 12, 99]})
    assert index.entry(w).cursor == Cursor("e1", 3)
    assert index.blocks(w) == 3 and index.match(w, CHAIN) == 2
    assert feed(index, w, {"epoch": "e1", "seq": 5, "events": [["stored", 13], ["stored", 14]]})
    assert index.match(w, CHAIN) == 4 and index.entry(w).cursor == Cursor("e1", 5)
    assert feed(index, w, {"epoch": "e1", "seq": 5, "events": []})  # nothing new
    # The worker evicts a block in the middle: only the prefix in front of it is still a hit.
    assert feed(index, w, {"epoch": "e1", "seq": 6, "events": [["removed", 13]]})
    assert index.match(w, CHAIN) == 2 and index.blocks(w) == 4
    # Stored and removed again within one answer: applied in order.
    assert feed(index, w, {"epoch": "e1", "seq": 8, "events": [["stored", 13], ["removed", 11]]})
    assert index.match(w, CHAIN) == 0 and index.match(w, CHAIN[1:]) == 3


def test_a_restarted_worker_is_resynced_by_a_snapshot():
    index, w = PrefixIndex(), worker(1)
    feed(index, w, {"epoch": "e1", "seq": 10, "snapshot": CHAIN})
    # The worker restarted (a new epoch) and its events fell behind: it answers with a snapshot.
    assert feed(index, w, {"epoch": "e2", "seq": 2, "snapshot": [11]})
    assert index.match(w, CHAIN) == 1 and index.entry(w).cursor == Cursor("e2", 2)


@pytest.mark.parametrize("body", [
    {"epoch": "other", "seq": 11, "events": [["stored", 99]]},  # events of another life of its cache
    {"epoch": "e1", "seq": 9, "events": []},  # going back
])
def test_events_that_do_not_follow_on_ask_for_a_snapshot(body):
    index, w = PrefixIndex(), worker(1)
    feed(index, w, {"epoch": "e1", "seq": 10, "snapshot": CHAIN})
    assert not feed(index, w, body)
    assert index.entry(w).cursor is None and index.match(w, CHAIN) == 0
    assert not feed(index, worker(2), {"epoch": "e1", "seq": 1, "events": [["stored", 11]]})  # before any snapshot


def test_reset_keeps_the_blocks_until_the_snapshot():
    index, w = PrefixIndex(), worker(1)
    feed(index, w, {"epoch": "e1", "seq": 10, "snapshot": CHAIN})
    index.reset(w)  # e.g. a malformed answer: the next poll asks for everything
    assert index.entry(w).cursor is None and index.match(w, CHAIN) == 4
    feed(index, w, {"epoch": "e1", "seq": 12, "snapshot": [11]})
    assert index.match(w, CHAIN) == 1


# ------------------------------------------------------------------ workers leaving


def test_down_or_departed_workers_are_dropped_and_late_answers_ignored():
    index = PrefixIndex()
    a, b, c = worker(1), worker(2), worker(3, Role.DECODE)
    for w in (a, b, c):
        feed(index, w, {"epoch": "e", "seq": 1, "snapshot": CHAIN})
    entry = index.entry(a)  # a poll of a is in flight ...
    index.drop(a)  # ... when a is marked down
    assert not index.apply(a, entry, update({"epoch": "e", "seq": 2, "events": [["stored", 15]]}))
    assert index.get(a) is None and index.match(a, CHAIN) == 0
    index.retain([c])  # b left the registry
    assert index.get(b) is None and index.match(c, CHAIN) == 4
    # Same URL, other role: another worker.
    assert index.match(WorkerInfo(Role.PREFILL, c.http_url, c.signal_addr, "m", 1, 4), CHAIN) == 0


# ------------------------------------------------------------------ expectations


def test_routed_blocks_count_until_confirmed_or_expired():
    clock = Clock()
    index, w = PrefixIndex(expect_seconds=10, clock=clock), worker(1)
    index.expect(w, CHAIN)  # the proxy just sent it a request with these blocks
    assert index.match(w, CHAIN) == 4 and index.blocks(w) is None  # expected, not reported
    feed(index, w, {"epoch": "e", "seq": 1, "snapshot": [11, 12]})
    clock.now += 5
    feed(index, w, {"epoch": "e", "seq": 2, "events": [["stored", 13]]})  # confirmed; 14 still on its way
    assert index.match(w, CHAIN) == 4
    clock.now += 5  # 14 never came (the request failed, or the worker did not keep it): no longer counted
    assert index.match(w, CHAIN) == 3
    index.expect(w, [99])  # lapsed expectations are dropped as new ones come (a worker may never confirm any)
    assert list(index.entry(w).expected) == [99]
    index.expect(w, [98, 99])  # the latest last: it lapses last
    assert list(index.entry(w).expected) == [98, 99]
    # Eviction reported after the proxy expected the block again: the report wins.
    index.expect(w, [11, 12, 13, 14])
    feed(index, w, {"epoch": "e", "seq": 3, "events": [["removed", 12]]})
    assert index.match(w, CHAIN) == 1


def test_keys_count_the_partial_last_block():
    assert PromptKeys(num_tokens=33, block_size=16, hashes=(1, 2)).num_blocks == 3
    assert PromptKeys(num_tokens=32, block_size=16, hashes=(1, 2)).num_blocks == 2
    assert PromptKeys(num_tokens=5, block_size=16, hashes=()).num_blocks == 1


def test_a_salted_cache_matches_only_requests_with_its_salt():
    """A keyed worker cache stores a request with cache_salt "alice"; its events reach the index; the index
    matches the proxy's names of the same prompt with that salt (every block) and with another salt or none
    (no block)."""
    key = hash_key("a-cluster-token")
    cache = KVCache(BlockAllocator(16), 4, seed=9, key=key)
    events = KVEventLog()
    ids = list(range(100, 118))  # 4 full blocks + 2
    kv = cache.admit(cache.hashes(ids, "alice"), len(ids), len(ids))
    cache.prompt_done(kv, len(ids), ids[16:])
    events.record(*cache.allocator.take_events())
    index, w = PrefixIndex(), worker(1)
    assert feed(index, w, events.since(None, None))

    def keys(salt: str | None) -> PromptKeys:  # as PromptTokenizer.keys names them
        return PromptKeys(len(ids), 4, tuple(block_hashes(ids, 4, salted_seed(9, salt, key), key=key)))

    assert index.match(w, keys("alice").hashes) == 4
    assert index.match(w, keys("bob").hashes) == index.match(w, keys(None).hashes) == 0
