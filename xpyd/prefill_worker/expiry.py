"""When a prefill worker gives up on KV it holds, and on KV it is sending: the rules, as decisions.

Held KV (prefilled, not yet pulled) is late when

- its decode worker left the cluster (discovery) and did not pull it within ``grace`` seconds of that (or
  of the prefill, if later): one that drains still pulls, one that was killed never will;
- it is claimed and its decode worker has sent nothing (heartbeats included) for ``silent`` seconds;
- it is claimed and was not pulled within ``claim_ttl`` seconds (a decode worker that keeps talking but
  lost the request does not hold it for ever; ``claim_ttl``: long, since a request that is ready may
  wait at its decode worker for a slot in the batch as long as the generations ahead of it take);
- it is not claimed and nobody pulled it within ``ttl`` seconds.

KV is *orphaned* when the signal session of its decode worker ended (its connection closed, or a new
session of that address opened: the worker reconnected or restarted): what that session claimed (held
KV) or pulled (sends in flight) is given up at once, since the decode worker that asked for it has failed
those requests (a restarted one never heard of them). KV nobody claimed keeps its ``ttl``: the worker's
next session may still claim and pull it.

A send (whole, or a streamed prompt's parts) is stalled when its decode worker has sent nothing for
``silent`` seconds: the link was cut or the worker died without a word, and the backend would otherwise
give up only when a connection that no longer answers times out.

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


def late_kv(held: Iterable[PrefillSeq], peers: DecodePeers, now: float, ttl: float, silent: float,
            grace: float, claim_ttl: float) -> list[tuple[PrefillSeq, str]]:
    """The held requests whose KV is given up on, each with why (in the words the logs and the decode
    worker get)."""
    late = []
    for seq in held:
        left_at = peers.left_at(seq.peer)
        if left_at is not None and now - max(left_at, seq.held_since) >= grace:
            late.append((seq, f"its decode worker left the cluster and did not pull it within {grace:g}s"))
        elif seq.claimed and now - (peers.last_heard(seq.peer) or 0.0) >= silent:
            late.append((seq, f"its decode worker {seq.peer} claimed it but sent nothing for {silent:g}s"))
        elif seq.claimed and now - seq.held_since >= claim_ttl:
            late.append((seq, f"its decode worker {seq.peer} claimed it but did not pull it within {claim_ttl:g}s"))
        elif not seq.claimed and now - seq.held_since >= ttl:
            late.append((seq, f"not pulled within kv_ttl={ttl:g}s"))
    return late


def stalled_sends(sending: Iterable[PrefillSeq], peers: DecodePeers, now: float,
                  silent: float) -> list[tuple[PrefillSeq, str]]:
    """The requests with sends in flight (not already being dropped) to a decode worker silent too long."""
    return [(seq, f"its decode worker {seq.peer} sent nothing for {silent:g}s during the KV send")
            for seq in sending
            if not seq.cancel_requested and now - (peers.last_heard(seq.peer) or 0.0) >= silent]


def orphaned(held: Iterable[PrefillSeq], sending: Iterable[PrefillSeq],
             peer: str) -> tuple[list[PrefillSeq], list[PrefillSeq]]:
    """The signal session of decode worker ``peer`` ended: its claimed held KV and its sends in flight (not
    already being dropped)."""
    return ([seq for seq in held if seq.peer == peer and seq.claimed],
            [seq for seq in sending if seq.peer == peer and not seq.cancel_requested])
