"""What a prefill worker answers its decode workers: the signal server's handler (``SignalHandler``), called
from the server thread, only for open sessions (the decode worker proved the cluster token), ``identity``
being the decode worker's address from its authenticated hello.

- ``on_handshake``: the model and the KV layout must match; the decode worker is then served (``peers``);
  ``on_kv_map_init`` registers its KV pool (where pulls write); ``on_heartbeat`` keeps it live.
- ``on_lookup_all``: per entry, a *claim* (no destination: the request's state; claimed, its decode worker
  is notified when it is ready or ended, and its KV waits for that worker) or a *pull* (destination blocks:
  the sends start, each part as soon as its blocks are computed). A request not held is answered with how
  it ended here (``recent.RequestMemory``), or ``unknown`` (claimed on arrival).
- ``on_release``: the decode worker does not need the KV (or gave up): dropped now, or on arrival.
- ``on_session_closed``: the session ended: what it claimed or pulled is freed (``expiry.orphaned``).
- ``on_undelivered``: a push did not go out: counted (the decode worker's re-ask gets the state).

Every answer is read from, and every change made to, the requests held (``held.HeldRequests``) under its
lock, which the engine thread takes too.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from typing import Callable

from xpyd.prefill_worker.expiry import orphaned
from xpyd.prefill_worker.held import RELEASED_EARLY, HeldRequests, decode_addr_of
from xpyd.prefill_worker.peers import PeerMap
from xpyd.signal import messages as m
from xpyd.signal.request_id import RequestIdError, parse_request_id
from xpyd.worker.request import RequestState

log = logging.getLogger(__name__)


class PrefillSignalPlane:
    def __init__(self, held: HeldRequests, model_id: str, compat: dict, cluster_token: str | None,
                 isolate: Callable[[str], AbstractContextManager], wake: Callable[[], None],
                 accepted_tokens: tuple[str, ...] = ()) -> None:
        """``compat``: what a decode worker's handshake must match (``WorkerEngine.peer_compat``: the KV layout
        and the weights); ``isolate(request_id)``: a scope in which an exception fails just that request (the
        engine's); ``wake``: wake the engine thread (sends to poll); ``accepted_tokens``: proved by a session
        too (a rotation window)."""
        self.held = held
        self.model_id = model_id
        self.cluster_token = cluster_token  # what each decode worker's session proves (the server checks it)
        self.accepted_tokens = accepted_tokens  # or one of these
        self._kv_compat = compat
        self._isolate = isolate
        self._wake = wake

    def on_session_closed(self, identity: str, why: str) -> None:
        """The signal session of decode worker ``identity`` ended: it shakes hands again on its next one;
        what that session claimed (held KV, sends in flight, claims of requests still to come) is freed
        (``expiry.orphaned``): its decode worker failed those requests, or is a new process that never
        heard of them."""
        held, sched = self.held, self.held.sched
        with held.lock:
            held.peers.close(identity)
            for rid in [r for r in held.memory.claimed_early if decode_addr_of(r) == identity]:
                held.memory.claimed_early.pop(rid, None)
            kept, sending = orphaned(sched.held(), sched.sending(), identity)
            error = f"its decode worker's signal session ended ({why})"
            for seq in kept:
                sched.release(seq.request_id, RequestState.FAILED)
                held.ended(seq)
                held.record_end(seq.request_id, m.LookupStatus.EXPIRED, f"KV freed: {error}", False)
            for seq in sending:
                sched.release(seq.request_id, RequestState.FAILED)  # (ends once its aborted sends are polled)
                held.connector.abort(seq)
                held.record_end(seq.request_id, m.LookupStatus.FAILED, f"KV send aborted: {error}", False)
            held.counts["orphaned"] += len(kept) + len(sending)
            held.counts["expired"] += len(kept)  # (freed unpulled, as KV that expires)
            for rid in held.claims.pop(identity, ()):  # not prefilled yet: nobody waits for a notify now
                seq = sched.get(rid)
                if seq is not None and not seq.state.is_final and not seq.cancel_requested:
                    seq.claimed = False  # (kv_ttl from now on: the worker's next session may claim it again)
        if kept or sending:
            log.info("decode worker %s: %d claimed requests freed, %d sends aborted: %s", identity, len(kept),
                     len(sending), error)
            self._wake()  # (the engine polls the aborted sends)

    def on_undelivered(self, identity: str, msg: m.Message, why: str) -> None:
        with self.held.lock:
            self.held.counts["notifies_undelivered"] += 1

    def on_handshake(self, identity: str, msg: m.Handshake) -> m.HandshakeReply:
        if msg.model_id != self.model_id:
            return m.HandshakeReply(False, f"model mismatch: prefill serves {self.model_id!r}, "
                                           f"decode serves {msg.model_id!r}", self.model_id)
        if msg.kv_compat.get("weights") != self._kv_compat.get("weights"):
            return m.HandshakeReply(False, f"the workers serve {self.model_id!r} from different weights "
                                           f"(prefill {self._kv_compat.get('weights')!s:.60}, decode "
                                           f"{msg.kv_compat.get('weights')!s:.60}): their KV cannot mix",
                                    self.model_id)
        ours, theirs = (self._kv_compat.get("dtype"), self._kv_compat.get("kv_scales")), \
            (msg.kv_compat.get("dtype"), msg.kv_compat.get("kv_scales"))
        if ours != theirs:
            return m.HandshakeReply(False, f"KV cache dtype mismatch: prefill {_kv_dtype(*ours)}, decode "
                                           f"{_kv_dtype(*theirs)} (--kv-cache-dtype and --dtype must agree): their "
                                           "KV cannot mix", self.model_id)
        if msg.kv_compat != self._kv_compat:
            return m.HandshakeReply(False, f"KV layout mismatch: prefill {self._kv_compat}, "
                                           f"decode {msg.kv_compat}", self.model_id)
        with self.held.lock:
            self.held.peers.accept(identity, time.monotonic())
        return m.HandshakeReply(True, None, self.model_id)

    def _known(self, identity: str) -> bool:
        """Has this decode worker shaken hands? (marks it active)"""
        with self.held.lock:
            return self.held.peers.heard_from(identity, time.monotonic())

    def on_heartbeat(self, identity: str, msg: m.Heartbeat) -> m.HeartbeatReply | m.ErrorReply:
        return m.HeartbeatReply() if self._known(identity) else m.ErrorReply("handshake first")

    def on_kv_map_init(self, identity: str, msg: m.KVMapInit) -> m.KVMapReply | m.ErrorReply:
        if not self._known(identity):
            return m.ErrorReply("handshake first")
        peer = self.held.connector.accept_peer(msg.transfer, msg.block_bytes, msg.num_blocks)
        if isinstance(peer, str):
            return m.KVMapReply(False, peer)
        with self.held.lock:
            self.held.peers.register(identity, peer)
        return m.KVMapReply(True)

    def on_lookup_all(self, identity: str, msg: m.LookupAll) -> m.LookupReply | m.ErrorReply:
        if not self._known(identity):
            return m.ErrorReply("handshake first")
        results = []
        with self.held.lock:
            peer = self.held.peers.pool(identity)
            for e in msg.entries:
                results.append(self._lookup_isolated(identity, peer, e))
        return m.LookupReply(tuple(results))

    def _lookup_isolated(self, identity: str, peer: PeerMap | None, e: m.LookupEntry) -> m.LookupResult:
        """``_lookup_one``; if it raises, that request fails here and the decode worker is told so."""
        with self._isolate(e.request_id):
            return self._lookup_one(identity, peer, e)
        ended = self.held.memory.ended.get(e.request_id)
        error = ended.error if ended is not None and ended.error else "internal error"
        return m.LookupResult(e.request_id, m.LookupStatus.FAILED, error=error)

    def _lookup_one(self, identity: str, peer: PeerMap | None, e: m.LookupEntry) -> m.LookupResult:
        S = m.LookupStatus
        held, sched = self.held, self.held.sched
        try:
            rid = parse_request_id(e.request_id)
        except RequestIdError as err:
            return m.LookupResult(e.request_id, S.FAILED, error=str(err))
        if rid.decode_addr != identity:
            return m.LookupResult(e.request_id, S.FAILED, error="request belongs to another decode worker")
        seq = sched.get(e.request_id)
        if seq is None:
            ended = held.memory.ended.get(e.request_id)
            if ended is not None:
                return ended
            if e.request_id in held.memory.released_early:  # refused when it arrives: do not wait for it
                return m.LookupResult(e.request_id, S.FAILED, error=RELEASED_EARLY)
            if e.dest_blocks is None:
                held.memory.claimed_early[e.request_id] = True  # claimed on arrival; notified when ready
            return m.LookupResult(e.request_id, S.UNKNOWN)
        if e.dest_blocks is None:
            held.claim(seq)  # notified when ready (or ended); its KV waits for this decode worker
        streaming = seq.state is RequestState.RUNNING and held.streams
        if seq.state is RequestState.WAITING or (seq.state is RequestState.RUNNING and not streaming):
            return m.LookupResult(e.request_id, S.NOT_READY, steps=held.steps)
        if e.dest_blocks is None:
            if streaming:
                return held.ready_result(seq, S.PREFILLING)
            return held.ready_result(seq, S.READY if seq.pull is None else S.SENDING)
        # A pull (only the decode worker named in the request id gets here).
        if peer is None:
            return m.LookupResult(e.request_id, S.FAILED, error="kv_map_init first")
        if seq.pull is None:
            plan = held.connector.plan(seq, e, peer, time.monotonic())
            if isinstance(plan, str):
                return m.LookupResult(e.request_id, S.FAILED, error=plan)
            sched.start_pull(e.request_id, len(plan.parts), plan)
            if len(plan.parts) > 1 and held.connector.split_last_part(peer):
                # the last chunk computes the last part alone: only it is left to move (across a network; on
                # this host moving one more part costs less than the extra step would)
                seq.split_at = plan.parts[-2].ready_at
            held.sends[identity] += 1
            if held.connector.send_due(sched, seq):
                self._wake()  # wake the engine to poll the sends
        if streaming:
            return held.ready_result(seq, S.PREFILLING)
        return m.LookupResult(e.request_id, S.SENDING, seq.first_token, seq.prompt_len)

    def on_release(self, identity: str, msg: m.Release) -> m.ReleaseReply | m.ErrorReply:
        if not self._known(identity):
            return m.ErrorReply("handshake first")
        n = 0
        with self.held.lock:
            for rid in msg.request_ids:
                if decode_addr_of(rid) != identity:
                    continue  # not this decode worker's request (or not a request id): ignored
                if self.held.release(rid):
                    n += 1
                elif rid not in self.held.memory.ended:
                    self.held.memory.released_early[rid] = True  # dropped if it arrives later
                    self.held.counts["released_early"] += 1
        return m.ReleaseReply(n)


def _kv_dtype(dtype, scales) -> str:
    """A handshake's KV dtype as the refusal names it: fp8 with the digest of its scales."""
    return f"{dtype!s:.20}" if scales is None else f"{dtype!s:.20} with scales {scales!s:.40}"
