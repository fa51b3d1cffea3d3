"""A decode worker's running batch, one engine step at a time (its engine thread alone).

Requests take KV blocks as they grow: before the pulls and local prefills are admitted (and again before the
decode step, for the requests that joined since), each step gives the running requests the blocks of their
next token (``make_room``: ``DecodeScheduler.reserve_decode``), preempting the newest when the pool is full; a
preempted request computes its prompt and output so far again here, in the local prefill's chunks, and continues
with the tokens it would have generated (its output never left this worker). Its prefill worker is not asked
again. Preemptions are counted (stats ``preemptions``, metrics).

    make_room()     the blocks of the decode step for every running request (preempting, or failing one that
                    outgrew the pool)
    prefill_step()  this step's local prefill chunks (``local_prefill``); each prompt that ended emits its
                    first token
    decode_step()   one decode step over every running request; each emits its token
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable, ContextManager

from xpyd.decode_worker.local_prefill import LocalPrefill
from xpyd.decode_worker.scheduler import DecodeScheduler
from xpyd.decode_worker.seq import DecodeSeq
from xpyd.worker.kv_cache import KVCache
from xpyd.worker.metrics import WorkerMetrics
from xpyd.worker.stepping import context_ids, context_len, decode_and_sample
from xpyd.worker.work_item import ErrorEvent, TokenEvent, WorkItem

log = logging.getLogger(__name__)


class DecodeBatch:
    """The running requests' steps of one decode engine. ``isolate(rid, item)`` is the engine's (an exception
    fails just that request), ``fail(seq, status, error, cause)`` its way to fail a request, ``failures`` its
    count of failed requests by cause."""

    def __init__(self, runner, kv_cache: KVCache, sched: DecodeScheduler, local: LocalPrefill,
                 metrics: WorkerMetrics, isolate: Callable[..., ContextManager],
                 fail: Callable[[DecodeSeq, int, str, str], None], failures: Counter[str]) -> None:
        self._runner = runner
        self._kv_cache = kv_cache
        self._sched = sched
        self._local = local
        self._metrics = metrics
        self._isolate = isolate
        self._fail = fail
        self._failures = failures
        self._last_decode_at = 0.0  # end of the last decode step

    def make_room(self) -> None:
        """The blocks of this step's decode for every running request, preempting the newest while the pool
        has none (``reserve_decode``)."""
        try:
            room = self._sched.reserve_decode(context_len, context_ids)
        except Exception as e:  # (a bug: the scheduler stays consistent; its running requests fail)
            log.exception("making room for the decode step failed")
            for seq in self._sched.running():
                self._fail(seq, 500, f"decode failed: {type(e).__name__}: {e}", "decode")
            return
        for seq in room.preempted:
            self._metrics.preempted()
            item: WorkItem = seq.payload
            if seq.stalled_since is None and len(item.output.token_ids) > len(item.resumed) + 1:
                seq.stalled_since = self._last_decode_at  # (it decoded here: its next gap counts from its last token)
        for seq in room.failed:
            self._metrics.request_done("failed")
            self._failures["kv_cache"] += 1
            seq.payload.sink.put(ErrorEvent(500, seq.error))

    def prefill_step(self) -> None:
        """This step's local prefill chunks (``local_prefill``); each prompt that ended emits its first token."""
        try:
            ended = self._local.step(self._sched)
        except Exception as e:
            log.exception("local prefill step failed")
            for seq in self._sched.prefilling():
                self._fail(seq, 500, f"prefill failed: {type(e).__name__}: {e}", "prefill")
            return
        now = time.monotonic()
        for chunk, token in ended:
            seq = chunk.seq
            with self._isolate(seq.request_id, seq.payload):
                self._local_first_token(seq, token, now)

    def _local_first_token(self, seq: DecodeSeq, token: int, now: float) -> None:
        """The first token of a request prefilled here: its event goes out (usage counts the prompt tokens this
        worker's cache served); it ends the request, or the request runs from the next decode step."""
        item: WorkItem = seq.payload
        item.stamps.mark("sampled", now)
        self._metrics.observe_ttft(now - item.arrival)
        text, finish = item.output.append(token)
        if finish is not None:
            self._sched.finish(seq)
            self.finished(item)
        prompt_len = item.prompt_tokens(seq.prompt_len)
        item.sink.put(TokenEvent(text, finish.value if finish else None, prompt_len, len(item.output.token_ids),
                                 min(seq.cached_tokens, prompt_len), item.take_logprobs(), item.new_ids()))

    def finished(self, item: WorkItem) -> None:
        """A request ended with its last token (counted and timed)."""
        self._metrics.request_done("finished")
        self._metrics.observe_e2e(time.monotonic() - item.arrival)

    def decode_step(self) -> None:
        running = self._sched.running()
        t0 = time.monotonic()
        try:
            new = decode_and_sample(self._runner, self._kv_cache, running)
        except Exception as e:
            log.exception("decode step failed")
            for seq in running:
                self._fail(seq, 500, f"decode failed: {type(e).__name__}: {e}", "decode")
            return
        now = time.monotonic()
        self._metrics.observe_step("decode", now - t0, len(running))
        for seq, tok in zip(running, new):
            with self._isolate(seq.request_id, seq.payload):
                item: WorkItem = seq.payload
                if item.stamps.step_started is None:  # its first step (xpyd.worker.phases)
                    item.stamps.step_started, item.stamps.step_ended = t0, now
                text, finish = item.output.append(tok)
                n_out = len(item.output.token_ids)
                if seq.stalled_since is not None:  # its first token since it was preempted
                    self._metrics.observe_itl(now - seq.stalled_since)
                    seq.stalled_since = None
                elif n_out > len(item.resumed) + 2:  # its previous token came from the previous decode step (every
                    # step runs them all)
                    self._metrics.observe_itl(now - self._last_decode_at)
                if finish is not None:
                    self._sched.finish(seq)
                    self.finished(item)
                logprobs = item.take_logprobs()
                if text or finish is not None or logprobs:
                    prompt_len = item.prompt_tokens(seq.prompt_len)
                    item.sink.put(TokenEvent(text, finish.value if finish else None, prompt_len, n_out,
                                             min(seq.cached_tokens, prompt_len), logprobs, item.new_ids()))
        self._last_decode_at = now
