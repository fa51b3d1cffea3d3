"""The schedulers' view of the paged KV cache: admission with reuse, growth block by block (nothing reserved),
caching the blocks a request completes (its prompt, then decode's generated tokens), and the event log routers
read."""

from __future__ import annotations

import pytest

from tests.unit.kv_fixtures import kv_cache
from xpyd.model.kv_blocks import BlockAllocator, PoolFull
from xpyd.prefix_hash import block_hashes, hash_key, salted_seed
from xpyd.worker.kv_cache import KVCache, RequestKV
from xpyd.worker.kv_events import KVEventLog

BS = 4


def test_admit_allocates_what_is_needed_now_and_growth_takes_free_blocks():
    cache = kv_cache(10)
    kv = cache.admit([], num_tokens=5, reuse_tokens=4)
    assert len(kv.blocks) == 2 and cache.allocator.num_referenced == 2 and kv.cached_tokens == 0
    assert cache.admit([], 33, 0) is None and cache.allocator.num_referenced == 2  # 9 blocks: 8 are free
    other = cache.admit([], 32, 0)
    assert other is not None and cache.allocator.num_free == 0
    assert cache.can_grow(kv, 8) and not cache.can_grow(kv, 9)  # its 2 blocks hold 8 tokens; none is free
    with pytest.raises(PoolFull):
        cache.grow(kv, 9)
    assert len(kv.blocks) == 2 and cache.allocator.num_referenced == 10  # nothing taken
    cache.free(other)
    cache.grow(kv, 9)
    assert len(kv.blocks) == 3
    cache.grow(kv, 9)  # nothing more needed
    assert len(kv.blocks) == 3
    cache.free(kv)
    assert cache.allocator.num_referenced == 0
    assert cache.fits(40) and not cache.fits(41)  # the whole pool: 10 blocks of 4


def test_a_cached_prefix_is_reused_up_to_the_limit_and_only_whole_blocks():
    cache = kv_cache(12)
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks and 3 more
    hashes = cache.hashes(prompt)
    assert hashes == block_hashes(prompt, BS, cache.seed) and len(hashes) == 2
    first = cache.admit(hashes, 11, reuse_tokens=10)
    assert first.cached_tokens == 0 and cache.hit_tokens == 0 and cache.query_tokens == 11
    cache.prompt_done(first, 11, prompt[8:])
    assert [cache.allocator.hash_of(b) for b in first.blocks] == [*hashes, None]
    second = cache.admit(hashes, 11, reuse_tokens=10)
    assert second.blocks[:2] == first.blocks[:2] and second.blocks[2] != first.blocks[2]
    assert second.cached_tokens == 8 and cache.hit_tokens == 8
    assert [cache.allocator.ref(b) for b in second.blocks] == [2, 2, 1]
    # prefill computes at least the last token: an 8-token prompt (2 full blocks) reuses only the first
    third = cache.admit(hashes, 8, reuse_tokens=7)
    assert third.cached_tokens == 4 and third.blocks[0] == first.blocks[0] and third.blocks[1] != first.blocks[1]
    for kv in (first, second, third):
        cache.free(kv)
    assert cache.allocator.num_referenced == 0 and cache.allocator.num_cached == 2  # kept for the next one
    cache.allocator.check()


def test_hits_that_sit_on_the_free_list_count_against_admission():
    cache = kv_cache(3)
    prompt = list(range(8))
    kv = cache.admit(cache.hashes(prompt), 8, 8)
    cache.prompt_done(kv, 8, [])
    cache.free(kv)  # both blocks cached, unreferenced: they are the pool's free blocks too
    assert cache.allocator.num_free == 3
    # reusing both and two more blocks needs 4 of 3
    assert cache.admit(cache.hashes(prompt), 16, 8) is None
    fits = cache.admit(cache.hashes(prompt), 12, 8)
    assert fits is not None and fits.cached_tokens == 8 and cache.allocator.num_free == 0
    cache.free(fits)


def test_decode_extends_the_chain_over_generated_tokens():
    cache = kv_cache(8)
    prompt = list(range(50, 56))  # 1 full block + 2
    kv = cache.admit(cache.hashes(prompt), 6, 6)
    cache.prompt_done(kv, 6, prompt[4:])
    generated = [7, 8, 9, 10, 11, 12]
    for i, token in enumerate(generated):  # token i is fed at position 6 + i
        cache.grow(kv, 6 + i + 1)
        cache.append_tokens(kv, (token,))
    # blocks 1 (positions 4-7) and 2 (8-11) filled: named as if the whole sequence had been a prompt
    assert kv.hashes == block_hashes(prompt + generated, BS, cache.seed)
    assert [cache.allocator.hash_of(b) for b in kv.blocks] == kv.hashes and len(kv.hashes) == 3
    cache.free(kv)
    follow_up = prompt + generated + [99]
    again = cache.admit(cache.hashes(follow_up), 13, 13)
    assert again.cached_tokens == 12  # a follow-up turn finds the generated blocks too
    cache.free(again)


def _keyed_cache(num_blocks: int) -> KVCache:
    return KVCache(BlockAllocator(num_blocks), BS, seed=5, key=hash_key("a-cluster-token"))


def _run(cache: KVCache, prompt: list[int], generated: list[int], salt: str | None) -> RequestKV:
    """A decode-shaped lifecycle: the prompt's chain named elsewhere (``chain``), then generated tokens."""
    named = block_hashes(prompt, BS, salted_seed(cache.seed, salt, cache.key), key=cache.key)
    kv = cache.admit(cache.chain(named, salt), len(prompt), len(prompt))
    cache.prompt_done(kv, len(prompt), prompt[len(named) * BS:])
    for i, token in enumerate(generated):
        cache.grow(kv, len(prompt) + i + 1)
        cache.append_tokens(kv, (token,))
    return kv


@pytest.mark.parametrize("prompt_len", [2, 6])  # shorter than a block (generated blocks only) / one and a half
def test_a_cache_salt_keys_prompt_and_generated_blocks(prompt_len):
    cache = _keyed_cache(16)
    prompt, generated = list(range(50, 50 + prompt_len)), [7, 8, 9, 10, 11, 12, 13, 14]
    whole = prompt + generated
    salted = _run(cache, prompt, generated, "alice")
    assert salted.hashes == block_hashes(whole, BS, salted_seed(cache.seed, "alice", cache.key), key=cache.key)
    assert salted.hashes == cache.hashes(whole, "alice")[: len(salted.hashes)]
    cache.free(salted)
    for salt in (None, "bob"):  # another salt, or none: nothing of alice's is found
        other = cache.admit(cache.hashes(whole, salt), len(whole), len(whole))
        assert other.cached_tokens == 0 and not set(other.hashes) & set(salted.hashes)
        cache.free(other)
    same = cache.admit(cache.hashes(whole, "alice"), len(whole), len(whole))
    assert same.cached_tokens == (len(whole) // BS) * BS  # the same salt shares, generated blocks too
    cache.free(same)


def test_hashes_are_keyed_with_the_deployments_key():
    cache = _keyed_cache(4)
    ids = list(range(12))
    assert list(cache.hashes(ids)) == block_hashes(ids, BS, 5, key=hash_key("a-cluster-token"))
    assert not set(cache.hashes(ids)) & set(block_hashes(ids, BS, 5))
    assert cache.hashes(ids).root == 5 and cache.hashes(ids, "s").root == salted_seed(5, "s", cache.key)


def test_caching_off_reuses_nothing_and_records_nothing():
    cache = kv_cache(6, caching=False)
    prompt = list(range(12))
    assert cache.hashes(prompt) == block_hashes(prompt, BS, cache.seed)  # still named: decode's cache may be on
    for _ in range(2):
        kv = cache.admit(cache.hashes(prompt), 12, 11)
        assert kv.cached_tokens == 0
        cache.prompt_done(kv, 12, [])
        cache.append_tokens(kv, [1, 2, 3, 4])
        cache.free(kv)
    assert cache.allocator.num_cached == 0 and cache.hit_tokens == 0 and cache.query_tokens == 0


def test_event_log_serves_events_after_a_cursor_or_a_snapshot():
    log = KVEventLog(max_events=4)
    first = log.since(None, None)
    assert first == {"epoch": log.epoch, "seq": 0, "snapshot": []}
    log.record([11, 12], [])
    assert log.since(log.epoch, 0) == {"epoch": log.epoch, "seq": 2, "events": [["stored", 11], ["stored", 12]]}
    log.record([13], [11])
    assert log.since(log.epoch, 2) == {"epoch": log.epoch, "seq": 4, "events": [["removed", 11], ["stored", 13]]}
    assert log.since(log.epoch, 4)["events"] == []
    log.record([14, 15], [])  # the log keeps 4 events: a reader at 0 fell behind
    assert log.since(log.epoch, 0) == {"epoch": log.epoch, "seq": 6, "snapshot": [12, 13, 14, 15]}
    assert log.since("another-process", 6)["snapshot"] == [12, 13, 14, 15]
    assert log.since(log.epoch, 99)["snapshot"] == [12, 13, 14, 15]  # a cursor from the future: resync
    assert log.since(log.epoch, 2)["events"] == [["removed", 11], ["stored", 13], ["stored", 14], ["stored", 15]]
    assert log.num_cached == 4


def test_random_lifecycles_never_leak_overcommit_or_free_a_referenced_block():
    """Requests arrive (sharing prefixes from a small set), grow token by token while blocks are free,
    finish (their blocks cached) or abort, in random order, in a pool that must evict; at every step every
    held block is referenced at least by its holders and each request holds the blocks of its tokens, and at
    the end nothing is referenced."""
    import random

    for seed in range(5):
        rng = random.Random(seed)
        cache = kv_cache(40)
        stems = [[rng.randrange(1000) for _ in range(rng.randint(4, 14))] for _ in range(4)]
        live: list[tuple] = []  # (kv, tokens so far, final length)
        admitted = refused = 0
        for _ in range(600):
            op = rng.random()
            if op < 0.35:
                prompt = rng.choice(stems) + [rng.randrange(1000) for _ in range(rng.randint(1, 9))]
                final = len(prompt) + rng.randint(1, 12)
                kv = cache.admit(cache.hashes(prompt), len(prompt), len(prompt) - 1)
                if kv is None:
                    refused += 1
                    continue
                admitted += 1
                cache.prompt_done(kv, len(prompt), prompt[len(kv.hashes) * BS:])
                live.append((kv, list(prompt), final))
            elif op < 0.8 and live:
                kv, tokens, final = rng.choice(live)
                if len(tokens) < final and cache.can_grow(kv, len(tokens) + 1):
                    cache.grow(kv, len(tokens) + 1)
                    tokens.append(rng.randrange(1000))
                    cache.append_tokens(kv, tokens[-1:])
            elif live:
                entry = live.pop(rng.randrange(len(live)))
                cache.free(entry[0])
            cache.allocator.check()
            held = [b for kv, _, _ in live for b in kv.blocks]
            assert all(cache.allocator.ref(b) >= held.count(b) for b in set(held))
            for kv, tokens, final in live:
                assert len(kv.blocks) == cache.blocks_for(len(tokens))
        for kv, _, _ in live:
            cache.free(kv)
        assert cache.allocator.num_referenced == 0
        assert admitted > 50 and refused > 0 and cache.hit_tokens > 0, (admitted, refused, cache.hit_tokens)
        cache.allocator.check()
