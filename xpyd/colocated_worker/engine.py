"""Colocated engine: prefill and decode on the same engine, in one continuous batch.

The baseline for benchmarks (``xpyd up --colocated``): same model runner, KV
pool, sampling and HTTP API as the disaggregated workers, no KV transfer. Each
step runs either one prefill (preferred while the batch has room) or one
decode step over every running request.

Requests take KV blocks as they grow: each step first gives the running requests the blocks of their next
token (``ColocatedScheduler.reserve_decode``), preempting the newest when the pool is full; a preempted request
re-enters by computing its prompt and output so far again (one forward pass, nothing sampled) and continues
with the tokens it would have generated. Preemptions are counted (stats ``preemptions``, metrics).
"""

from __future__ import annotations

import logging
import time

from xpyd import PROTOCOL_VERSION
from xpyd.colocated_worker.scheduler import ColocatedScheduler, ColocatedSeq
from xpyd.discovery.types import Role, WorkerInfo
from xpyd.worker.config import WorkerConfig
from xpyd.worker.preemption import outgrown
from xpyd.worker.work_item import ErrorEvent, TokenEvent, WorkItem
from xpyd.worker.stepping import context_ids, context_len, decode_and_sample, prefill_and_sample, recompute
from xpyd.worker.engine import Abort, WorkerEngine
from xpyd.netaddr import host_port

log = logging.getLogger(__name__)


class ColocatedEngine(WorkerEngine):
    name = "colocated-engine"

    def __init__(self, runner, tokenizer, config: WorkerConfig, served_name: str) -> None:
        super().__init__(runner, tokenizer, config, served_name)
        self.sched = ColocatedScheduler(config.batch_size, self.kv_cache)
        # Requests name this worker as both peers: the id format stays the same everywhere.
        addr = host_port(config.public_host, config.port)
        self.info = WorkerInfo(Role.DECODE, f"http://{addr}", addr, served_name, PROTOCOL_VERSION,
                               config.batch_size)
        self._last_token_at: dict[str, float] = {}
        self._recomputed = 0  # tokens preempted requests computed again (their cached prefixes not counted)
        self._stats: dict = {}
        self._update_stats()

    def start(self) -> None:
        self.start_thread()

    def idle(self) -> bool:
        s = self._stats
        return not (s.get("waiting") or s.get("running"))

    def stats(self) -> dict:
        return dict(self._stats)

    def peers_left(self, addrs: set[str], joined: set[str] = frozenset()) -> None:  # no peers
        pass

    def _update_stats(self) -> None:
        self._stats = {"role": "colocated", "waiting": self.sched.num_waiting, "running": self.sched.num_running,
                       "transferring": 0, "preemptions": self.sched.preemptions,
                       "preempted": self.sched.num_preempted, "recomputed_tokens": self._recomputed,
                       "kv_used_bytes": self.pool.used_bytes(), **self.kv_cache.stats()}
        self.metrics.set_queue(self.sched.num_waiting, self.sched.num_running, 0)
        self.metrics.set_kv(self.pool.used_bytes(), self.pool.layout.total_bytes)
        self.metrics.set_kv_cache(self.kv_cache.stats())
        self.publish_kv_events()

    def step(self) -> float:
        for item in self.drain_inbox():
            if isinstance(item, Abort):
                with self.isolate(item.request_id):
                    if self.sched.abort(item.request_id) is not None:
                        self._last_token_at.pop(item.request_id, None)
                        self.metrics.request_done("aborted")
            else:
                self.admit(item, self._add)
        if self.sched.running():
            self._make_room()
        seq = self.sched.next_prefill()
        if seq is not None:
            with self.isolate(seq.request_id, seq.payload):
                if seq.recompute:
                    self._recompute(seq)
                else:
                    self._prefill(seq)
        elif self.sched.running():
            self._decode_step()
        self._update_stats()
        return 0.0 if self.sched.has_work() else 0.05

    def _add(self, item: WorkItem) -> None:
        if self.sched.get(str(item.request_id)) is not None:
            self.metrics.request_done("rejected")
            item.sink.put(ErrorEvent(409, f"duplicate request id {item.request_id}"))
        elif not self.kv_cache.fits(len(item.prompt_ids) + 1):  # (its prompt and one token: it could never run)
            self.metrics.request_done("rejected")
            item.sink.put(ErrorEvent(400, outgrown(len(item.prompt_ids) + 1, self.kv_cache)))
        else:
            item.start_output(self.tokenizer, self.runner.sampler)
            self.sched.add(ColocatedSeq(str(item.request_id), item.prompt_ids, payload=item,
                                        hashes=self.kv_cache.hashes(item.prompt_ids, item.cache_salt),
                                        reuse=item.reuses_cache))

    def fail_held(self, request_id: str, item: WorkItem | None, error: str) -> bool:
        seq = self.sched.get(request_id)
        if seq is None or (item is not None and seq.payload is not item):
            return False
        self.sched.fail(seq, error)
        self._last_token_at.pop(request_id, None)
        self.metrics.request_done("failed")
        seq.payload.sink.put(ErrorEvent(500, error))
        return True

    def _prefill(self, seq: ColocatedSeq) -> None:
        item: WorkItem = seq.payload
        t0 = time.monotonic()
        item.stamps.mark("scheduled", t0)  # (xpyd.worker.phases)
        try:
            token = prefill_and_sample(self.runner, seq)
        except Exception as e:
            log.exception("prefill failed for %s", seq.request_id)
            self.sched.fail(seq, str(e))
            self.metrics.request_done("failed")
            item.sink.put(ErrorEvent(500, f"prefill failed: {type(e).__name__}: {e}"))
            return
        now = time.monotonic()
        item.stamps.mark("sampled", now)
        self.kv_cache.prompt_done(seq.kv, seq.prompt_len, seq.prompt_ids[len(seq.kv.hashes) * self.kv_cache.block_size:])
        self.metrics.observe_step("prefill", now - t0, 1)
        self.metrics.observe_ttft(now - item.arrival)
        self._emit(seq, token, now)

    def _make_room(self) -> None:
        """The blocks of the next decode step for every running request, preempting the newest while the pool
        has none (``reserve_decode``)."""
        try:
            room = self.sched.reserve_decode(context_len, context_ids)
        except Exception as e:  # (a bug: the scheduler stays consistent; its running requests fail)
            log.exception("making room for the decode step failed")
            for seq in self.sched.running():
                self._fail(seq, f"decode failed: {type(e).__name__}: {e}")
            return
        for _ in room.preempted:
            self.metrics.preempted()
        for seq in room.failed:
            self._last_token_at.pop(seq.request_id, None)
            self.metrics.request_done("failed")
            seq.payload.sink.put(ErrorEvent(500, seq.error))

    def _recompute(self, seq: ColocatedSeq) -> None:
        """A preempted request's KV computed again; it decodes from the next step (nothing sampled now)."""
        ids, cached = seq.recompute, seq.kv.cached_tokens
        t0 = time.monotonic()
        try:
            recompute(self.runner, seq, ids)
        except Exception as e:
            log.exception("recompute failed for %s", seq.request_id)
            self._fail(seq, f"prefill failed: {type(e).__name__}: {e}")
            return
        self.kv_cache.prompt_done(seq.kv, len(ids), ids[len(seq.kv.hashes) * self.kv_cache.block_size:])
        self.metrics.observe_step("prefill", time.monotonic() - t0, 1)
        self._recomputed += len(ids) - cached

    def _fail(self, seq: ColocatedSeq, error: str) -> None:
        self.sched.fail(seq, error)
        self._last_token_at.pop(seq.request_id, None)
        self.metrics.request_done("failed")
        seq.payload.sink.put(ErrorEvent(500, error))

    def _decode_step(self) -> None:
        running = self.sched.running()
        t0 = time.monotonic()
        try:
            new = decode_and_sample(self.runner, self.kv_cache, running)
        except Exception as e:
            log.exception("decode step failed")
            for seq in running:
                self._fail(seq, f"decode failed: {type(e).__name__}: {e}")
            return
        now = time.monotonic()
        self.metrics.observe_step("decode", now - t0, len(running))
        for seq, tok in zip(running, new):
            with self.isolate(seq.request_id, seq.payload):
                stamps = seq.payload.stamps
                if stamps.step_started is None:  # its first decode step (xpyd.worker.phases)
                    stamps.step_started, stamps.step_ended = t0, now
                self.metrics.observe_itl(now - self._last_token_at.get(seq.request_id, now))
                self._emit(seq, tok, now)

    def _emit(self, seq: ColocatedSeq, token: int | None, now: float) -> None:
        """``token`` None: a prompt-only request (max_tokens 0) ends with its prompt."""
        item: WorkItem = seq.payload
        text, finish = item.output.append(token) if token is not None else item.output.end_without_output()
        self._last_token_at[seq.request_id] = now
        cached = seq.kv.cached_tokens if seq.kv is not None else 0
        if finish is not None:
            item.stamps.mark("finished", now)
            self.sched.finish(seq)
            self._last_token_at.pop(seq.request_id, None)
            self.metrics.request_done("finished")
            self.metrics.observe_e2e(now - item.arrival)
        logprobs = item.take_logprobs()
        if text or finish is not None or len(item.output.token_ids) == 1 or logprobs:
            item.sink.put(TokenEvent(text, finish.value if finish else None, len(seq.prompt_ids),
                                     len(item.output.token_ids), cached, logprobs))
