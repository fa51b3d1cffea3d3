"""A decode worker's own prefills: the requests the proxy sends it to compute from the prompt
(``xpyd.api.local_prefill``), as its engine thread runs them.

    facts(seq)   when it arrives: the prompt's length, block hashes and tail from its own tokens (the checks a
                 P/D request gets from prefill's facts), its output started (its random state made)
    step()       each engine step, before the decode step: the scheduler's plan (``plan_prefill``: at most
                 ``chunk`` prompt tokens over the prefilling requests), one forward pass over the chunks, the
                 first token of each prompt that ended sampled with its request's first random draw
                 -> [(seq, first token)] for the engine to emit; the prompts' blocks are cached

A preempted request's recompute (its prompt and output so far, ``DecodeSeq.prefill_ids``) runs in the same
chunks and passes; nothing is sampled from it, and it joins the batch when its last chunk is computed.

A prompt longer than the step's budget runs over several steps, each between two decode steps of the running
requests, so their inter-token latency grows by at most one ``chunk``-token forward pass.
"""

from __future__ import annotations

import time
from dataclasses import replace

from xpyd.decode_worker.scheduler import DecodeScheduler
from xpyd.decode_worker.seq import DecodeSeq, PromptChunk
from xpyd.worker.kv_cache import KVCache
from xpyd.worker.metrics import WorkerMetrics
from xpyd.worker.preemption import outgrown
from xpyd.worker.stepping import prefill_chunks, sample_first
from xpyd.worker.work_item import WorkItem


class LocalPrefill:
    """The local prefills of one decode engine (its engine thread alone)."""

    def __init__(self, runner, tokenizer, kv_cache: KVCache, metrics: WorkerMetrics, chunk: int,
                 max_model_len: int) -> None:
        if chunk < 1:
            raise ValueError("a local prefill step computes at least one token")
        self._runner = runner
        self._tokenizer = tokenizer
        self._kv_cache = kv_cache
        self._metrics = metrics
        self.chunk = chunk
        self._max_model_len = max_model_len
        self.prefilled = 0  # requests whose prompt was computed here (stats, metrics)
        self.tokens = 0  # prompt tokens computed here (their cached prefixes not counted)
        self.recomputed = 0  # tokens preempted requests computed again (their cached prefixes not counted)

    def facts(self, seq: DecodeSeq) -> str | None:
        """Set ``seq``'s prompt facts from its own tokens and start its output; why not, if it cannot run
        here (a 400 for the client)."""
        item: WorkItem = seq.payload
        ids = item.prompt_ids  # (a migrated request's end with the output it resumes)
        limit, prompt_len = self._max_model_len, item.prompt_tokens(len(ids))
        if item.open_ended:
            item.stop = replace(item.stop, max_tokens=max(1, limit - prompt_len))
        if not ids or prompt_len + item.stop.max_tokens > limit:
            return (f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{prompt_len + item.stop.max_tokens} tokens ({prompt_len} in the input, "
                    f"{item.stop.max_tokens} in the completion).")
        if not self._kv_cache.fits(len(ids) + 1):
            return outgrown(len(ids) + 1, self._kv_cache)
        hashes = self._kv_cache.hashes(ids, item.cache_salt)
        bs = self._kv_cache.block_size
        seq.prompt_ids, seq.prompt_len, seq.hashes = ids, len(ids), hashes
        seq.tail = tuple(ids[len(hashes) * bs:])
        seq.final_len = prompt_len + item.stop.max_tokens
        seq.known = True
        try:
            item.start_output(self._tokenizer, self._runner.sampler)
        except ValueError as e:  # a resumed output that cannot be replayed
            return str(e)
        return None

    def step(self, sched: DecodeScheduler) -> list[tuple[PromptChunk, int | None]]:
        """One forward pass over this step's prompt chunks (none: nothing to do); each chunk reported to the
        scheduler, and (chunk, first token) for every prompt it ended. Raises what the forward pass raised
        (the planned chunks are then the caller's to fail)."""
        chunks = sched.plan_prefill(self.chunk)
        if not chunks:
            return []
        t0 = time.monotonic()
        for c in chunks:
            if not c.replay:
                c.seq.payload.stamps.mark("scheduled", t0)
        rows = prefill_chunks(self._runner, chunks)
        ended = [(c, rows[i]) for i, c in enumerate(chunks) if c.last and not c.replay]
        firsts = sample_first(self._runner, ended) if ended else []
        now = time.monotonic()
        self._metrics.observe_step("prefill", now - t0, len(chunks))
        self.tokens += sum(c.end - c.start for c in chunks if not c.replay)
        self.recomputed += sum(c.end - c.start for c in chunks if c.replay)
        first_of = {id(c): t for (c, _), t in zip(ended, firsts)}
        done = []
        for c in chunks:
            if c.last and c.replay:
                sched.prefill_done(c)
                self._kv_cache.prompt_done(c.seq.kv, len(c.seq.prefill_ids), c.seq.tail)
            elif c.last:
                token = first_of[id(c)]
                sched.prefill_done(c, token)
                self._kv_cache.prompt_done(c.seq.kv, c.seq.prompt_len, c.seq.tail)
                self.prefilled += 1
                self._metrics.local_prefilled()
                done.append((c, token))
            else:
                sched.prefill_done(c)
        return done
