"""When a prefill worker gives up on KV it holds, and on KV it is sending: the rules, as decisions.

Held KV (prefilled, not yet pulled) is late when

- its decode worker left the cluster (discovery) and did not pull it within ``grace`` seconds of that (or
  of the prefill, if later): one that drains still pulls, one that was killed never will;
- it is claimed and was not pulled within ``claim_ttl`` seconds (a decode worker that keeps talking but
  lost the request does not hold it for ever; ``claim_ttl``: long, since a request that is ready may
  wait at its decode worker for a slot in the batch as long as the generations ahead of it take);
- it is not claimed and nobody pulled it within ``ttl`` seconds.

KV is *orphaned* when the signal session of its decode worker ended (its connection closed, or a new
session of that address opened: the worker reconnected or restarted, or its connection answered no ZMTP
heartbeat for ``peer_timeout``: the link was cut, the worker died without a word or was stopped): what
that session claimed (held KV) or pulled (sends in flight) is given up at once, since the decode worker
that asked for it has failed those requests (a restarted one never heard of them). KV nobody claimed keeps
its ``ttl``: the worker's next session may still claim and pull it.

How recently a decode worker last sent a message does not count: its engine thread sends its heartbeats,
and a loaded machine can starve that thread for longer than ``peer_timeout`` while the worker is well (64
workers on 2 cores did: claimed KV was freed under requests that were about to pull it). The ZMTP
heartbeats that keep its session open are answered by its libzmq I/O thread, whatever the engine does.

The engine applies the decisions (frees, aborts, records, logs); these functions only read.
"""

from __future__ import annotations

from collections.abc import Iterable

from xpyd.prefill_worker.peers import DecodePeers
from xpyd.prefill_worker.scheduler import PrefillSeq


CLAIM_TTL_FACTOR = 4  # claimed KV waits at most this many kv_ttl for its pull ...
MIN_CLAIM_TTL = 600.0  # ... and at least this many seconds


def claim_ttl(kv_ttl: float) -> float:
    """How long claimed KV may wait for its pull."""
    return max(CLAIM_TTL_FACTOR * kv_ttl, MIN_CLAIM_TTL)


def late_kv(held: Iterable[PrefillSeq], peers: DecodePeers, now: float, ttl: float,
            grace: float, claim_ttl: float) -> list[tuple[PrefillSeq, str]]:
    """The held requests whose KV is given up on, each with why (in the words the logs and the decode
    worker get)."""
    late = []
    for seq in held:
        left_at = peers.left_at(seq.peer)
        if left_at is not None and now - max(left_at, seq.held_since) >= grace:
            late.append((seq, f"its decode worker left the cluster and did not pull it within {grace:g}s"))
        elif seq.claimed and now - seq.held_since >= claim_ttl:
            late.append((seq, f"its decode worker {seq.peer} claimed it but did not pull it within {claim_ttl:g}s"))
        elif not seq.claimed and now - seq.held_since >= ttl:
            late.append((seq, f"not pulled within kv_ttl={ttl:g}s"))
    return late


def orphaned(held: Iterable[PrefillSeq], sending: Iterable[PrefillSeq],
             peer: str) -> tuple[list[PrefillSeq], list[PrefillSeq]]:
    """The signal session of decode worker ``peer`` ended: its claimed held KV and its sends in flight (not
    already being dropped)."""
    return ([seq for seq in held if seq.peer == peer and seq.claimed],
            [seq for seq in sending if seq.peer == peer and not seq.cancel_requested])
