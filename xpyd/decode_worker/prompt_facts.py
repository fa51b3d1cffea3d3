"""What a decode worker checks of the prompt facts its prefill worker names (``prefilling``/``ready``): the
block hashes decode it (at most what the signal plane allows), their count and the tail's length add up to
the prompt's length, and, when decode tokenized the prompt itself (its prefix cache is on), they name this
request's own prompt. The block hashes the request's KV is cached under, or why the facts are refused."""

from __future__ import annotations

from xpyd.prefix_hash import hash_key
from xpyd.signal import messages as m
from xpyd.signal.client import PrefillPeer
from xpyd.worker.kv_cache import KVCache


def peer_hash_key(peer: PrefillPeer | None, own_token: str | None) -> bytes | None:
    """The block-hash key prefill worker ``peer`` names blocks with when it is not this worker's: it proved the
    other token of a rotation window at the handshake (that token is its primary, which keys its hashes)."""
    if peer is None or peer.proved is None or peer.proved == own_token:
        return None
    return hash_key(peer.proved)


def prompt_hashes(r: m.LookupResult, addr: str, prompt_ids, cache_salt, kv_cache: KVCache,
                  peer_key: bytes | None = None) -> list[int] | str:
    """The prompt's full blocks' hashes from ``r`` (decode's own names when it tokenized the prompt:
    ``prompt_ids``), or why prefill worker ``addr``'s facts do not add up. ``peer_key``: the block-hash key
    the prefill worker names blocks with when it is not decode's own (its primary token is the other one of a
    rotation window): its hashes are checked against the prompt's under that key."""
    try:
        hashes = m.unpack_hashes(r.block_hashes)
    except m.MessageError as e:
        return f"prefill worker {addr}: {e}"
    bs = kv_cache.block_size
    if r.num_tokens < 1 or len(hashes) != r.num_tokens // bs or len(r.tail) != r.num_tokens % bs:
        return (f"prefill worker {addr} named {len(hashes)} block hashes and {len(r.tail)} more tokens for a "
                f"{r.num_tokens}-token prompt")
    if prompt_ids:  # decode tokenized the prompt (its cache is on): it caches KV only under its own names
        own = kv_cache.hashes(prompt_ids, cache_salt)
        theirs = own if peer_key is None else kv_cache.hashes(prompt_ids, cache_salt, key=peer_key)
        if (r.num_tokens != len(prompt_ids) or hashes != theirs
                or tuple(r.tail) != tuple(prompt_ids[len(own) * bs:])):
            return (f"prefill worker {addr} named another prompt than this request's (its length, block hashes "
                    "or tail differ from decode's)")
        hashes = own
    return hashes
