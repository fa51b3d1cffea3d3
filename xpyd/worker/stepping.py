"""One forward pass plus sampling, for the engines of every role.

The runner (the model's `ModelRunner`, or the simulated engine's) does both: ``prefill``/``prefill_many``/
``decode_rows`` return one row of scores per request, its ``sampler`` turns rows into tokens (``sample``),
makes a request's random state (``new_generator``) and consumes the draw another worker made (``skip_draw``).
Each row goes with its request's token history (``WorkItem.history``: None unless penalties, ``logit_bias``,
``min_tokens`` or ``min_p`` adjust its logits), and its grammar's mask (structured output: ``WorkItem.grammar``).

Logprobs: a request that asks for them (``WorkItem.logprobs``) gets its sampled token's (``TokenLogprob``, from
the runner's raw scores, as vLLM's default) set on the item for its next event; one that scores its prompt
(``WorkItem.prompt_scores``: echo with logprobs, or ``prompt_logprobs``) gets every prompt token's appended to
``WorkItem.prompt_logprobs`` as its chunks are computed (the runner's ``prefill_scored``). A prompt-only request
(``max_tokens`` 0) is computed and scored, never sampled.

``seq`` objects are the schedulers' (prefill, decode, colocated): each has ``kv`` (its
``RequestKV``: blocks in token order, the cached prefix), a ``prompt_len`` (prefill: its
``prompt_ids``) and a ``payload`` WorkItem whose output processor holds the tokens generated so far.

A preempted request (``xpyd.worker.preemption``) re-enters by computing again the KV of its prompt and its output
but the last token (``context_ids``: ``recompute``, or a decode worker's prompt chunks), sampling nothing: its
output (text, stop strings, penalties' history, grammar, the random state of its draws) stayed in its WorkItem,
so its next decode step feeds its last token and samples the token it would have sampled without preemption.
"""

from __future__ import annotations

from typing import Any, Sequence

from xpyd.worker.kv_cache import KVCache
from xpyd.worker.work_item import WorkItem


def sample_rows(runner: Any, rows: Sequence[Any], items: Sequence[WorkItem]) -> list[int]:
    """One token per (row, item); the logprob of each where its item asks (``WorkItem.sampled_logprob``). A row
    whose item has a grammar is masked by it, and its matcher takes the token."""
    grammars = [i.grammar for i in items]
    masks = [g.allowed() if g is not None else None for g in grammars] if any(grammars) else None
    tokens = runner.sampler.sample(rows, [i.sampling for i in items], [i.generator for i in items],
                                   [i.history() for i in items], *([masks] if masks is not None else []))
    if masks is not None:
        for g, token in zip(grammars, tokens):
            if g is not None and not g.accept(token):
                raise RuntimeError(f"the grammar refused token {token}, which its own mask allowed")
    wanted = [j for j, item in enumerate(items) if item.logprobs is not None]
    if wanted:
        scored = runner.sampler.logprobs([rows[j] for j in wanted], [tokens[j] for j in wanted],
                                         [items[j].logprobs for j in wanted])
        for j, lp in zip(wanted, scored):
            items[j].sampled_logprob = lp
    return tokens


def _prompt_spec(item: WorkItem, prompt_ids: Sequence[int], start: int, end: int) -> tuple[list[int], int] | None:
    """What ``prefill_scored`` scores of the prompt chunk [start, end): each position against the prompt's next
    token (the chunk's last position against the next chunk's first; the prompt's last against nothing)."""
    if item.prompt_scores is None:
        return None
    return list(prompt_ids[start + 1 : end + 1]), item.prompt_scores


def _prefill(runner: Any, parts: list, specs: list, items: Sequence[WorkItem]) -> Any:
    if not any(spec is not None for spec in specs):
        return runner.prefill_many(parts)
    rows, scores = runner.prefill_scored(parts, specs)
    for item, scored in zip(items, scores):
        if scored is not None:
            item.prompt_logprobs.extend(scored)
    return rows


def prefill_and_sample(runner: Any, seq: Any) -> int | None:
    """Run ``seq``'s prompt after its cached prefix into its blocks and sample its first token (None for a
    prompt-only request)."""
    item: WorkItem = seq.payload
    start = seq.kv.cached_tokens
    rows = _prefill(runner, [(seq.kv.blocks, seq.prompt_ids, start)],
                    [_prompt_spec(item, seq.prompt_ids, start, len(seq.prompt_ids))], [item])
    if item.prompt_only:
        return None
    return sample_rows(runner, [rows[0]], [item])[0]


def prefill_chunks(runner: Any, chunks: Sequence[Any]) -> Any:
    """One forward pass over prompt chunks (each has ``seq``, ``start``, ``end`` and ``ids``: the tokens [start,
    end) of ``seq``'s prompt, ``ids`` those up to ``end``, after the KV of [0, start) already in its blocks);
    float32 logits [chunks, vocab], one row per chunk (of its last token). Chunks whose request scores its
    prompt are scored on the way."""
    items = [c.seq.payload for c in chunks]
    return _prefill(runner, [(c.seq.kv.blocks, c.ids, c.start) for c in chunks],
                    [_prompt_spec(i, c.seq.prompt_ids, c.start, c.end) for i, c in zip(items, chunks)], items)


def recompute(runner: Any, seq: Any, ids: Sequence[int]) -> None:
    """Compute the KV of a preempted ``seq``'s ``ids`` (its ``context_ids``) after its cached prefix, in one
    forward pass; nothing is sampled or scored."""
    runner.prefill_many([(seq.kv.blocks, ids, seq.kv.cached_tokens)])


def context_len(seq: Any) -> int:
    """The tokens whose KV ``seq`` holds after its next decode step: its prompt (a resumed output's included)
    and every token generated since (the last one's KV is written by that step)."""
    item: WorkItem = seq.payload
    return seq.prompt_len + len(item.output.token_ids) - len(item.resumed)


def context_ids(seq: Any) -> list[int]:
    """The tokens whose KV ``seq`` holds now, between decode steps: its prompt and the tokens generated since,
    but the last (which its next decode step feeds). ValueError when the worker lacks the prompt's tokens."""
    item: WorkItem = seq.payload
    if len(item.prompt_ids) != seq.prompt_len:
        raise ValueError(f"the worker has {len(item.prompt_ids)} of the prompt's {seq.prompt_len} tokens")
    return [*item.prompt_ids, *item.output.token_ids[len(item.resumed):-1]]


def sample_first(runner: Any, rows: Sequence[tuple[Any, Any]]) -> list[int | None]:
    """The first token of each (chunk, logits row) whose chunk ended its prompt (None: a prompt-only request)."""
    sampled = [(row, chunk.seq.payload) for chunk, row in rows if not chunk.seq.payload.prompt_only]
    tokens = iter(sample_rows(runner, [r for r, _ in sampled], [i for _, i in sampled]) if sampled else [])
    return [None if chunk.seq.payload.prompt_only else next(tokens) for chunk, _ in rows]


def decode_and_sample(runner: Any, cache: KVCache, seqs: Sequence[Any]) -> list[int]:
    """One decode step over every running ``seq`` (each feeds its last token, growing into a new block
    when it needs one); their next tokens. The fed tokens' KV is then complete: blocks they fill are
    cached. The runner reads the requests' blocks from the cache's kept block tables (``decode_rows``)."""
    rows, tokens, positions = [], [], []
    for seq in seqs:
        ids = seq.payload.output.token_ids
        position = context_len(seq) - 1  # (a resumed output: in the prompt)
        cache.grow(seq.kv, position + 1)
        rows.append(cache.table_row(seq.kv))
        tokens.append(ids[-1])
        positions.append(position)
    logits = runner.decode_rows(cache.tables, rows, tokens, positions)
    for seq, token in zip(seqs, tokens):
        cache.append_tokens(seq.kv, (token,))
    return sample_rows(runner, logits, [s.payload for s in seqs])
