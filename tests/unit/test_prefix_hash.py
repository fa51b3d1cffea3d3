"""prefix_hash: the construction (recomputed with hashlib), chaining, continuation, seeds, errors."""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
from array import array
import hashlib
import hmac
from hashlib import blake2b

import pytest

from xpyd.prefix_hash import block_hashes, hash_key, hash_seed, salted_seed

SEED = hash_seed("HuggingFaceTB/SmolLM2-135M-Instruct", "paged/1")


def H(parent: int, tokens: list[int]) -> int:
    """The block hash written out from its definition."""
    data = parent.to_bytes(8, "little") + struct.pack(f"<{len(tokens)}I", *tokens)
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "little")


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2**32) for _ in range(n)]


def test_the_construction():
    def part(tag: bytes, data: bytes) -> bytes:
        return tag + len(data).to_bytes(8, "little") + data

    seed = blake2b(part(b"s", b"HuggingFaceTB/SmolLM2-135M-Instruct") + part(b"s", b"paged/1"),
                   digest_size=8, person=b"xpyd-kv-seed/1").digest()
    assert SEED == int.from_bytes(seed, "little") == 0xE8D92500F0B90AF4  # pinned: the same on every machine
    h0 = H(SEED, [0, 1, 2, 3])
    h1 = H(h0, [4, 5, 6, 7])
    assert block_hashes(list(range(10)), 4, SEED) == [h0, h1] == [0x555634646D572F4B, 0x124A4884F576135E]
    assert hash_seed(7) == int.from_bytes(blake2b(part(b"i", b"7"), digest_size=8,
                                                  person=b"xpyd-kv-seed/1").digest(), "little")


def test_same_in_another_process():
    code = ("from xpyd.prefix_hash import block_hashes, hash_seed;"
            "print(block_hashes(list(range(64)), 16, hash_seed('m', 3)))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # Python's own hash() would differ
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         timeout=60).stdout
    assert out.strip() == str(block_hashes(list(range(64)), 16, hash_seed("m", 3)))


def test_hashes_are_64_bit_and_distinct():
    hs = block_hashes(tokens(4096), 1, SEED)
    assert len(hs) == 4096 and len(set(hs)) == 4096
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in hs)
    assert block_hashes([], 16, SEED) == []
    assert block_hashes([5] * 32, 16, SEED)[0] != block_hashes([5] * 32, 16, SEED)[1]  # position is in the chain


def test_a_changed_token_changes_its_block_and_every_later_one():
    base = tokens(8 * 16)
    full = block_hashes(base, 16, SEED)
    assert len(full) == 8
    for i in range(8):
        changed = list(base)
        changed[i * 16 + 7] ^= 1
        other = block_hashes(changed, 16, SEED)
        assert other[:i] == full[:i]
        assert all(a != b for a, b in zip(other[i:], full[i:]))


def test_continuation_equals_the_full_computation():
    seq = tokens(10 * 8 + 5)
    full = block_hashes(seq, 8, SEED)
    for k in range(1, 13):
        assert block_hashes(seq, 8, SEED, first_block=k, parent=full[k - 1] if k <= 10 else 1) == full[k:]
    # a decode worker extends the chain as tokens arrive, from the hash of the last full block it knows
    grown, known = seq[:8 * 3 + 1], full[:3]
    for t in seq[len(grown):]:
        grown.append(t)
        known += block_hashes(grown, 8, SEED, first_block=len(known), parent=known[-1])
    assert known == full


def test_the_partial_last_block_is_ignored():
    seq = tokens(48)
    assert block_hashes(seq + [1, 2, 3], 16, SEED) == block_hashes(seq, 16, SEED)
    assert len(block_hashes(seq[:47], 16, SEED)) == 2
    assert block_hashes(seq[:15], 16, SEED) == []
    assert block_hashes(seq + [-1], 16, SEED) == block_hashes(seq, 16, SEED)  # not read, so not checked


def test_any_sequence_of_ints():
    seq = tokens(40)
    expected = block_hashes(seq, 8, SEED)
    assert block_hashes(tuple(seq), 8, SEED) == expected
    assert block_hashes(array("I", seq), 8, SEED) == expected
    assert block_hashes(range(40), 8, SEED) == block_hashes(list(range(40)), 8, SEED)


def test_the_seed_changes_everything():
    seq = tokens(64)
    a = block_hashes(seq, 16, hash_seed("model-a", "paged/1"))
    b = block_hashes(seq, 16, hash_seed("model-b", "paged/1"))
    assert all(x != y for x, y in zip(a, b))


def test_seed_parts_are_unambiguous():
    assert hash_seed("m", "c") == hash_seed("m", "c")
    assert len({hash_seed(), hash_seed(""), hash_seed("", ""), hash_seed("ab", "c"), hash_seed("a", "bc"),
                hash_seed("c", "ab"), hash_seed("1"), hash_seed(1), hash_seed(-1)}) == 9
    assert 0 <= hash_seed("m", 2**80) < 2**64
    for bad in (1.0, True, b"m", None):
        with pytest.raises(TypeError):
            hash_seed("m", bad)


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=0), "block_size"),
    (dict(block_size=-4), "block_size"),
    (dict(block_size=1.5), "block_size"),
    (dict(block_size=True), "block_size"),
    (dict(token_ids=[1, 2, -1, 4]), r"\[0, 2\*\*32\)"),
    (dict(token_ids=[1, 2, 2**32, 4]), r"\[0, 2\*\*32\)"),
    (dict(token_ids=[1, 2, 3.0, 4]), r"\[0, 2\*\*32\)"),
    (dict(first_block=1), "needs parent"),
    (dict(first_block=-1), "first_block"),
    (dict(parent=5), "block 0 chains from the seed"),
    (dict(first_block=1, parent=-1), "parent"),
    (dict(first_block=1, parent=2**64), "parent"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(seed=None), "seed"),
])
def test_errors(kwargs, match):
    args = dict(token_ids=[1, 2, 3, 4, 5, 6, 7, 8], block_size=4, seed=SEED) | kwargs
    with pytest.raises(ValueError, match=match):
        block_hashes(**args)


# --- keyed hashes and cache_salt ---------------------------------------------------------------------------

KEY = hash_key("a-cluster-token")


def test_keyed_hashes_follow_the_construction_with_the_key():
    h0 = int.from_bytes(blake2b(SEED.to_bytes(8, "little") + struct.pack("<4I", 0, 1, 2, 3), digest_size=8,
                                key=KEY).digest(), "little")
    assert block_hashes(list(range(4)), 4, SEED, key=KEY) == [h0]
    assert KEY == hmac.new(b"a-cluster-token", b"xpyd prefix-hash key/1", hashlib.sha256).digest()
    assert hash_key(None) == b""  # no cluster token: unkeyed, as documented
    assert block_hashes(list(range(4)), 4, SEED, key=b"") == [H(SEED, [0, 1, 2, 3])]


def test_without_the_key_nobody_computes_a_keyed_hash():
    ids = tokens(64)
    keyed = block_hashes(ids, 16, SEED, key=KEY)
    assert not set(keyed) & set(block_hashes(ids, 16, SEED))  # the published seed alone is not enough
    assert not set(keyed) & set(block_hashes(ids, 16, SEED, key=hash_key("another-token")))
    assert block_hashes(ids, 16, SEED, first_block=2, parent=keyed[1], key=KEY) == keyed[2:]


def test_a_salt_changes_every_block_and_the_same_salt_shares():
    ids = tokens(64)
    plain = block_hashes(ids, 16, SEED, key=KEY)
    alice = block_hashes(ids, 16, salted_seed(SEED, "alice", KEY), key=KEY)
    bob = block_hashes(ids, 16, salted_seed(SEED, "bob", KEY), key=KEY)
    assert len(set(plain) | set(alice) | set(bob)) == 12  # no block in common, the first one included
    assert alice == block_hashes(ids, 16, salted_seed(SEED, "alice", KEY), key=KEY)
    assert salted_seed(SEED, None, KEY) == SEED
    assert salted_seed(SEED, "alice", KEY) != salted_seed(SEED, "alice", b"")  # keyed too
    assert salted_seed(SEED, "alice", KEY) == int.from_bytes(
        blake2b(SEED.to_bytes(8, "little") + b"alice", digest_size=8, key=KEY, person=b"xpyd-kv-salt/1").digest(),
        "little")


@pytest.mark.parametrize("salt", ["", "x" * 257, 5, b"alice"])
def test_bad_salts(salt):
    with pytest.raises(ValueError, match="cache_salt"):
        salted_seed(SEED, salt)


def test_bad_keys():
    with pytest.raises(ValueError, match="key"):
        block_hashes(list(range(4)), 4, SEED, key=b"k" * 65)
    with pytest.raises(ValueError, match="key"):
        block_hashes(list(range(4)), 4, SEED, key="text")
