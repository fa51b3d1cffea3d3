"""Prefill engine: runs one prefill at a time and holds the KV until a decode worker pulls it.

Threads: the engine thread (forward passes, scheduling, polling sends and, while any is in flight,
calling the KV connector's ``progress()`` every iteration; it sleeps until a send ends and wakes it, or
every ``progress_tick`` of a backend that needs one), the signal-server thread (answers decode workers,
``signal_plane``; starts sends), transfer threads (move bytes). A pull's parts, their bytes and their sends
are the KV connector's (``xpyd.worker.kv_connector_send``: the engine names blocks and requests, never bytes). The first two share the requests
held (the scheduler, the decode workers served, what is remembered: ``held``) under one lock.

Readiness is pushed: a decode worker claims a request (a lookup without a destination) as soon as it has
it; the moment the prefill ends (or the request fails or expires here), the server thread pushes a
``notify`` to the claimant.

Faults: KV that is not claimed and that no decode worker pulls within ``kv_ttl`` is freed, and a later
lookup for it is answered ``expired``; claimed KV is kept until it is pulled or released, until the
signal session that claimed it ends (its connection closes, or answers no ZMTP heartbeat for
``peer_timeout``), or at most ``expiry.claim_ttl`` (10 minutes by default); a send to a decode worker whose
session ended is aborted. Requests that ended here
unpulled (aborted, failed) or sent are remembered for a while so lookups get a clear answer (a sent one:
its first token, for a decode worker whose READY push was lost; ``recent.RequestMemory``); a release that
arrives before its request drops the request on arrival.

Who is served: the signal server opens a session per connection once the decode worker proved the
cluster token (challenge-response, the token never sent: ``xpyd.signal.auth``) and calls the engine's
signal plane (``signal_plane.PrefillSignalPlane``) only for open sessions, with the decode worker's
address from its authenticated hello; it says when a decode worker's session ended
(``on_session_closed``). A push that could not be delivered changes nothing here: the decode worker's
next lookup is answered from the request's state.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable

from xpyd import PROTOCOL_VERSION
from xpyd.discovery.types import Role, WorkerInfo
from xpyd.worker.config import WorkerConfig
from xpyd.worker.kv_connector_send import KVSender, sender_for
from xpyd.worker.loop import IDLE_SLEEP
from xpyd.worker.work_item import ErrorEvent, TokenEvent, WorkItem
from xpyd.worker.request import RequestState
from xpyd.worker.stepping import prefill_chunks, sample_first
from xpyd.worker.engine import Abort, PeersLeft, WorkerEngine
from xpyd.netaddr import http_url
from xpyd.prefill_worker.expiry import claim_ttl, late_kv
from xpyd.prefill_worker.held import RELEASED_EARLY, HeldRequests
from xpyd.prefill_worker.scheduler import Chunk, PrefillScheduler, PrefillSeq
from xpyd.prefill_worker.signal_plane import PrefillSignalPlane
from xpyd.prefill_worker.step_cost import StepCost
from xpyd.signal import messages as m

log = logging.getLogger(__name__)

ENDED_HERE = "the request ended on the prefill worker with its first token: it needs no decode step"
LEFT_PEER_GRACE = 5.0  # KV for a decode worker that left the cluster is kept this long (at most kv_ttl)


class PrefillEngine(WorkerEngine):
    name = "prefill-engine"

    def __init__(self, runner, tokenizer, config: WorkerConfig, kv: KVSender | object, served_name: str) -> None:
        """``kv``: the KV connector, or the transfer backend one is made over (``kv_connector_send.sender_for``)."""
        super().__init__(runner, tokenizer, config, served_name)
        self.connector = sender_for(kv)
        self.connector.bind(self.pool, self._wake)
        self.sched = PrefillScheduler(config.batch_size, self.kv_cache, chunk=config.prefill_chunk,
                                      cost=StepCost() if config.prefill_chunk else None)
        # What this thread and the signal server's share (under held.lock), and the server's handler.
        self.held = HeldRequests(self.sched, self.connector, self.metrics, config.kv_stream, config.kv_ttl)
        self._lock, self._peers = self.held.lock, self.held.peers
        self.signal_plane = PrefillSignalPlane(self.held, self.model_id, self.peer_compat(),
                                               config.cluster_token, self.isolate, self._wake,
                                               config.accepted_tokens)
        # forward passes, prompt chunks that did not end their prompt, tokens computed, KV parts sent while
        # their prompt was still computing
        self._steps = Counter()

    @property
    def notify(self) -> Callable[[str, m.Message], None] | None:
        """The signal server's push (set by main): how a claimant is told its request is ready or ended."""
        return self.held.notify

    @notify.setter
    def notify(self, push: Callable[[str, m.Message], None] | None) -> None:
        self.held.notify = push

    def start(self, signal_addr: str) -> None:
        """Start after the signal server is bound (its address goes into WorkerInfo)."""
        self.info = WorkerInfo(Role.PREFILL, http_url(self.config.public_host, self.config.port),
                               signal_addr, self.model_id, PROTOCOL_VERSION, self.config.batch_size)
        self.connector.register()
        self.start_thread()

    # --- HTTP side ---------------------------------------------------------
    def idle(self) -> bool:
        with self._lock:
            return not self.sched.has_work()

    def stats(self) -> dict:
        with self._lock:
            held = self.sched.num_waiting + self.sched.num_running + self.sched.num_transferring
            return {"role": "prefill", "waiting": self.sched.num_waiting, "running": self.sched.num_running,
                    "transferring": self.sched.num_transferring, "requests_held": held,
                    "kv_used_bytes": self.pool.used_bytes(), **self.kv_cache.stats(),
                    "queued_tokens": self.sched.queued_tokens(),
                    "transfers_in_flight": self.connector.in_flight(),
                    "peers": self._peers.num_registered, "handshaken": self._peers.num_handshaken,
                    "sends": dict(self.held.sends),
                    "expired": self.held.counts["expired"],
                    "released_early": self.held.counts["released_early"],
                    "released_on_arrival": self.held.counts["released_on_arrival"],
                    "notifies_undelivered": self.held.counts["notifies_undelivered"],
                    "orphaned": self.held.counts["orphaned"],
                    "prefill_chunk": self.sched.chunk, "prefill_step_cost": self._step_cost(), "prefill_steps": self._steps["steps"],
                    "prefill_partial_chunks": self._steps["partial"], "prefill_tokens": self._steps["tokens"],
                    "kv_stream": self.held.streams, "kv_parts_streamed": self._steps["streamed_parts"]}

    def _step_cost(self) -> dict | None:
        """The learned cost of a chunked step (None: unchunked, or not learned yet)."""
        cost = self.sched.cost
        if cost is None or not cost.known:
            return None
        c = cost.coefficients
        return {"overhead_s": c.overhead, "per_token_s": c.per_token, "per_pair_s": c.per_pair,
                "step_s": cost.step_seconds([(0, self.sched.chunk)]), "steps_seen": cost.steps}

    # --- engine thread -----------------------------------------------------
    def step(self) -> float:
        for item in self.drain_inbox():
            with self._lock:
                if isinstance(item, Abort):
                    with self.isolate(item.request_id):
                        seq = self.sched.get(item.request_id)
                        if self.held.release(item.request_id):
                            self.held.record_end(item.request_id, m.LookupStatus.FAILED, "aborted on the "
                                                 "prefill worker (its client went away)", seq.claimed)
                        elif item.request_id not in self.held.memory.ended:
                            # The proxy gave up before the request itself got here (its two HTTP calls raced):
                            # drop it on arrival instead of holding its KV for a whole lease.
                            self.held.memory.released_early[item.request_id] = True
                            if self.held.memory.claimed_early.pop(item.request_id, False):  # its decode worker
                                # asked first and waits to be told: tell it now, not at its timeout
                                self.held.record_end(item.request_id, m.LookupStatus.FAILED, RELEASED_EARLY, True)
                elif isinstance(item, PeersLeft):
                    self._drop_peers(item.addrs)
                    for addr in item.joined:  # (one that had left and is back: its KV is kept as any other's)
                        self._peers.joined(addr)
                else:
                    self.admit(item, self._add)
        with self._lock:
            ended, broken = self.sched.poll()
            for seq in broken:  # a part's send failed: the others stop; the request ends when they did
                self.connector.abort(seq)
                self.held.record_end(seq.request_id, m.LookupStatus.FAILED, f"KV send failed: {seq.error}",
                                     seq.claimed)
            for seq in ended:
                self.held.ended(seq)
            self._expire(time.monotonic())
            chunks = self.sched.plan()
            for chunk in chunks:
                if chunk.start == chunk.seq.kv.cached_tokens and chunk.seq.claimed:  # it just started
                    self._announce(chunk.seq)
            sending = self.sched.sends_in_flight()
        if sending:
            self.connector.progress()  # (nixl: decode workers READ from our pool; UCX needs our calls)
        if chunks:
            self._run_step(chunks)
        with self._lock:
            self._update_metrics()
            sending = self.sched.sends_in_flight()
        if chunks:
            return 0.0
        tick = self.connector.progress_tick
        return tick if sending and tick is not None else IDLE_SLEEP  # (a finished send wakes us)

    def _add(self, item: WorkItem) -> None:
        rid = str(item.request_id)
        if self.sched.get(rid) is not None:
            item.sink.put(ErrorEvent(409, f"duplicate request id {rid}"))
            self.metrics.request_done("rejected")
        elif self.held.memory.released_early.pop(rid, False):
            # Its decode worker gave up on it (aborted or timed out) before it arrived here. Remembered as
            # ended, so a decode worker still waiting for it is answered FAILED, not "unknown".
            claimed = self.held.memory.claimed_early.pop(rid, False)
            self.held.record_end(rid, m.LookupStatus.FAILED, RELEASED_EARLY, claimed)
            self.held.counts["released_on_arrival"] += 1
            item.sink.put(ErrorEvent(409, f"request {rid} was already released (its decode worker or the proxy "
                                          "gave up on it)"))
            self.metrics.request_done("aborted")
        else:
            try:
                item.start_output(self.tokenizer, self.runner.sampler)
            except ValueError as e:  # a migrated request's output that cannot be replayed
                item.sink.put(ErrorEvent(400, str(e)))
                self.metrics.request_done("rejected")
                return
            seq = PrefillSeq(rid, item.prompt_ids, payload=item, peer=item.request_id.decode_addr,
                             hashes=self.kv_cache.hashes(item.prompt_ids, item.cache_salt), reuse=item.reuses_cache)
            self.sched.add(seq)
            if self.held.memory.claimed_early.pop(rid, False):
                self.held.claim(seq)

    def _expire(self, now: float) -> None:
        """Free KV that waits for a pull in vain (``expiry``); later lookups are answered 'expired'."""
        ttl = self.config.kv_ttl
        self._peers.forget_left(before=now - ttl)  # whatever they held has expired by now
        for seq, why in late_kv(self.sched.held(), self._peers, now, ttl, min(ttl, LEFT_PEER_GRACE),
                                claim_ttl(ttl)):
            self.sched.release(seq.request_id, RequestState.FAILED)
            self.held.ended(seq)
            self.held.counts["expired"] += 1
            self.held.record_end(seq.request_id, m.LookupStatus.EXPIRED, f"KV expired: {why}, freed", seq.claimed)
            log.info("request %s: KV %s, freed", seq.request_id, why)
        self.held.memory.expire()

    def _update_metrics(self) -> None:
        self.metrics.set_queue(self.sched.num_waiting, self.sched.num_running, self.sched.num_transferring)
        self.metrics.set_kv(self.pool.used_bytes(), self.pool.layout.total_bytes)
        self.metrics.set_kv_cache(self.kv_cache.stats())
        self.publish_kv_events()

    def _announce(self, seq: PrefillSeq) -> None:
        """A claimed request started: tell its decode worker the prompt's facts, so it can pull the KV as it
        is computed (when this worker streams)."""
        if self.held.streams:
            self.held.push(seq.request_id, self.held.ready_result(seq, m.LookupStatus.PREFILLING))

    def _log_step(self, chunks: list[Chunk], seconds: float) -> None:
        """A debug line per step (XPYD_DEBUG=1): each chunk's request, tokens [start, end) of its prompt's length,
        the step's time and what the learned cost predicted for it."""
        cost = self.sched.cost
        spans = [(c.start, c.end - c.start) for c in chunks]
        predicted = cost.step_seconds(spans) * 1000 if cost is not None and cost.known else float("nan")
        log.debug("step %.1f ms (predicted %.1f ms): %s", seconds * 1000, predicted,
                  ", ".join(f"{c.seq.request_id[-8:]} [{c.start},{c.end})/{c.seq.prompt_len}" for c in chunks))

    def _run_step(self, chunks: list[Chunk]) -> None:
        """One forward pass over the step's chunks; requests whose prompt it ends get their first token.
        If a forward over several requests raises, each is run alone so the failure stays with its own."""
        t0 = time.monotonic()
        for chunk in chunks:
            chunk.seq.payload.stamps.mark("scheduled", t0)  # (its first chunk's pass: xpyd.worker.phases)
        try:
            logits = prefill_chunks(self.runner, chunks)
        except Exception as e:
            if len(chunks) > 1:
                for chunk in chunks:
                    self._run_step([chunk])
                return
            self._prefill_failed(chunks[0].seq, e)
            return
        now = time.monotonic()
        self.metrics.observe_step("prefill", now - t0, len(chunks))
        self._steps.update(steps=1, partial=sum(not c.last for c in chunks), tokens=sum(c.end - c.start for c in chunks))
        self.held.steps += 1  # (read under the lock by lookups: a queued request's decode worker sees progress)
        last = [(c, row) for c, row in zip(chunks, logits) if c.last]
        tokens = sample_first(self.runner, last)
        with self._lock:
            if log.isEnabledFor(logging.DEBUG):
                self._log_step(chunks, now - t0)
            if self.sched.cost is not None:  # (what the next steps are sized by)
                self.sched.cost.observe([(c.start, c.end - c.start) for c in chunks], now - t0)
            for chunk in chunks:
                if not chunk.last:
                    with self.isolate(chunk.seq.request_id, chunk.seq.payload):
                        self.kv_cache.cache_blocks(chunk.seq.kv, chunk.end)  # (a later prompt may share them)
                        self.sched.chunk_done(chunk)
                        if chunk.seq.state.is_final:  # released while its chunk ran
                            self.held.ended(chunk.seq)
                        elif chunk.seq.pull is not None:  # the KV of this chunk's full blocks goes now
                            self._steps["streamed_parts"] += self.connector.send_due(self.sched, chunk.seq)
        for (chunk, _), token in zip(last, tokens):
            with self.isolate(chunk.seq.request_id, chunk.seq.payload):
                self._prefilled(chunk.seq, token, now)

    def _prefill_failed(self, seq: PrefillSeq, e: Exception) -> None:
        log.error("prefill failed for %s", seq.request_id, exc_info=e)
        seq.payload.sink.put(ErrorEvent(500, f"prefill failed: {type(e).__name__}: {e}"))
        with self._lock:
            self.sched.fail_running(seq, str(e))
            self.connector.abort(seq)  # (parts of its first chunks may be on their way)
            self.held.record_end(seq.request_id, m.LookupStatus.FAILED, f"prefill failed: {type(e).__name__}",
                                 seq.claimed)
            if seq.state.is_final:
                self.held.ended(seq)

    def _prefilled(self, seq: PrefillSeq, token: int | None, now: float) -> None:
        """The prompt is computed and ``token`` sampled (None: a prompt-only request, max_tokens 0). A request
        that ended with it (max_tokens 1, an end-of-sequence or stop token, or none) needs no decode step: its
        KV is freed now (its blocks stay in the prefix cache), and a decode worker that claimed it is told."""
        item: WorkItem = seq.payload
        item.stamps.mark("sampled", time.monotonic())
        self.metrics.observe_ttft(now - item.arrival)
        text, finish = item.output.append(token) if token is not None else item.output.end_without_output()
        prompt_tokens = item.prompt_tokens(len(seq.prompt_ids))  # (a migrated request's: without its output)
        cached = min(seq.kv.cached_tokens, prompt_tokens)
        event = TokenEvent(text, finish.value if finish else None, prompt_tokens,
                           0 if token is None else len(item.output.token_ids), cached, item.take_logprobs(),
                           item.new_ids() if token is not None else ())
        with self._lock:
            self.kv_cache.prompt_done(seq.kv, seq.prompt_len, ())
            self.sched.prefilled(seq, token, time.monotonic())
            if seq.state.is_final:  # aborted while running
                self.held.ended(seq)
            elif finish is not None:
                self.held.release(seq.request_id)
                self.held.record_end(seq.request_id, m.LookupStatus.FAILED, ENDED_HERE, seq.claimed)
                item.sink.put(event)  # (last: the client has its answer once the request is counted as ended)
                return
            elif seq.pull is not None:  # streamed: the parts still due go now (the last one at least)
                self.connector.send_due(self.sched, seq)
            if not seq.state.is_final and seq.claimed:  # its decode worker waits for this: tell it now (under the lock: a claim
                # that arrives later is answered READY by the lookup itself)
                self.held.push(seq.request_id, self.held.ready_result(seq, m.LookupStatus.READY))
        item.sink.put(event)

    def fail_held(self, request_id: str, item: WorkItem | None, error: str) -> bool:
        with self._lock:
            seq = self.sched.get(request_id)
            if seq is None or (item is not None and seq.payload is not item):
                return False
            seq.payload.sink.put(ErrorEvent(500, error))
            seq.error = seq.error or error
            # (in a step, or with sends in flight, which are aborted: it ends, and is counted, when they end)
            self.sched.release(request_id, RequestState.FAILED)
            self.connector.abort(seq)
            self.held.record_end(request_id, m.LookupStatus.FAILED, error, seq.claimed)
            if seq.state.is_final:
                self.held.ended(seq)
        return True

    def _drop_peers(self, addrs: frozenset[str]) -> None:
        """Decode workers left the cluster. One that drains (SIGTERM) still pulls what it has in flight, so
        it is still served; the KV it has not pulled expires after LEFT_PEER_GRACE instead of kv_ttl
        (one that was killed never pulls it). Cached transfer connections to it are closed."""
        now = time.monotonic()
        for addr in addrs:
            peer = self._peers.leave(addr, now)
            if peer is not None:
                self.connector.forget_peer(peer)
            log.info("decode worker %s left: its unpulled KV expires in %gs", addr,
                     min(self.config.kv_ttl, LEFT_PEER_GRACE))

    def _wake(self) -> None:
        self.post(None)

    def shutdown(self) -> None:
        self.connector.close()

    # --- signal plane (server thread) --------------------------------------
    # The signal server's handler is ``signal_plane``; the engine answers the same for callers that hold it.
    @property
    def cluster_token(self) -> str | None:
        return self.signal_plane.cluster_token

    @property
    def accepted_tokens(self) -> tuple[str, ...]:
        return self.signal_plane.accepted_tokens

    def on_session_closed(self, identity: str, why: str) -> None:
        self.signal_plane.on_session_closed(identity, why)

    def on_undelivered(self, identity: str, msg: m.Message, why: str) -> None:
        self.signal_plane.on_undelivered(identity, msg, why)

    def on_handshake(self, identity: str, msg: m.Handshake) -> m.HandshakeReply:
        return self.signal_plane.on_handshake(identity, msg)

    def on_heartbeat(self, identity: str, msg: m.Heartbeat) -> m.HeartbeatReply | m.ErrorReply:
        return self.signal_plane.on_heartbeat(identity, msg)

    def on_kv_map_init(self, identity: str, msg: m.KVMapInit) -> m.KVMapReply | m.ErrorReply:
        return self.signal_plane.on_kv_map_init(identity, msg)

    def on_lookup_all(self, identity: str, msg: m.LookupAll) -> m.LookupReply | m.ErrorReply:
        return self.signal_plane.on_lookup_all(identity, msg)

    def on_release(self, identity: str, msg: m.Release) -> m.ReleaseReply | m.ErrorReply:
        return self.signal_plane.on_release(identity, msg)
