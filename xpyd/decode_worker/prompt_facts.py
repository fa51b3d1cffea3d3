"""What a decode worker checks of the prompt facts its prefill worker names (``prefilling``/``ready``): the
block hashes decode it (at most what the signal plane allows), their count and the tail's length add up to
the prompt's length, and, when decode tokenized the prompt itself (its prefix cache is on), they name this
request's own prompt. The block hashes the request's KV is cached under, or why the facts are refused."""

from __future__ import annotations

from xpyd.signal import messages as m
from xpyd.worker.kv_cache import KVCache


def prompt_hashes(r: m.LookupResult, addr: str, prompt_ids, cache_salt, kv_cache: KVCache) -> list[int] | str:
    """The prompt's full blocks' hashes from ``r`` (decode's own names when it tokenized the prompt:
    ``prompt_ids``), or why prefill worker ``addr``'s facts do not add up."""
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
        if (r.num_tokens != len(prompt_ids) or hashes != own
                or tuple(r.tail) != tuple(prompt_ids[len(own) * bs:])):
            return (f"prefill worker {addr} named another prompt than this request's (its length, block hashes "
                    "or tail differ from decode's)")
        hashes = own
    return hashes
