"""One forward pass plus sampling, for the engines of every role.

The runner (the model's `ModelRunner`, or the simulated engine's) does both: ``prefill``/``prefill_many``/
``decode_rows`` return one row of scores per request, its ``sampler`` turns rows into tokens (``sample``),
makes a request's random state (``new_generator``) and consumes the draw another worker made (``skip_draw``).
Each row goes with its request's token history (``WorkItem.history``: None unless penalties, ``logit_bias``,
``min_tokens`` or ``min_p`` adjust its logits).

``seq`` objects are the schedulers' (prefill, decode, colocated): each has ``kv`` (its
``RequestKV``: blocks in token order, the cached prefix), a ``prompt_len`` (prefill: its
``prompt_ids``) and a ``payload`` WorkItem whose output processor holds the tokens generated so far.
"""

from __future__ import annotations

from typing import Any, Sequence

from xpyd.worker.kv_cache import KVCache
from xpyd.worker.work_item import WorkItem


def prefill_and_sample(runner: Any, seq: Any) -> int:
    """Run ``seq``'s prompt after its cached prefix into its blocks and sample its first token."""
    item: WorkItem = seq.payload
    logits = runner.prefill(seq.kv.blocks, seq.prompt_ids, start=seq.kv.cached_tokens)
    return runner.sampler.sample([logits], [item.sampling], [item.generator], [item.history()])[0]


def prefill_chunks(runner: Any, chunks: Sequence[Any]) -> Any:
    """One forward pass over prompt chunks (each has ``seq``, ``start``, ``end``: the tokens [start, end) of
    ``seq``'s prompt, after the KV of [0, start) already in its blocks); float32 logits [chunks, vocab],
    one row per chunk (of its last token)."""
    return runner.prefill_many([(c.seq.kv.blocks, c.seq.prompt_ids[: c.end], c.start) for c in chunks])


def sample_first(runner: Any, rows: Sequence[tuple[Any, Any]]) -> list[int]:
    """The first token of each (chunk, logits row) whose chunk ended its prompt."""
    if not rows:
        return []
    items = [chunk.seq.payload for chunk, _ in rows]
    return runner.sampler.sample([row for _, row in rows], [i.sampling for i in items],
                                 [i.generator for i in items], [i.history() for i in items])


def decode_and_sample(runner: Any, cache: KVCache, seqs: Sequence[Any]) -> list[int]:
    """One decode step over every running ``seq`` (each feeds its last token, growing into a new block
    when it needs one); their next tokens. The fed tokens' KV is then complete: blocks they fill are
    cached. The runner reads the requests' blocks from the cache's kept block tables (``decode_rows``)."""
    rows, tokens, positions = [], [], []
    for seq in seqs:
        ids = seq.payload.output.token_ids
        position = seq.prompt_len + len(ids) - 1
        cache.grow(seq.kv, position + 1)
        rows.append(cache.table_row(seq.kv))
        tokens.append(ids[-1])
        positions.append(position)
    logits = runner.decode_rows(cache.tables, rows, tokens, positions)
    for seq, token in zip(seqs, tokens):
        cache.append_tokens(seq.kv, (token,))
    items = [s.payload for s in seqs]
    return runner.sampler.sample(logits, [i.sampling for i in items], [i.generator for i in items],
                                 [i.history() for i in items])
