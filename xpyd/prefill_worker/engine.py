"""Prefill engine: runs one prefill at a time and holds the KV until a decode worker pulls it.

Threads: the engine thread (forward passes, scheduling, polling sends and, while any is in flight,
calling the backend's ``progress()`` every iteration; it sleeps until a send's token finishes and wakes
it, or every ``progress_tick`` of a backend that needs one), the signal-server thread (answers decode
workers; starts sends), transfer threads (move bytes). The first two share the scheduler under one lock.

Readiness is pushed: a decode worker claims a request (a lookup without a destination) as soon as it has
it; the moment the prefill ends (or the request fails or expires here), the server thread pushes a
``notify`` to the claimant.

Faults: KV that is not claimed and that no decode worker pulls within ``kv_ttl`` is freed, and a later
lookup for it is answered ``expired``; claimed KV is kept until it is pulled or released, until its
decode worker has sent nothing (heartbeats included) for ``peer_timeout``, until the signal session that
claimed it ends, or at most ``expiry.claim_ttl`` (10 minutes by default); a send to a decode worker silent
that long, or whose session ended, is aborted. Requests that ended here
unpulled (aborted, failed) or sent are remembered for a while so lookups get a clear answer (a sent one:
its first token, for a decode worker whose READY push was lost; ``recent.RequestMemory``); a release that
arrives before its request drops the request on arrival.

Who is served: the signal server opens a session per connection once the decode worker proved the
cluster token (challenge-response, the token never sent: ``xpyd.signal.auth``) and calls this engine
only for open sessions, with the decode worker's address from its authenticated hello; it says when a
decode worker's session ended (``on_session_closed``). A push that could not be delivered changes
nothing here: the decode worker's next lookup is answered from the request's state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Callable

from xpyd import PROTOCOL_VERSION
from xpyd.discovery.types import Role, WorkerInfo
from xpyd.worker.config import WorkerConfig
from xpyd.worker.kv_staging import pool_memory
from xpyd.worker.loop import IDLE_SLEEP
from xpyd.worker.work_item import ErrorEvent, TokenEvent, WorkItem
from xpyd.worker.request import RequestState
from xpyd.worker.stepping import prefill_chunks, sample_first
from xpyd.worker.engine import Abort, PeersLeft, WorkerEngine
from xpyd.netaddr import http_url
from xpyd.prefill_worker.expiry import claim_ttl, late_kv, orphaned, stalled_sends
from xpyd.prefill_worker.peers import DecodePeers, PeerMap
from xpyd.prefill_worker.recent import RequestMemory
from xpyd.prefill_worker.scheduler import Chunk, PrefillScheduler, PrefillSeq
from xpyd.signal import messages as m
from xpyd.signal.request_id import RequestIdError, parse_request_id
from xpyd.prefill_worker.handover import abort_sends, plan_pull, ready_result, send_due
from xpyd.transfer.base import BackendDescriptor, TransferBackend

log = logging.getLogger(__name__)

RELEASED_EARLY = "released before it reached the prefill worker (its client went away)"
MAX_REMEMBERED = 16384  # ended / released-early request ids kept for clear answers
MIN_RETENTION = 60.0  # seconds those ids are kept (at least kv_ttl)
STREAM_PARTS = 4  # a streamed prompt's KV moves in parts of a quarter chunk (the last one after the prompt)
LEFT_PEER_GRACE = 5.0  # KV for a decode worker that left the cluster is kept this long (at most kv_ttl)


class PrefillEngine(WorkerEngine):
    name = "prefill-engine"

    def __init__(self, runner, tokenizer, config: WorkerConfig, transfer: TransferBackend,
                 served_name: str) -> None:
        super().__init__(runner, tokenizer, config, served_name)
        self.transfer = transfer
        self.sched = PrefillScheduler(config.batch_size, self.kv_cache, chunk=config.prefill_chunk)
        self._lock = threading.RLock()  # (reentrant: a request whose work raises under it is failed under it)
        self._peers = DecodePeers()
        self._sends: Counter[str] = Counter()  # KV sends started, by decode worker
        self._kv_compat = self.pool.layout.compat()
        self._memory = RequestMemory(max(MIN_RETENTION, config.kv_ttl), MAX_REMEMBERED)
        self.notify: Callable[[str, m.Message], None] | None = None  # the signal server's push (set by main)
        self._expired = 0
        self._released_on_arrival = 0
        self._undelivered = 0  # notifies the signal server could not send (the decode worker asks again)
        self._orphaned = 0  # requests freed because the session of their decode worker ended
        self._claims: dict[str, set[str]] = {}  # decode worker -> ids of its live claimed requests
        # forward passes, prompt chunks that did not end their prompt, tokens computed, KV parts sent while
        # their prompt was still computing
        self._steps = Counter()

    def start(self, signal_addr: str) -> None:
        """Start after the signal server is bound (its address goes into WorkerInfo)."""
        self.info = WorkerInfo(Role.PREFILL, http_url(self.config.public_host, self.config.port),
                               signal_addr, self.model_id, PROTOCOL_VERSION, self.config.batch_size)
        self.transfer.register(pool_memory(self.pool, self.transfer))
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
                    "transfers_in_flight": len(self.transfer.outstanding()),
                    "peers": self._peers.num_registered, "handshaken": self._peers.num_handshaken,
                    "sends": dict(self._sends),
                    "expired": self._expired, "released_on_arrival": self._released_on_arrival,
                    "notifies_undelivered": self._undelivered, "orphaned": self._orphaned,
                    "prefill_chunk": self.sched.chunk, "prefill_steps": self._steps["steps"],
                    "prefill_partial_chunks": self._steps["partial"], "prefill_tokens": self._steps["tokens"],
                    "kv_stream": self._streams, "kv_parts_streamed": self._steps["streamed_parts"]}

    # --- engine thread -----------------------------------------------------
    def step(self) -> float:
        for item in self.drain_inbox():
            with self._lock:
                if isinstance(item, Abort):
                    with self.isolate(item.request_id):
                        seq = self.sched.get(item.request_id)
                        if self._release(item.request_id):
                            self._record_end(item.request_id, m.LookupStatus.FAILED, "aborted on the prefill "
                                             "worker (its client went away)", seq.claimed)
                        elif item.request_id not in self._memory.ended:
                            # The proxy gave up before the request itself got here (its two HTTP calls raced):
                            # drop it on arrival instead of holding its KV for a whole lease.
                            self._memory.released_early[item.request_id] = True
                elif isinstance(item, PeersLeft):
                    self._drop_peers(item.addrs)
                    for addr in item.joined:  # (one that had left and is back: its KV is kept as any other's)
                        self._peers.joined(addr)
                else:
                    self.admit(item, self._add)
        with self._lock:
            ended, broken = self.sched.poll()
            for seq in broken:  # a part's send failed: the others stop; the request ends when they did
                abort_sends(self.transfer, seq)
                self._record_end(seq.request_id, m.LookupStatus.FAILED, f"KV send failed: {seq.error}", seq.claimed)
            for seq in ended:
                self._ended(seq)
            self._expire(time.monotonic())
            chunks = self.sched.plan(self._peers.live(time.monotonic(), self.config.peer_timeout))
            for chunk in chunks:
                if chunk.start == chunk.seq.kv.cached_tokens and chunk.seq.claimed:  # it just started
                    self._announce(chunk.seq)
            sending = self.sched.sends_in_flight()
        if sending:
            self.transfer.progress()  # (nixl: decode workers READ from our pool; UCX needs our calls)
        if chunks:
            self._run_step(chunks)
        with self._lock:
            self._update_metrics()
            sending = self.sched.sends_in_flight()
        if chunks:
            return 0.0
        tick = self.transfer.progress_tick
        return tick if sending and tick is not None else IDLE_SLEEP  # (a finished send wakes us)

    def _add(self, item: WorkItem) -> None:
        rid = str(item.request_id)
        if self.sched.get(rid) is not None:
            item.sink.put(ErrorEvent(409, f"duplicate request id {rid}"))
            self.metrics.request_done("rejected")
        elif self._memory.released_early.pop(rid, False):
            # Its decode worker gave up on it (aborted or timed out) before it arrived here. Remembered as
            # ended, so a decode worker still waiting for it is answered FAILED, not "unknown".
            claimed = self._memory.claimed_early.pop(rid, False)
            self._record_end(rid, m.LookupStatus.FAILED, RELEASED_EARLY, claimed)
            self._released_on_arrival += 1
            item.sink.put(ErrorEvent(409, f"request {rid} was already released (its decode worker or the proxy "
                                          "gave up on it)"))
            self.metrics.request_done("aborted")
        else:
            item.start_output(self.tokenizer)
            seq = PrefillSeq(rid, item.prompt_ids, payload=item, peer=item.request_id.decode_addr,
                             hashes=self.kv_cache.hashes(item.prompt_ids, item.cache_salt))
            self.sched.add(seq)
            if self._memory.claimed_early.pop(rid, False):
                self._claim(seq)

    def _expire(self, now: float) -> None:
        """Free KV that waits for a pull in vain, abort sends to silent decode workers (``expiry``); later
        lookups are answered 'expired' / 'failed'."""
        ttl, silent = self.config.kv_ttl, self.config.peer_timeout
        self._peers.forget_left(before=now - ttl)  # whatever they held has expired by now
        for seq, why in late_kv(self.sched.held(), self._peers, now, ttl, silent, min(ttl, LEFT_PEER_GRACE),
                                claim_ttl(ttl)):
            self.sched.release(seq.request_id, RequestState.FAILED)
            self._ended(seq)
            self._expired += 1
            self._record_end(seq.request_id, m.LookupStatus.EXPIRED, f"KV expired: {why}, freed", seq.claimed)
            log.info("request %s: KV %s, freed", seq.request_id, why)
        for seq, why in stalled_sends(self.sched.sending(), self._peers, now, silent):
            self.sched.release(seq.request_id, RequestState.FAILED)  # (ends once its aborted sends are polled)
            abort_sends(self.transfer, seq)
            self._record_end(seq.request_id, m.LookupStatus.FAILED, f"KV send aborted: {why}", seq.claimed)
            log.warning("request %s: KV send aborted: %s", seq.request_id, why)
        self._memory.expire()

    def _record_end(self, request_id: str, status: m.LookupStatus, error: str, claimed: bool) -> None:
        """Remember how a request ended here unpulled; tell the decode worker that claimed it."""
        result = m.LookupResult(request_id, status, error=error)
        self._memory.ended[request_id] = result
        if claimed:
            self._push(request_id, result)

    def _push(self, request_id: str, result: m.LookupResult) -> None:
        peer = _decode_addr_of(request_id)
        if self.notify is not None and peer is not None:
            self.notify(peer, m.Notify((result,)))

    def _update_metrics(self) -> None:
        self.metrics.set_queue(self.sched.num_waiting, self.sched.num_running, self.sched.num_transferring)
        self.metrics.set_kv(self.pool.used_bytes(), self.pool.layout.total_bytes)
        self.metrics.set_kv_cache(self.kv_cache.stats())
        self.publish_kv_events()

    def _claim(self, seq: PrefillSeq) -> None:
        """Its decode worker claimed it (notified when ready; its KV waits for that worker's session)."""
        seq.claimed = True
        self._claims.setdefault(seq.peer, set()).add(seq.request_id)

    def _ended(self, seq: PrefillSeq) -> None:
        """``seq`` reached a final state: count it (and its pull's bytes); if its prompt never finished, its
        HTTP call still waits: answer it."""
        claims = self._claims.get(seq.peer)
        if claims is not None:
            claims.discard(seq.request_id)
        plan = seq.pull.plan if seq.pull is not None else None
        if plan is not None:
            ok = seq.state is RequestState.FINISHED
            self.metrics.transfer_done("send", plan.nbytes, time.monotonic() - plan.started, ok)
            if ok:  # sent: a re-ask (its READY push may have been lost) is answered with the first token
                self._memory.ended[seq.request_id] = m.LookupResult(seq.request_id, m.LookupStatus.SENDING,
                                                                    seq.first_token, seq.prompt_len)
        self.metrics.request_done(_outcome(seq))
        if seq.first_token is None and seq.payload is not None and not seq.payload.sink.ended:
            sink = seq.payload.sink
            if seq.state is RequestState.FAILED:
                sink.put(ErrorEvent(500, seq.error or "prefill failed"))
            else:
                sink.put(ErrorEvent(409, f"request {seq.request_id} was released before its prefill ran to completion"))

    def _announce(self, seq: PrefillSeq) -> None:
        """A claimed request started: tell its decode worker the prompt's facts, so it can pull the KV as it
        is computed (when this worker streams)."""
        if self._streams:
            self._push(seq.request_id, self._ready_result(seq, m.LookupStatus.PREFILLING))

    def _run_step(self, chunks: list[Chunk]) -> None:
        """One forward pass over the step's chunks; requests whose prompt it ends get their first token.
        If a forward over several requests raises, each is run alone so the failure stays with its own."""
        t0 = time.monotonic()
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
        last = [(c, row) for c, row in zip(chunks, logits) if c.last]
        tokens = sample_first(last)
        with self._lock:
            for chunk in chunks:
                if not chunk.last:
                    with self.isolate(chunk.seq.request_id, chunk.seq.payload):
                        self.kv_cache.cache_blocks(chunk.seq.kv, chunk.end)  # (a later prompt may share them)
                        self.sched.chunk_done(chunk)
                        if chunk.seq.state.is_final:  # released while its chunk ran
                            self._ended(chunk.seq)
                        elif chunk.seq.pull is not None:  # the KV of this chunk's full blocks goes now
                            self._steps["streamed_parts"] += send_due(self.transfer, self.sched, chunk.seq,
                                                                      self._wake)
        for (chunk, _), token in zip(last, tokens):
            with self.isolate(chunk.seq.request_id, chunk.seq.payload):
                self._prefilled(chunk.seq, token, now)

    def _prefill_failed(self, seq: PrefillSeq, e: Exception) -> None:
        log.error("prefill failed for %s", seq.request_id, exc_info=e)
        seq.payload.sink.put(ErrorEvent(500, f"prefill failed: {type(e).__name__}: {e}"))
        with self._lock:
            self.sched.fail_running(seq, str(e))
            abort_sends(self.transfer, seq)  # (parts of its first chunks may be on their way)
            self._record_end(seq.request_id, m.LookupStatus.FAILED, f"prefill failed: {type(e).__name__}",
                             seq.claimed)
            if seq.state.is_final:
                self._ended(seq)

    def _prefilled(self, seq: PrefillSeq, token: int, now: float) -> None:
        item: WorkItem = seq.payload
        self.metrics.observe_ttft(now - item.arrival)
        text, finish = item.output.append(token)
        cached = seq.kv.cached_tokens
        with self._lock:
            self.kv_cache.prompt_done(seq.kv, seq.prompt_len, ())
            self.sched.prefilled(seq, token, time.monotonic())
            if seq.state.is_final:  # aborted while running
                self._ended(seq)
            elif seq.pull is not None:  # streamed: the parts still due go now (the last one at least)
                send_due(self.transfer, self.sched, seq, self._wake)
            if not seq.state.is_final and seq.claimed:  # its decode worker waits for this: tell it now (under the lock: a claim
                # that arrives later is answered READY by the lookup itself)
                self._push(seq.request_id, self._ready_result(seq, m.LookupStatus.READY))
        item.sink.put(TokenEvent(text, finish.value if finish else None, len(seq.prompt_ids), 1, cached))

    def _ready_result(self, seq: PrefillSeq, status: m.LookupStatus) -> m.LookupResult:
        part_blocks = 0  # one part (a prompt one step computes has nothing to overlap its KV with)
        if status is m.LookupStatus.PREFILLING and seq.prompt_len - seq.kv.cached_tokens > self.sched.chunk:
            part_blocks = max(1, self.sched.chunk // STREAM_PARTS // self.kv_cache.block_size)
        return ready_result(seq, status, self.kv_cache.block_size, part_blocks)

    @property
    def _streams(self) -> bool:
        """Does this worker send a request's KV while its prompt computes (chunked, streaming on)?"""
        return self.sched.chunk > 0 and self.config.kv_stream

    def fail_held(self, request_id: str, item: WorkItem | None, error: str) -> bool:
        with self._lock:
            seq = self.sched.get(request_id)
            if seq is None or (item is not None and seq.payload is not item):
                return False
            seq.payload.sink.put(ErrorEvent(500, error))
            seq.error = seq.error or error
            # (in a step, or with sends in flight, which are aborted: it ends, and is counted, when they end)
            self.sched.release(request_id, RequestState.FAILED)
            abort_sends(self.transfer, seq)
            self._record_end(request_id, m.LookupStatus.FAILED, error, seq.claimed)
            if seq.state.is_final:
                self._ended(seq)
        return True

    def _release(self, request_id: str) -> int:
        seq = self.sched.release(request_id)
        if seq is None:
            return 0
        abort_sends(self.transfer, seq)
        if seq.state.is_final:
            self._ended(seq)
        return 1

    def _drop_peers(self, addrs: frozenset[str]) -> None:
        """Decode workers left the cluster. One that drains (SIGTERM) still pulls what it has in flight, so
        it is still served; the KV it has not pulled expires after LEFT_PEER_GRACE instead of kv_ttl
        (one that was killed never pulls it). Cached transfer connections to it are closed."""
        now = time.monotonic()
        for addr in addrs:
            peer = self._peers.leave(addr, now)
            if peer is not None:
                self.transfer.forget_peer(peer.transfer.address)
            log.info("decode worker %s left: its unpulled KV expires in %gs", addr,
                     min(self.config.kv_ttl, LEFT_PEER_GRACE))

    def _wake(self) -> None:
        self.post(None)

    def shutdown(self) -> None:
        self.transfer.close()

    # --- signal plane (server thread) --------------------------------------
    @property
    def cluster_token(self) -> str | None:
        """What each decode worker's signal session proves (the signal server checks it)."""
        return self.config.cluster_token

    def on_session_closed(self, identity: str, why: str) -> None:
        """The signal session of decode worker ``identity`` ended: it shakes hands again on its next one;
        what that session claimed (held KV, sends in flight, claims of requests still to come) is freed
        (``expiry.orphaned``): its decode worker failed those requests, or is a new process that never
        heard of them."""
        with self._lock:
            self._peers.close(identity)
            for rid in [r for r in self._memory.claimed_early if _decode_addr_of(r) == identity]:
                self._memory.claimed_early.pop(rid, None)
            held, sending = orphaned(self.sched.held(), self.sched.sending(), identity)
            error = f"its decode worker's signal session ended ({why})"
            for seq in held:
                self.sched.release(seq.request_id, RequestState.FAILED)
                self._ended(seq)
                self._record_end(seq.request_id, m.LookupStatus.EXPIRED, f"KV freed: {error}", False)
            for seq in sending:
                self.sched.release(seq.request_id, RequestState.FAILED)  # (ends once its aborted sends are polled)
                abort_sends(self.transfer, seq)
                self._record_end(seq.request_id, m.LookupStatus.FAILED, f"KV send aborted: {error}", False)
            self._orphaned += len(held) + len(sending)
            self._expired += len(held)  # (freed unpulled, as KV that expires)
            for rid in self._claims.pop(identity, ()):  # not prefilled yet: nobody waits for a notify now
                seq = self.sched.get(rid)
                if seq is not None and not seq.state.is_final and not seq.cancel_requested:
                    seq.claimed = False  # (kv_ttl from now on: the worker's next session may claim it again)
        if held or sending:
            log.info("decode worker %s: %d claimed requests freed, %d sends aborted: %s", identity, len(held),
                     len(sending), error)
            self.post(None)  # (the engine polls the aborted sends)

    def on_undelivered(self, identity: str, msg: m.Message, why: str) -> None:
        with self._lock:
            self._undelivered += 1

    def on_handshake(self, identity: str, msg: m.Handshake) -> m.HandshakeReply:
        if msg.model_id != self.model_id:
            return m.HandshakeReply(False, f"model mismatch: prefill serves {self.model_id!r}, "
                                           f"decode serves {msg.model_id!r}", self.model_id)
        if msg.kv_compat != self._kv_compat:
            return m.HandshakeReply(False, f"KV layout mismatch: prefill {self._kv_compat}, "
                                           f"decode {msg.kv_compat}", self.model_id)
        with self._lock:
            self._peers.accept(identity, time.monotonic())
        return m.HandshakeReply(True, None, self.model_id)

    def _known(self, identity: str) -> bool:
        """Has this decode worker shaken hands? (marks it active)"""
        with self._lock:
            return self._peers.heard_from(identity, time.monotonic())

    def on_heartbeat(self, identity: str, msg: m.Heartbeat) -> m.HeartbeatReply | m.ErrorReply:
        return m.HeartbeatReply() if self._known(identity) else m.ErrorReply("handshake first")

    def on_kv_map_init(self, identity: str, msg: m.KVMapInit) -> m.KVMapReply | m.ErrorReply:
        if not self._known(identity):
            return m.ErrorReply("handshake first")
        try:
            desc = BackendDescriptor.from_dict(msg.transfer)
        except (ValueError, TypeError, KeyError) as e:
            return m.KVMapReply(False, f"bad transfer descriptor: {e}")
        if desc.backend != self.transfer.name:
            return m.KVMapReply(False, f"transfer backend mismatch: prefill uses {self.transfer.name}, "
                                       f"decode uses {desc.backend}")
        if msg.block_bytes != self.pool.layout.block_bytes:
            return m.KVMapReply(False, f"KV block size mismatch: prefill blocks hold {self.pool.layout.block_bytes} "
                                       f"bytes, decode blocks {msg.block_bytes}")
        if msg.block_bytes * msg.num_blocks > desc.buffer_size:
            return m.KVMapReply(False, "KV map does not fit the registered buffer")
        with self._lock:
            self._peers.register(identity, PeerMap(desc, msg.block_bytes, msg.num_blocks))
        return m.KVMapReply(True)

    def on_lookup_all(self, identity: str, msg: m.LookupAll) -> m.LookupReply | m.ErrorReply:
        if not self._known(identity):
            return m.ErrorReply("handshake first")
        results = []
        with self._lock:
            peer = self._peers.pool(identity)
            for e in msg.entries:
                results.append(self._lookup_isolated(identity, peer, e))
        return m.LookupReply(tuple(results))

    def _lookup_isolated(self, identity: str, peer: PeerMap | None, e: m.LookupEntry) -> m.LookupResult:
        """``_lookup_one``; if it raises, that request fails here and the decode worker is told so."""
        with self.isolate(e.request_id):
            return self._lookup_one(identity, peer, e)
        ended = self._memory.ended.get(e.request_id)
        error = ended.error if ended is not None and ended.error else "internal error"
        return m.LookupResult(e.request_id, m.LookupStatus.FAILED, error=error)

    def _lookup_one(self, identity: str, peer: PeerMap | None, e: m.LookupEntry) -> m.LookupResult:
        S = m.LookupStatus
        try:
            rid = parse_request_id(e.request_id)
        except RequestIdError as err:
            return m.LookupResult(e.request_id, S.FAILED, error=str(err))
        if rid.decode_addr != identity:
            return m.LookupResult(e.request_id, S.FAILED, error="request belongs to another decode worker")
        seq = self.sched.get(e.request_id)
        if seq is None:
            ended = self._memory.ended.get(e.request_id)
            if ended is not None:
                return ended
            if e.request_id in self._memory.released_early:  # refused when it arrives: do not wait for it
                return m.LookupResult(e.request_id, S.FAILED, error=RELEASED_EARLY)
            if e.dest_blocks is None:
                self._memory.claimed_early[e.request_id] = True  # claimed on arrival; notified when ready
            return m.LookupResult(e.request_id, S.UNKNOWN)
        if e.dest_blocks is None:
            self._claim(seq)  # notified when ready (or ended); its KV waits for this decode worker
        streaming = seq.state is RequestState.RUNNING and self._streams
        if seq.state is RequestState.WAITING or (seq.state is RequestState.RUNNING and not streaming):
            return m.LookupResult(e.request_id, S.NOT_READY)
        if e.dest_blocks is None:
            if streaming:
                return self._ready_result(seq, S.PREFILLING)
            return self._ready_result(seq, S.READY if seq.pull is None else S.SENDING)
        # A pull (only the decode worker named in the request id gets here).
        if peer is None:
            return m.LookupResult(e.request_id, S.FAILED, error="kv_map_init first")
        if seq.pull is None:
            plan = plan_pull(self.pool, seq, e, peer, time.monotonic())
            if isinstance(plan, str):
                return m.LookupResult(e.request_id, S.FAILED, error=plan)
            self.sched.start_pull(e.request_id, len(plan.parts), plan)
            if len(plan.parts) > 1:  # the last chunk computes the last part alone: only it is left to move
                seq.split_at = plan.parts[-2].ready_at
            self._sends[identity] += 1
            if send_due(self.transfer, self.sched, seq, self._wake):
                self.post(None)  # wake the engine to poll the sends
        if streaming:
            return self._ready_result(seq, S.PREFILLING)
        return m.LookupResult(e.request_id, S.SENDING, seq.first_token, seq.prompt_len)

    def on_release(self, identity: str, msg: m.Release) -> m.ReleaseReply | m.ErrorReply:
        if not self._known(identity):
            return m.ErrorReply("handshake first")
        n = 0
        with self._lock:
            for rid in msg.request_ids:
                if _decode_addr_of(rid) != identity:
                    continue  # not this decode worker's request (or not a request id): ignored
                if self._release(rid):
                    n += 1
                elif rid not in self._memory.ended:
                    self._memory.released_early[rid] = True  # dropped if it arrives later
        return m.ReleaseReply(n)


def _outcome(seq: PrefillSeq) -> str:
    """How a request ended here. KV released unpulled because the first token ended the
    request (decode did not need it) is a finished request, not an aborted one."""
    if seq.state is RequestState.ABORTED and seq.payload.output.finished is not None:
        return "finished"
    return seq.state.value


def _decode_addr_of(request_id: str) -> str | None:
    try:
        return parse_request_id(request_id).decode_addr
    except RequestIdError:
        return None

