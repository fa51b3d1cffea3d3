"""Decode scheduler: decides, never moves bytes.

Queues a request moves through::

    waiting (until prefill reports the prompt: prefilling, or ready) --(room in the batch and the pool)-->
    transferring (blocks allocated, KV being received: the KV connector says when it landed) --(KV landed
    and the first token known)--> running (in the continuous batch; joins and leaves at any step) --> finished

A request whose prompt is still computing on a prefill worker that streams (``prefilling``) is admitted
as soon as there is room: its KV arrives in parts while prefill computes the rest, and it joins the
batch once the last part landed and prefill's first token arrived (``ready``), whichever is later.

A request whose first token is its last (prompt + max_tokens = prompt + 1: ``needs_kv`` False) is never
given blocks: prefill's first token ends it, so a pull while its prompt computes would move KV nobody
uses. It waits, holding nothing, until the first token arrives (the engine then finishes it).

A ready request's leading prompt blocks that this worker's prefix cache already holds are reused: only
the blocks after them are pulled (``kv.cached_tokens``), none at all when the cache holds the whole
prompt (``skip_transfer``).

A request that waits too long for its prefill, or whose KV does not arrive in
time, is ``overdue`` (its ``deadline``, set by the engine, has passed).

A request the proxy sends here to be prefilled locally (``local``: a short or mostly cached prompt, see
``xpyd.api.local_prefill``) moves through its own queues::

    waiting (local, oldest first) --(room in the batch and the pool: blocks for its prompt and its first
    decoded token, its cached prefix reused)--> prefilling (its prompt computed here, ``plan_prefill``: at
    most ``budget`` prompt tokens a step over all such requests, oldest first, so the running streams' steps
    stay short) --(its last chunk computed: the first token sampled here)--> running

It never waits on a prefill worker, so it is never claimed, pulled or ``overdue``.

Blocks are taken as requests grow, nothing is reserved for the output to come: before each decode step
``reserve_decode`` gives every running request the blocks of that step, oldest first, and when the pool has
none left it preempts the newest request holding blocks it can give back (running or prefilling; not one
receiving KV: ``xpyd.worker.preemption``)::

    running | prefilling --(preempted: its blocks freed, its full ones left in the prefix cache)--> preempted
    (holds nothing; oldest first, ahead of every request that never ran: none is admitted while one waits)
    --(room: blocks for what it recomputes and its next token)--> prefilling (its prompt and the output so
    far but the last token computed here, ``prefill_ids``, in chunks like a local prompt, its cached prefix
    skipped; nothing sampled: its output's state never left this worker) --(the last chunk)--> running

A request preempted before its first token (a local prompt being computed) computes its prompt again and
samples its first token as any local request does.

Invariants: RUNNING + TRANSFERRING + PREFILLING <= batch_size; RUNNING <= batch_size; a
request runs only after its KV arrived (or was computed here); every TRANSFERRING/PREFILLING/RUNNING request
holds the blocks of its prompt (and of the tokens it generated; after ``reserve_decode``, of the next step's);
a waiting or preempted request holds none; a preempted request that had its first token has the tokens to
compute again (its prompt and output but the last).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from xpyd.decode_worker.seq import DecodeSeq, PromptChunk
from xpyd.worker.request import RequestState, require
from xpyd.worker.kv_cache import BlockChain, KVCache
from xpyd.worker.kv_connector import TransferHandle
from xpyd.worker.preemption import Room, make_room

S = RequestState


@dataclass(slots=True)
class DecodeScheduler:
    batch_size: int
    kv: KVCache
    _waiting: "OrderedDict[str, DecodeSeq]" = field(default_factory=OrderedDict)
    _transferring: "OrderedDict[str, DecodeSeq]" = field(default_factory=OrderedDict)
    _running: "OrderedDict[str, DecodeSeq]" = field(default_factory=OrderedDict)
    _local: "OrderedDict[str, DecodeSeq]" = field(default_factory=OrderedDict)  # local requests waiting
    _prefilling: "OrderedDict[str, DecodeSeq]" = field(default_factory=OrderedDict)
    _preempted: "OrderedDict[str, DecodeSeq]" = field(default_factory=OrderedDict)  # oldest first
    _arrivals: int = 0
    preemptions: int = 0  # requests preempted, ever

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")

    # --- queries -----------------------------------------------------------
    def get(self, request_id: str) -> DecodeSeq | None:
        for q in self._queues():
            if request_id in q:
                return q[request_id]
        return None

    @property
    def num_waiting(self) -> int:
        """Requests holding no blocks: waiting on their prefill worker, or (local, preempted) for room."""
        return len(self._waiting) + len(self._local) + len(self._preempted)

    @property
    def num_preempted(self) -> int:
        """Preempted requests waiting to compute their KV again."""
        return len(self._preempted)

    @property
    def num_prefilling(self) -> int:
        return len(self._prefilling)

    @property
    def num_transferring(self) -> int:
        return len(self._transferring)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def waiting(self) -> list[DecodeSeq]:
        """The requests waiting on their prefill worker (not the local ones)."""
        return list(self._waiting.values())

    def prefilling(self) -> list[DecodeSeq]:
        return list(self._prefilling.values())

    def preempted(self) -> list[DecodeSeq]:
        return list(self._preempted.values())

    def transferring(self) -> list[DecodeSeq]:
        return list(self._transferring.values())

    def running(self) -> list[DecodeSeq]:
        return list(self._running.values())

    def overdue(self, now: float) -> list[DecodeSeq]:
        """Requests still waiting for prefill, or for their KV, past their deadline."""
        late = [s for s in self._waiting.values() if not s.ready and s.deadline <= now]
        return late + [s for s in self._transferring.values() if s.deadline <= now]

    def has_work(self) -> bool:
        return any(self._queues())

    def _places_taken(self) -> int:
        return self.num_running + self.num_transferring + self.num_prefilling

    # --- transitions -------------------------------------------------------
    def add(self, seq: DecodeSeq) -> None:
        """A new request; a local one comes with its prompt's facts (``known``)."""
        if self.get(seq.request_id) is not None:
            raise ValueError(f"duplicate request id {seq.request_id}")
        if seq.local and not (seq.known and len(seq.prompt_ids) == seq.prompt_len >= 1):
            raise ValueError(f"local request {seq.request_id} without its prompt")
        seq.order = self._arrivals
        self._arrivals += 1
        (self._local if seq.local else self._waiting)[seq.request_id] = seq

    def mark_ready(self, request_id: str, first_token: int) -> DecodeSeq | None:
        seq = self._waiting.get(request_id) or self._transferring.get(request_id)
        if seq is not None:
            seq.ready = seq.known = True
            seq.first_token = first_token
        return seq

    def schedule_transfers(self) -> list[DecodeSeq]:
        """Give KV blocks to requests whose prompt is known, oldest first, while the batch and the pool have
        room (none to one that needs no KV); none while a preempted request waits (it goes first).

        The caller then announces each receive to the KV connector and
        asks prefill to send (``set_recv_token``).
        """
        started = []
        for seq in list(self._waiting.values()):
            if self._places_taken() >= self.batch_size or self._preempted:
                break
            if not seq.known or not seq.needs_kv:
                continue
            kv = self.kv.admit(seq.hashes, seq.prompt_len, reuse_tokens=seq.prompt_len)
            if kv is None:
                break  # the oldest waits for blocks rather than being overtaken
            seq.kv = kv
            seq.set_state(S.TRANSFERRING)
            del self._waiting[seq.request_id]
            self._transferring[seq.request_id] = seq
            started.append(seq)
        return started

    def plan_prefill(self, budget: int) -> list[PromptChunk]:
        """This step's prefill work on this worker: preempted requests, then waiting local ones, admitted
        (oldest first) while the batch and the pool have room (blocks for ``prefill_ids`` and the first token
        decoded after them; the cached prefix reused, its last token always computed: its logits give a
        prompt's first token), then chunks of the prefilling requests' ``prefill_ids``, oldest first, at most
        ``budget`` tokens in all. Report each chunk back (``prefill_done``) before the next plan."""
        if budget < 1:
            raise ValueError("a prefill step's budget is at least one token")
        for queue in (self._preempted, self._local):
            for seq in list(queue.values()):
                if self._places_taken() >= self.batch_size or not self._admit_here(seq, queue):
                    return self._chunks(budget)  # the oldest waits for blocks rather than being overtaken
        return self._chunks(budget)

    def _admit_here(self, seq: DecodeSeq, queue: "OrderedDict[str, DecodeSeq]") -> bool:
        n = len(seq.prefill_ids)
        kv = self.kv.admit(seq.hashes, n + 1, reuse_tokens=n - 1)
        if kv is None:
            return False
        seq.kv, seq.computed = kv, kv.cached_tokens
        if not seq.ready and not seq.preemptions:  # (usage reports the prompt tokens its first admission found)
            seq.cached_tokens = kv.cached_tokens
        seq.set_state(S.PREFILLING)
        del queue[seq.request_id]
        self._prefilling[seq.request_id] = seq
        return True

    def _chunks(self, budget: int) -> list[PromptChunk]:
        chunks = []
        for seq in self._prefilling.values():
            if budget == 0:
                break
            n = min(budget, len(seq.prefill_ids) - seq.computed)
            chunks.append(PromptChunk(seq, seq.computed, seq.computed + n, replay=seq.ready))
            budget -= n
        return chunks

    def prefill_done(self, chunk: PromptChunk, first_token: int | None = None) -> None:
        """``chunk`` is computed; the last of a prompt comes with the first token (the last of a recompute with
        none), and its request joins the batch (the engine finishes it instead when that token ended it)."""
        seq = chunk.seq
        require(seq.state is S.PREFILLING and seq.computed == chunk.start, "not the chunk planned")
        seq.computed = chunk.end
        if not chunk.last:
            return
        if chunk.replay:
            require(first_token is None, "a recompute samples nothing")
        else:
            require(first_token is not None, "the last chunk comes with the first token")
            seq.first_token, seq.ready, seq.landed = first_token, True, True
        seq.set_state(S.RUNNING)
        del self._prefilling[seq.request_id]
        self._running[seq.request_id] = seq

    def set_recv_token(self, seq: DecodeSeq, token: TransferHandle) -> None:
        require(seq.state is S.TRANSFERRING and seq.recv_token is None, "not awaiting a transfer")
        seq.recv_token = token

    def skip_transfer(self, seq: DecodeSeq) -> None:
        """Nothing to pull (the prefix cache holds the whole prompt): the request joins the batch now, or
        when its first token arrives."""
        require(seq.state is S.TRANSFERRING and seq.recv_token is None, "not awaiting a transfer")
        seq.recv_token, seq.landed = LANDED, True
        if seq.ready:
            seq.set_state(S.RUNNING)
            del self._transferring[seq.request_id]
            self._running[seq.request_id] = seq

    def poll_transfers(self, landed: Iterable[str] | None = None,
                       failed: Iterable[tuple[str, str]] = ()) -> tuple[list[DecodeSeq], list[DecodeSeq]]:
        """The receives that ended: ``landed`` and ``failed`` (request id, why) as the KV connector's
        ``finished()`` reports them, or, with ``landed`` None, as each transferring request's handle reads.
        Requests whose KV is here and whose first token is known move to RUNNING; returns (joined, failed).
        A failed request's blocks are freed here: a receive is reported failed only once no byte of it can
        land any more (a receive in parts withdraws its other parts first)."""
        if landed is None:
            ended = [s for s in self._transferring.values() if s.recv_token is not None and s.recv_token.finished()]
            landed = [s.request_id for s in ended if s.recv_token.done()]
            failed = [(s.request_id, s.recv_token.error) for s in ended if not s.recv_token.done()]
        failed_seqs = []
        for rid, why in failed:
            seq = self._transferring.get(rid)
            if seq is not None:
                self.fail(seq, why or "KV transfer failed")
                failed_seqs.append(seq)
        for rid in landed:
            seq = self._transferring.get(rid)
            if seq is not None:
                seq.landed = True
        joined = []
        for seq in list(self._transferring.values()):
            if seq.landed and seq.ready:  # (its KV may be here before prefill's first token)
                seq.set_state(S.RUNNING)
                del self._transferring[seq.request_id]
                self._running[seq.request_id] = seq
                joined.append(seq)
        return joined, failed_seqs

    def reserve_decode(self, length: Callable[[DecodeSeq], int],
                       context: Callable[[DecodeSeq], Sequence[int]]) -> Room[DecodeSeq]:
        """Before a decode step: every running request (oldest first) gets the blocks of ``length(seq)`` tokens,
        its KV after the step; when the pool has none left, the newest running or prefilling request is
        preempted (``xpyd.worker.preemption``). ``context(seq)``: a running request's prompt and output but its
        last token, what it computes again when it re-enters. A request longer than the whole pool fails."""
        return make_room(self.kv, list(self._running.values()), length,
                         lambda: (*self._running.values(), *self._prefilling.values()),
                         lambda seq: self._preempt(seq, context), self.fail)

    def finish(self, seq: DecodeSeq) -> None:
        self._end(seq, S.FINISHED)

    def fail(self, seq: DecodeSeq, error: str) -> None:
        seq.error = error
        self._end(seq, S.FAILED)

    def abort(self, request_id: str) -> DecodeSeq | None:
        """Drop a request. A receive in flight must be aborted in the backend by the caller."""
        seq = self.get(request_id)
        if seq is not None:
            self._end(seq, S.ABORTED)
        return seq

    # --- internals ---------------------------------------------------------
    def _queues(self) -> tuple["OrderedDict[str, DecodeSeq]", ...]:
        return (self._waiting, self._transferring, self._running, self._local, self._prefilling, self._preempted)

    def _preempt(self, seq: DecodeSeq, context: Callable[[DecodeSeq], Sequence[int]]) -> None:
        """Free ``seq``'s blocks (its full ones stay cached under the hashes its KV named) and queue it, oldest
        first, to compute its KV again."""
        if seq.state is S.RUNNING:
            seq.recompute = context(seq)
            require(len(seq.recompute) >= seq.prompt_len, "a preempted request's context is shorter than its prompt")
        kv = seq.kv
        if seq.ready:  # (its chain so far: the prompt's and every full block of its output)
            seq.hashes = BlockChain(kv.hashes, kv.root) if kv.root is not None else list(kv.hashes)
            seq.tail = tuple(seq.recompute[len(seq.hashes) * self.kv.block_size:])
        seq.set_state(S.PREEMPTED)
        self._running.pop(seq.request_id, None)
        self._prefilling.pop(seq.request_id, None)
        self.kv.free(kv)
        seq.kv, seq.computed = None, 0
        seq.preemptions += 1
        self.preemptions += 1
        older = [s for s in self._preempted.values() if s.order < seq.order]
        newer = [s for s in self._preempted.values() if s.order > seq.order]
        self._preempted.clear()
        for s in (*older, seq, *newer):
            self._preempted[s.request_id] = s

    def _end(self, seq: DecodeSeq, state: RequestState) -> None:
        seq.set_state(state)
        for q in self._queues():
            q.pop(seq.request_id, None)
        if seq.kv is not None:
            self.kv.free(seq.kv)
            seq.kv = None

    def check_invariants(self) -> None:
        """Raise InvariantError if the scheduling rules are broken (used by tests)."""
        require(self._places_taken() <= self.batch_size, "batch exceeded")
        require(self.num_running <= self.batch_size, "too many running")
        for seq in self._running.values():
            require(seq.state is S.RUNNING and self._holds_prompt(seq), "bad running seq")
            require(seq.landed, "running before KV arrived")
            require(seq.ready and seq.first_token is not None, "running before its first token")
        for seq in self._transferring.values():
            require(seq.state is S.TRANSFERRING and self._holds_prompt(seq), "bad transferring seq")
        for seq in self._prefilling.values():
            require(seq.state is S.PREFILLING and (seq.local or seq.ready) and self._holds_prompt(seq),
                    "bad prefilling seq")
            require(seq.kv.cached_tokens <= seq.computed < len(seq.prefill_ids), "bad prefill progress")
            require(len(seq.kv.blocks) >= self.kv.blocks_for(len(seq.prefill_ids) + 1), "no block for its next token")
        for seq in (*self._waiting.values(), *self._local.values()):
            require(seq.state is S.WAITING and seq.kv is None, "bad waiting seq")
            require(seq.local == (seq.request_id in self._local), "a local request in the wrong queue")
        orders = [s.order for s in self._preempted.values()]
        require(orders == sorted(orders), "the preempted queue is not oldest first")
        for seq in self._preempted.values():
            require(seq.state is S.PREEMPTED and seq.kv is None and seq.preemptions > 0, "bad preempted seq")
            require(seq.local or seq.ready, "a preempted request that can compute nothing here")
            require(not seq.ready or len(seq.recompute) >= seq.prompt_len, "a preempted request without its context")

    def _holds_prompt(self, seq: DecodeSeq) -> bool:
        return seq.kv is not None and len(seq.kv.blocks) >= self.kv.blocks_for(seq.prompt_len)


class _Landed:
    """The handle of a receive with nothing to receive: already done."""

    def done(self) -> bool:
        return True

    def failed(self) -> bool:
        return False

    def finished(self) -> bool:
        return True

    @property
    def error(self) -> str | None:
        return None


LANDED = _Landed()
