"""Prefill admission per decode worker: which waiting requests may take a place in the batch now.

KV computed here waits in this worker's pool until the decode worker named in the request id pulls it, so a
place (and its KV blocks) is held for as long as that decode worker takes. The rule, per decode worker with
requests waiting here:

- Places go only to decode workers that have work here. How many decode workers are live elsewhere in the
  cluster does not matter: at 48 live decode workers and a batch of 8, one decode worker with 8 waiting
  requests gets all 8 places, and each pair may be as deep as the batch.
- While requests for other decode workers wait too, a decode worker may hold at most its fair share of the
  places, ``ceil(batch_size / W)`` for the W decode workers with requests waiting (two with work: 4 each of
  8). So one slow or full decode worker cannot keep every place from the others: a decode worker that
  holds more than its share starts nothing more until it is back under it, and a decode worker with new
  demand (under its share by definition: it holds little or nothing) takes the next place that frees.
  What the newcomer waits for is the oldest holder's pull, or the lease (``kv_ttl``) of KV nobody claimed.
- The same share holds for KV blocks: a decode worker's requests may hold at most its places' share of the
  pool (``num_blocks * share // batch_size``; the whole pool while it is the only one waiting), so a few
  long prompts for one decode worker cannot fill the pool while others wait. A decode worker holding no
  block may always start one request (a prompt larger than its share runs alone).

Oldest first: the waiting requests are taken in arrival order, each if its decode worker is under its share
(in places and in blocks) with the requests taken before it counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar


class Waiter(Protocol):
    peer: str  # the decode worker its KV would wait for
    prompt_len: int


W = TypeVar("W", bound=Waiter)


def share(batch_size: int, waiting_peers: int) -> int:
    """Places one decode worker may hold while ``waiting_peers`` decode workers (itself among them) have
    requests waiting."""
    if batch_size < 1 or waiting_peers < 1:
        raise ValueError("a share needs a batch and a decode worker waiting")
    return -(-batch_size // waiting_peers)


def admissible(waiting: Sequence[W], holding: Iterable[tuple[str, int]], room: int, batch_size: int,
               num_blocks: int, blocks_for: Callable[[int], int]) -> list[W]:
    """The waiting requests (oldest first) that may start now as far as places go: at most ``room`` of them,
    each with its decode worker under its share of the places and of the ``num_blocks`` KV blocks, counting
    the places held now (``holding``: a (decode worker, blocks) pair per running or prefilled request) and
    the requests taken before it."""
    if room <= 0 or not waiting:
        return []
    held, held_blocks = Counter[str](), Counter[str]()
    for peer, blocks in holding:
        held[peer] += 1
        held_blocks[peer] += blocks
    cap = share(batch_size, len({s.peer for s in waiting}))
    block_cap = num_blocks * cap // batch_size
    out = []
    for seq in waiting:
        if len(out) == room:
            break
        need = blocks_for(seq.prompt_len)
        if held[seq.peer] < cap and (held_blocks[seq.peer] == 0 or held_blocks[seq.peer] + need <= block_cap):
            out.append(seq)
            held[seq.peer] += 1
            held_blocks[seq.peer] += need
    return out
