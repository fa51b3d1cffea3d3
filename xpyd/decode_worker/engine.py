"""Decode engine: pulls KV from prefill workers and runs the continuous decode batch.

One engine thread owns the scheduler, the signal-plane DEALERs and the model.
A new request is *claimed* at its prefill worker at once (a lookup without a destination); the
prefill worker pushes ``notify`` when the request is ready (first token) or ended there, so no
request is polled for (a safety re-ask goes out only after ``lookups.SAFETY_REASK`` seconds without news,
for any request prefill has not given its last word on: a notify lost on the way costs that long, not a
timeout; what is asked when: ``lookups``).
Heartbeats go to the prefill workers that hold requests of this one, and idle sessions are closed (``peers``).
Each step: take new requests/aborts, read signal replies and notifies, call the KV connector's
``progress()`` while a pull is in flight, ask it which receives ended (``finished()``: arrived requests
join the batch), start pulls for ready requests while the batch has room (the connector turns their
blocks into the receive and says what the pull tells prefill), then run one decode step over every running
request. Bytes move in the transfer backend's threads (nixl: in UCX, advanced by ``progress()``, with the
backend's threads as a slow fallback), so running decodes never wait; with nothing to decode and a pull
in flight the loop sleeps until a receive ends and the connector wakes it (or every ``progress_tick`` of
a backend that needs its ``progress()`` called).

A request the proxy sends to be prefilled here (``WorkItem.local_prefill``: its id names this worker as both
workers) claims nothing and pulls nothing: it waits for room, then its prompt is computed in chunks before
each decode step (``local_prefill``), and its first token, sampled here, is streamed like the rest.

Requests take KV blocks as they grow, and the newest is preempted when the pool is full: the running batch's
steps (room for the decode step, local prefill chunks, the decode step and the tokens they emit) are ``batch``'s.

Faults: a request whose prefill is not ready within ``prefill_wait_timeout`` of the last time its prefill
worker's queue was seen to move (its answers to the re-asks carry the worker's forward passes so far), or
whose KV does not arrive within it once the pull started, fails with 504 (``peers``); a prefill worker that
dies or refuses fails its requests at once (the signal client's socket monitor); KV the prefill worker let
expire fails with 502. An abort (client gone) ends the request in any state, cancels its receive and tells the
prefill worker to release the KV.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace

from xpyd import PROTOCOL_VERSION
from xpyd.decode_worker.batch import DecodeBatch
from xpyd.decode_worker.local_prefill import LocalPrefill
from xpyd.decode_worker.lookups import Lookups
from xpyd.decode_worker.peers import PrefillPeers
from xpyd.decode_worker.prompt_facts import peer_hash_key, prompt_hashes
from xpyd.decode_worker.receives import Receives
from xpyd.decode_worker.scheduler import DecodeScheduler
from xpyd.decode_worker.seq import DecodeSeq
from xpyd.discovery.types import Role, WorkerInfo
from xpyd.model.sampling_params import GREEDY_BELOW
from xpyd.worker.config import WorkerConfig
from xpyd.worker.kv_connector import KVReceiver, receiver_for
from xpyd.worker.loop import IDLE_SLEEP
from xpyd.worker.work_item import ErrorEvent, TokenEvent, WorkItem
from xpyd.worker.preemption import outgrown
from xpyd.worker.request import RequestState
from xpyd.worker.engine import Abort, PeersLeft, WorkerEngine
from xpyd.netaddr import http_url
from xpyd.signal import messages as m
from xpyd.signal.client import PeerState, SignalClient

# Failures that say the path to the request's prefill worker is broken, not either worker: the signal plane
# to it (unreachable, silent), its KV not arriving (a transfer failed or stalled), the request not reported
# ready in time (its lookups or notifies lost on the way as well as a long queue there).
KV_PATH_CAUSES = frozenset({"peer", "transfer", "timeout"})


class DecodeEngine(WorkerEngine):
    name = "decode-engine"

    def __init__(self, runner, tokenizer, config: WorkerConfig, kv: KVReceiver | object, served_name: str) -> None:
        """``kv``: the KV connector, or the transfer backend one is made over (``kv_connector.receiver_for``)."""
        super().__init__(runner, tokenizer, config, served_name)
        self.connector = receiver_for(kv)
        self.connector.bind(self.pool, self._wake)
        self.receives = Receives(self.connector, self.metrics, self.pool.layout.block_bytes)
        self.sched = DecodeScheduler(config.batch_size, self.kv_cache)
        self.local = LocalPrefill(runner, tokenizer, self.kv_cache, self.metrics, config.local_prefill_chunk,
                                  self.max_model_len)
        self.signal: SignalClient | None = None
        self.identity: str | None = None  # this worker's address in request ids (its KV endpoint's), once started
        self.lookups = Lookups()  # claims, re-asks and pulls owed to the prefill workers
        self._failures: Counter[str] = Counter()  # requests failed here, by cause (for stats and tests)
        self._stats: dict = {}
        self.batch = DecodeBatch(runner, self.kv_cache, self.sched, self.local, self.metrics, self.isolate,
                                 self._fail_seq, self._failures)
        self.peers = PrefillPeers(self.sched, self.lookups, self._fail_seq, config.prefill_wait_timeout)

    def start(self) -> None:
        endpoint = self.connector.register()
        # the decode worker's address in request ids: where prefill sends KV
        identity = self.identity = endpoint.address
        layout = self.pool.layout
        self.signal = SignalClient(
            identity,
            m.Handshake(identity, self.model_id, self.peer_compat()),
            m.KVMapInit(identity, endpoint.descriptor, layout.block_bytes, layout.num_blocks),
            timeout=self.config.signal_timeout,
            cluster_token=self.config.cluster_token,  # proven at each connection, never sent
            accepted_tokens=self.config.accepted_tokens,
            counts=self.metrics.signal,
        )
        self.signal.register_fd(self.wake_fd)
        self.info = WorkerInfo(Role.DECODE, http_url(self.config.public_host, self.config.port), identity,
                               self.model_id, PROTOCOL_VERSION, self.config.batch_size)
        self.start_thread()

    # --- HTTP side ---------------------------------------------------------
    def idle(self) -> bool:
        s = self._stats
        return not (s.get("waiting") or s.get("running") or s.get("transferring") or s.get("prefilling"))

    def stats(self) -> dict:
        return dict(self._stats)

    def _update_stats(self) -> None:
        sched = self.sched
        held = sched.num_waiting + sched.num_running + sched.num_transferring + sched.num_prefilling
        self._stats = {"role": "decode", "waiting": sched.num_waiting, "running": sched.num_running,
                       "transferring": sched.num_transferring, "prefilling": sched.num_prefilling,
                       "requests_held": held, "local_prefills": self.local.prefilled,
                       "local_prefill_tokens": self.local.tokens, "preemptions": sched.preemptions,
                       "preempted": sched.num_preempted, "recomputed_tokens": self.local.recomputed,
                       "kv_used_bytes": self.pool.used_bytes(), **self.kv_cache.stats(),
                       "kv_reused_blocks": self.receives.reused_blocks,
                       "transfers_in_flight": self.connector.in_flight(),
                       "peers": len(self.signal.peers()) if self.signal else 0,
                       "signal_pending": self.signal.pending_requests() if self.signal else 0,
                       "pulls": dict(self.receives.pulls), "failures": dict(self._failures),
                       "claims": self.lookups.claims, "status_polls": self.lookups.status_polls}
        # (a local prefill holds its blocks and a batch place as a receive does: counted with them)
        self.metrics.set_queue(sched.num_waiting, sched.num_running, sched.num_transferring + sched.num_prefilling)
        self.metrics.set_kv(self.pool.used_bytes(), self.pool.layout.total_bytes)
        self.metrics.set_kv_cache(self.kv_cache.stats())
        self.publish_kv_events()

    # --- engine thread -----------------------------------------------------
    def wait(self, timeout: float) -> None:
        pass  # we sleep inside signal.poll(), which also watches the wake pipe

    def step(self) -> float:
        assert self.signal is not None
        posted = self.drain_inbox()
        for item in posted:
            if isinstance(item, Abort):
                with self.isolate(item.request_id):
                    self._abort(item.request_id)
            elif isinstance(item, PeersLeft):
                for addr in item.addrs:
                    self.peers.left(self.signal, addr)
            else:
                self.admit(item, self._add)
        # A request just posted has its claim sent after this poll (``lookups.send``): poll without waiting, or an
        # idle worker's claim would go out an IDLE_SLEEP late (token 2 of every request at low load was 50 ms late).
        busy = bool(posted or self.sched.running() or self.sched.prefilling() or self._local_waiting())
        if busy:
            timeout_ms = 0
        elif self.sched.num_transferring and self.connector.progress_tick is not None:
            timeout_ms = max(1, int(self.connector.progress_tick * 1000))
        else:  # (a notify or a reply wakes the poll at once)
            timeout_ms = int(IDLE_SLEEP * 1000)
        replies, failed_peers = self.signal.poll(timeout_ms)
        self.peers.keep_sessions(self.signal, time.monotonic())
        if self.sched.num_transferring:
            self.connector.progress()  # (nixl: our READs advance inside such calls)
        for addr, reply in replies:
            for r in reply.results:
                with self.isolate(r.request_id):
                    self._on_lookup_result(addr, r)
        for peer in failed_peers:
            if self.signal.get(peer.addr) is peer:  # not already replaced by a new connection
                self.peers.failed(peer.addr, peer.error or "prefill worker failed")
        self.peers.fail_overdue(time.monotonic())
        ended = self.connector.finished()
        self._landed(ended.done)
        joined, failed = self.sched.poll_transfers(ended.done, ended.failed)
        for seq in joined:
            with self.isolate(seq.request_id, seq.payload):
                self.receives.ended(seq, ok=True)
                self.kv_cache.prompt_done(seq.kv, seq.prompt_len, seq.tail)
        for seq in failed:
            with self.isolate(seq.request_id, seq.payload):
                self.receives.ended(seq, ok=False)
                self.metrics.request_done("failed")
                self._failures["transfer"] += 1
                seq.payload.sink.put(ErrorEvent(502, f"KV transfer failed: {seq.error}", kv_path=True))
                self.lookups.release(self.signal, seq.prefill_addr, [seq.request_id])
        if self.sched.running():
            self.batch.make_room()
        for seq in self.sched.schedule_transfers():
            with self.isolate(seq.request_id, seq.payload):
                self._start_pull(seq)
        self.lookups.send(self.signal, self.sched, time.monotonic())
        self.batch.prefill_step()
        if self.sched.running():  # (again for those that joined since: a prompt this worker's cache held whole)
            self.batch.make_room()
        if self.sched.running():
            self.batch.decode_step()
        self._update_stats()
        return 0.0

    def _add(self, item: WorkItem) -> None:
        rid = str(item.request_id)
        if self.sched.get(rid) is not None:
            item.sink.put(ErrorEvent(409, f"duplicate request id {rid}"))
            self.metrics.request_done("rejected")
            return
        own = item.request_id.prefill_addr == self.identity
        if item.local_prefill != own:  # (a request prefilled here names this worker; no other does)
            item.sink.put(ErrorEvent(400, "a request prefilled on its decode worker (kv_transfer_params."
                                     "local_prefill) must name that worker as its prefill worker, and only it"))
            self.metrics.request_done("rejected")
            return
        seq = DecodeSeq(rid, item.request_id.prefill_addr, payload=item,
                        deadline=item.arrival + self.config.prefill_wait_timeout, local=item.local_prefill)
        if seq.local:
            error = self.local.facts(seq)
            if error is not None:
                item.sink.put(ErrorEvent(400, error))
                self.metrics.request_done("rejected")
                return
        self.sched.add(seq)
        if seq.local:
            return
        peer = self.signal.peer(seq.prefill_addr)  # connect on demand
        if peer.state is PeerState.FAILED:
            self._fail_seq(seq, 502, peer.error or "prefill worker unreachable", "peer")

    def _abort(self, request_id: str) -> None:
        """The client went away: drop the request in whatever state it is in."""
        seq = self.sched.get(request_id)
        if seq is None:
            return
        state = seq.state
        if state is RequestState.TRANSFERRING:
            # Cancel the receive before the slot is freed: once abort() returns, no byte lands in it.
            self.receives.cancel(seq)  # (neither landed nor failed)
        self.sched.abort(request_id)
        self.metrics.request_done("aborted")
        if state in (RequestState.WAITING, RequestState.TRANSFERRING) and not seq.local:
            self.lookups.release(self.signal, seq.prefill_addr, [request_id])

    def _fail_seq(self, seq: DecodeSeq, status: int, error: str, cause: str, release: bool = False) -> None:
        """Fail a request; with ``release``, also tell its prefill worker to drop the KV. ``cause`` is counted
        (``failures`` in stats); one of KV_PATH_CAUSES marks the error as the pair's (``ErrorEvent.kv_path``)."""
        state = seq.state
        if state is RequestState.TRANSFERRING:
            self.receives.fail(seq)
        self.sched.fail(seq, error)
        self.metrics.request_done("failed")
        self._failures[cause] += 1
        seq.payload.sink.put(ErrorEvent(status, error, kv_path=cause in KV_PATH_CAUSES))
        if release and state in (RequestState.WAITING, RequestState.TRANSFERRING) and not seq.local:
            self.lookups.release(self.signal, seq.prefill_addr, [seq.request_id])

    def fail_held(self, request_id: str, item: WorkItem | None, error: str) -> bool:
        seq = self.sched.get(request_id)
        if seq is None or (item is not None and seq.payload is not item):
            return False
        self._fail_seq(seq, 500, error, "internal", release=True)
        return True

    def _on_lookup_result(self, addr: str, r: m.LookupResult) -> None:
        """One entry of a lookup reply or a notify from prefill worker ``addr``."""
        S = m.LookupStatus
        seq = self.sched.get(r.request_id)
        if seq is None or seq.prefill_addr != addr:
            return
        self.lookups.heard(seq.request_id, time.monotonic())  # news of it: the next re-ask waits
        if r.status is S.FAILED:
            self._fail_seq(seq, 502, f"prefill worker: {r.error}", "prefill")
        elif r.status is S.EXPIRED:
            self._fail_seq(seq, 502, f"prefill worker {addr}: {r.error or 'KV expired before it was pulled'}",
                           "expired")
        elif seq.state is RequestState.TRANSFERRING and r.status in (S.UNKNOWN, S.NOT_READY):
            if seq.ready and seq.recv_token is not None and seq.recv_token.done():
                return  # its KV landed and prefill, its send done, forgot it: it joins the batch this step
            # The prefill worker no longer has this request: its KV, or (not ready) the first token that never came.
            what = "the KV" if seq.ready else "the first token"
            self._fail_seq(seq, 502, f"prefill worker {addr} no longer holds {what} of this request", "prefill")
        elif r.status is S.NOT_READY:
            self._progress(seq, r)  # (queued there)
        elif r.status is S.PREFILLING:
            if not seq.known and self._prompt_facts(seq, addr, r):
                seq.part_blocks = r.part_blocks  # pulled now, the KV comes in parts as it is computed
            self._progress(seq, r)  # (its KV parts come as the worker computes them, between other prompts')
        elif r.status in (S.READY, S.SENDING) and not seq.ready:
            if r.first_token is None:
                self._fail_seq(seq, 502, f"prefill worker {addr} said ready without a first token", "prefill",
                               release=True)
                return
            if seq.known or self._prompt_facts(seq, addr, r):
                self._first_token(seq, r.first_token)

    def _progress(self, seq: DecodeSeq, r: m.LookupResult) -> None:
        """A request queued or being computed at its prefill worker: if the worker ran forward passes since the
        last answer the wait starts over, so a deep queue that keeps moving is waited out, a stalled one is not
        (a pulled request's KV comes only as its chunks are computed, among the other prompts')."""
        if seq.prefill_steps is not None and r.steps > seq.prefill_steps:
            seq.deadline = max(seq.deadline, time.monotonic() + self.config.prefill_wait_timeout)
        seq.prefill_steps = r.steps

    def _prompt_facts(self, seq: DecodeSeq, addr: str, r: m.LookupResult) -> bool:
        """The prompt's length, block hashes and tail from prefill (checked), and what follows from them:
        the request's length limits, its output. False (and the request failed) when they do not add up."""
        item: WorkItem = seq.payload
        hashes = prompt_hashes(r, addr, item.prompt_ids, item.cache_salt, self.kv_cache,  # (checked: ``prompt_facts``)
                               peer_hash_key(self.signal.get(addr), self.config.cluster_token))
        if isinstance(hashes, str):
            self._fail_seq(seq, 502, hashes, "prefill", release=True)
            return False
        # (a migrated request's context is its prompt and the output it resumes: that output counts in max_tokens)
        limit, prompt_len = self.max_model_len, item.prompt_tokens(r.num_tokens)
        if item.open_ended:
            item.stop = replace(item.stop, max_tokens=max(1, limit - prompt_len))
        if prompt_len + item.stop.max_tokens > limit or prompt_len < 1:  # (prefill refuses these first: a safety net)
            self._fail_seq(seq, 400, f"This model's maximum context length is {limit} tokens. However, you "
                           f"requested {prompt_len + item.stop.max_tokens} tokens ({prompt_len} in the input, "
                           f"{item.stop.max_tokens} in the completion).", "length", release=True)
            return False
        if not self.kv_cache.fits(r.num_tokens + 1):  # (its prompt and one token: it could never run here)
            self._fail_seq(seq, 400, outgrown(r.num_tokens + 1, self.kv_cache), "length", release=True)
            return False
        # (the chain's root is the seed salted with this request's cache_salt: its generated blocks chain from it)
        seq.hashes, seq.tail, seq.cached_tokens = self.kv_cache.chain(hashes, item.cache_salt), r.tail, r.cached_tokens
        seq.prompt_len = r.num_tokens
        seq.final_len = prompt_len + item.stop.max_tokens
        seq.known = True
        try:
            item.start_output(self.tokenizer, self.runner.sampler)
        except ValueError as e:  # a resumed output that cannot be replayed here
            self._fail_seq(seq, 400, str(e), "length", release=True)
            return False
        return True

    def _first_token(self, seq: DecodeSeq, token: int) -> None:
        """Prefill's first token: the client already has its text; we continue after it (the prompt was
        tokenized and checked once, by prefill)."""
        item: WorkItem = seq.payload
        if item.sampling.temperature >= GREEDY_BELOW:  # (the sampler's test: below it, greedy, nothing drawn)
            self.runner.sampler.skip_draw(item.generator)  # prefill used this draw for the first token
        if item.grammar is not None and not item.grammar.accept(token):  # (another grammar engine or tokenizer)
            self._fail_seq(seq, 502, f"the prefill worker's first token {token} breaks the request's grammar here",
                           "prefill", release=True)
            return
        _, finish = item.output.append(token)
        item.reported = len(item.output.token_ids)  # (prefill's answer named it)
        if finish is not None:  # the first token ended the request: no KV needed
            if seq.state is RequestState.TRANSFERRING:  # (streamed: stop the parts still coming)
                self.receives.cancel(seq)
            self.sched.finish(seq)
            self.batch.finished(item)
            self.lookups.release(self.signal, seq.prefill_addr, [seq.request_id])
            n_out = len(item.output.token_ids)
            item.sink.put(TokenEvent("", finish.value, item.prompt_tokens(seq.prompt_len), n_out,
                                     min(seq.cached_tokens, item.prompt_tokens(seq.prompt_len)), (), item.new_ids()))
            return
        self.sched.mark_ready(seq.request_id, token)
        if seq.state is RequestState.TRANSFERRING and not seq.transfer_ids:
            # its whole prompt was cached here (pulled nothing): prefill's copy can go now
            self.lookups.release(self.signal, seq.prefill_addr, [seq.request_id])

    def _start_pull(self, seq: DecodeSeq) -> None:
        """Receive the prompt's blocks after the ones this worker's cache already holds (none: join now, or
        once the first token is here). Pulled while prefill still computes the prompt, the blocks come in
        parts of the size prefill suggested, each as soon as it is computed."""
        bs = self.kv_cache.block_size
        now = time.monotonic()
        seq.payload.stamps.mark("pull_started", now)  # (xpyd.worker.phases)
        first = seq.kv.cached_tokens // bs
        blocks = seq.kv.blocks[first:]
        self.receives.reused(first)
        if not blocks:  # the whole prompt is cached here: nothing to move; prefill can drop its copy
            seq.payload.stamps.mark("landed", now)
            self.sched.skip_transfer(seq)
            self.kv_cache.prompt_done(seq.kv, seq.prompt_len, seq.tail)
            if seq.ready:
                self.lookups.release(self.signal, seq.prefill_addr, [seq.request_id])
            return
        # (the connector's secret: only the prefill worker the pull goes to may write these blocks; its handle
        # reads FAILED only once no part can land any more; it wakes the loop when the KV landed)
        order = self.receives.start(seq, blocks, 0 if seq.ready else seq.part_blocks)
        self.sched.set_recv_token(seq, order.handle)
        seq.deadline = time.monotonic() + self.config.prefill_wait_timeout
        self.lookups.pull(seq.prefill_addr, m.LookupEntry(seq.request_id, tuple(blocks), first, order.secret,
                                                          part_blocks=order.part_blocks))

    def _landed(self, request_ids) -> None:
        """The KV of these requests landed (``xpyd.worker.phases``; they join the batch once their first
        token is here too)."""
        now = time.monotonic()
        for rid in request_ids:
            seq = self.sched.get(rid)
            if seq is not None:
                seq.payload.stamps.mark("landed", now)

    def _local_waiting(self) -> bool:
        return self.sched.num_waiting > len(self.sched.waiting())

    def _wake(self) -> None:
        self.post(None)

    def shutdown(self) -> None:
        if self.signal is not None:
            self.signal.close()
        self.connector.close()
