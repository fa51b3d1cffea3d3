"""Names for full KV blocks: a hash chained over every token up to the block's end.

    h_-1 = seed                     (what the KV depends on besides the tokens: the model's weights, the
                                     KV layout), or salted_seed(seed, cache_salt) for a request with a salt
    h_i  = H_K(h_{i-1}, tokens of block i)
    H_K  = blake2b(digest_size=8, key=K) over h_{i-1} as 8 little-endian bytes + the block's token ids as
           little-endian uint32; the digest read as a little-endian int in [0, 2**64)

Two blocks have the same hash only if the KV in them was computed from the same tokens in front of them
by the same model, so a prefix cache can hand one request's block to another. The construction is fixed
(no Python `hash()`, no per-process salt): every process and machine of a deployment names a block the
same way, which lets a worker publish its cache and a router match requests against it.

K is the deployment's secret (``hash_key``: derived from the cluster token; empty without one). With it,
nobody outside the cluster can compute the hash of a prompt of their choosing, so the hashes a worker
publishes (``GET /xpyd/kv_events``) say nothing about the prompts behind them. A request's ``cache_salt``
(vLLM's field) changes the chain's start, so requests with different salts (or one with and one without)
never share a block: tenants that each send their own salt cannot probe each other's prompts through
``cached_tokens`` or timing, and requests with the same salt share as before.
"""

from __future__ import annotations

import hashlib
import hmac
import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b

_HASH_LIMIT = 2**64
_SEED_PERSON = b"xpyd-kv-seed/1"  # seeds and block hashes are hashed differently: neither passes for the other
_SALT_PERSON = b"xpyd-kv-salt/1"
_KEY_LABEL = b"xpyd prefix-hash key/1"
MAX_SALT_CHARS = 256  # a cache_salt's length (the API refuses longer ones)

if array("I").itemsize != 4:  # pragma: no cover - every platform CPython supports has a 4-byte C int
    raise ImportError("prefix_hash needs array('I') to hold 4-byte unsigned ints")


def hash_seed(*parts: str | int) -> int:
    """A 64-bit seed naming what the KV depends on (the weights' identity and the KV layout's compat string).

    Each part is encoded with its type and length, so ("ab", "c") and ("a", "bc") differ, as do "1" and 1.
    """
    h = blake2b(digest_size=8, person=_SEED_PERSON)
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, (str, int)):
            raise TypeError(f"hash_seed parts are str or int, got {part!r}")
        tag, data = (b"s", part.encode()) if isinstance(part, str) else (b"i", str(part).encode())
        h.update(tag + len(data).to_bytes(8, "little") + data)
    return int.from_bytes(h.digest(), "little")


def hash_key(cluster_token: str | None) -> bytes:
    """The deployment's block-hash key, derived from its cluster token (HMAC-SHA256 with a label of its own,
    so it is no other key derived from the token); b"" (unkeyed) without a token."""
    if cluster_token is None:
        return b""
    if not isinstance(cluster_token, str) or not cluster_token:
        raise ValueError("the cluster token must be a non-empty string")
    return hmac.new(cluster_token.encode("utf-8", "surrogatepass"), _KEY_LABEL, hashlib.sha256).digest()


def salted_seed(seed: int, salt: str | None, key: bytes = b"") -> int:
    """Where the chain of a request with ``cache_salt`` = ``salt`` starts (``seed`` when it has none)."""
    _check_hash("seed", seed)
    if salt is None:
        return seed
    if not isinstance(salt, str) or not 1 <= len(salt) <= MAX_SALT_CHARS:
        raise ValueError(f"cache_salt must be a string of 1..{MAX_SALT_CHARS} characters")
    h = blake2b(seed.to_bytes(8, "little"), digest_size=8, key=_check_key(key), person=_SALT_PERSON)
    h.update(salt.encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, seed: int, first_block: int = 0,
                 parent: int | None = None, key: bytes = b"") -> list[int]:
    """The chained hashes of the full blocks of `token_ids` (a partial last block has none).

    `token_ids` is the whole sequence from its first token. With `first_block` > 0 only blocks
    first_block.. are hashed, continuing from `parent`, the hash of block first_block-1 (required then):
    a worker that knows the hash of a sequence's last full block extends the chain as tokens arrive
    without rehashing the prefix. The tokens of blocks before `first_block` are not read. `key`: the
    deployment's secret (``hash_key``); every process of a deployment must use the same one.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if isinstance(first_block, bool) or not isinstance(first_block, int) or first_block < 0:
        raise ValueError(f"first_block must be an int >= 0, got {first_block!r}")
    _check_hash("seed", seed)
    _check_key(key)
    if first_block == 0:
        if parent is not None:
            raise ValueError("parent is the hash of block first_block-1; block 0 chains from the seed")
        parent = seed
    elif parent is None:
        raise ValueError(f"first_block={first_block} needs parent, the hash of block {first_block - 1}")
    else:
        _check_hash("parent", parent)

    num_full = len(token_ids) // block_size
    if first_block >= num_full:
        return []
    try:
        tokens = array("I", token_ids[first_block * block_size:num_full * block_size])
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be ints in [0, 2**32): {e}") from None
    if sys.byteorder == "big":  # pragma: no cover - the hash is defined over little-endian ids
        tokens.byteswap()
    data = memoryview(tokens).cast("B")
    step = 4 * block_size
    prev = parent.to_bytes(8, "little")
    hashes = []
    for start in range(0, len(data), step):
        h = blake2b(prev, digest_size=8, key=key)
        h.update(data[start:start + step])
        prev = h.digest()
        hashes.append(int.from_bytes(prev, "little"))
    return hashes


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) > 64:
        raise ValueError("a block-hash key is at most 64 bytes")
    return key


def _check_hash(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _HASH_LIMIT:
        raise ValueError(f"{name} must be an int in [0, 2**64), got {value!r}")
