"""What a prefill worker tells a decode worker about a prefilled request; where its KV goes is the KV connector's.

``ready_result``: the first token, the prompt's length, the chain hashes of its full blocks and the tokens
after them (decode finds and extends the prefix in its own cache), the tokens prefill reused.
A pull's plan (its parts as byte regions on both sides, and when each can go), its sends and their abort
are the KV connector's sending side (``xpyd.worker.kv_connector_send``: ``plan_pull``, ``send_due``,
``abort_sends``, named here too), which the engine reaches through its ``KVSender``.
"""

from __future__ import annotations

from xpyd.prefill_worker.scheduler import PrefillSeq
from xpyd.signal import messages as m
from xpyd.worker.kv_connector_send import Part, PullPlan, abort_sends, plan_pull, send_due  # noqa: F401


def ready_result(seq: PrefillSeq, status: m.LookupStatus, block_size: int, part_blocks: int = 0,
                 steps: int = 0) -> m.LookupResult:
    """The prompt's facts (and its first token once it is known: READY/SENDING; PREFILLING: not yet, with
    the blocks one step computes as the suggested part size, and ``steps``, the forward passes run so far: the
    decode worker waiting for the rest of its KV sees the worker move)."""
    full = len(seq.hashes)
    return m.LookupResult(seq.request_id, status, seq.first_token, seq.prompt_len,
                          block_hashes=m.pack_hashes(seq.hashes),
                          tail=tuple(seq.prompt_ids[full * block_size:]),
                          cached_tokens=seq.kv.cached_tokens if seq.kv is not None else 0,
                          part_blocks=part_blocks, steps=steps)
