"""Prefill scheduler: decides, never moves bytes.

Queues a request moves through::

    waiting --(admitted: room, KV blocks)--> running --(its last prompt token computed)--> transferring
    running: its prompt is computed one step at a time (the whole prompt, or chunks of it)
    transferring: KV held in the pool until a decode worker pulls it; then the
    send's completion token is polled each step --> finished (blocks released)
    KV held (no send started) and not claimed by its decode worker longer than the
    lease (kv_ttl) is ``expired``: the engine releases it. Claimed KV stays until it
    is pulled, released, or its decode worker is gone (the engine decides that).

Steps (``plan``): unchunked (``chunk=0``), a step is one whole prompt, oldest eligible request first, and
nothing else starts until it is done. Chunked (``chunk=N``), a step computes at most N prompt tokens, and
once the step cost is learned (``cost``: ``step_cost.StepCost``) at most what N tokens of a fresh prompt
take: a long prompt's later chunks, whose attention covers more of the prompt, get fewer tokens, so no step
runs much longer than the first, and a prompt that arrives waits for at most one such step. Tokens are
taken from the running and waiting requests shortest-remaining first: short prompts overtake long ones and
several share one forward pass. A step that computes a new prompt whole (its first token comes from it) is
topped up only with chunks that end their prompts, and (once the cost is known) only while the step stays within
``TOP_UP_SHARE`` of the budget: a long prompt does not lengthen it much, and continues in the next step from its
own KV (a short prompt behind a long one waits for one step, then its own short one: docs/benchmarks.md "Mixed
steps sized by a learned step cost", "Chunked prefill"). A prompt whose KV
streams to its decode worker ends with a chunk of just its last KV part (``split_at``): what is left to
move once the prompt is computed is that part alone.
Aging: a request that could have run but got no token for ``age_steps`` steps in a
row goes first (oldest first among those), so a long prompt is never starved by a stream of short ones.

Invariants: RUNNING + TRANSFERRING <= batch_size; unchunked, at most one request RUNNING; every
RUNNING/TRANSFERRING request holds the KV blocks of its whole prompt (its cached prefix shared with other
requests, the rest its own); a waiting request holds none. A request starts only when the pool has the
blocks of its whole prompt (`KVCache.admit`), and never takes another: its later chunks write into blocks it
already holds, so the pool cannot run out in the middle of a prompt and nothing is ever preempted here (a
request that finds no blocks waits in the queue until held KV is pulled, released or expires); an aged
request that cannot get them holds back every waiting request behind it rather than being overtaken.

Admission per decode worker (``admission``): KV waits here for the decode worker named in the request id.
Places go only to decode workers with requests waiting or held here, however many others are live: one
decode worker alone may take the whole batch. While several have requests waiting, each may hold at most
its fair share of the places and of the KV blocks, so one slow or full decode worker cannot keep every
place from the others, and one with new demand takes the next place that frees. Requests whose decode
worker is at its share wait.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from xpyd.worker.request import PREFILL_TRANSITIONS, RequestState, check_transition, require
from xpyd.worker.kv_cache import KVCache, RequestKV
from xpyd.prefill_worker.admission import admissible
from xpyd.prefill_worker.step_cost import StepCost
from xpyd.worker.kv_connector import TransferHandle

S = RequestState


@dataclass(eq=False, slots=True)
class PrefillSeq:
    request_id: str
    prompt_ids: list[int]
    payload: Any = None  # the worker's per-request extras (sampling, output sink)
    state: RequestState = S.WAITING
    hashes: list[int] = field(default_factory=list)  # chain hashes of the prompt's full blocks
    kv: RequestKV | None = None  # its KV blocks while running / transferring
    first_token: int | None = None
    pull: "Pull | None" = None  # its decode worker's pull: where the KV goes, the sends started so far
    error: str | None = None
    cancel_requested: bool = False  # dropped while in a step or with a send in flight: ends when those end
    end_state: RequestState = S.ABORTED  # ... in this state
    held_since: float = 0.0  # monotonic time the KV started waiting for a pull (set by prefilled)
    peer: str = ""  # the decode worker this request's KV waits for (its address in the request id)
    claimed: bool = False  # that decode worker claimed it: no kv_ttl; kept while the worker lives
    computed: int = 0  # leading prompt tokens whose KV is in its blocks (cached or computed so far)
    starved: int = 0  # steps in a row it could have run and got no token
    in_step: bool = False  # part of the step being computed (planned, not yet reported back)
    order: int = 0  # arrival order (set by the scheduler)
    split_at: int = 0  # a chunk ends here if it would cross it (where a streamed prompt's last KV part starts)
    reuse: bool = True  # may start after a cached prefix (not when every prompt token's logprob is wanted)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def remaining(self) -> int:
        """Prompt tokens still to compute."""
        return self.prompt_len - self.computed

    def set_state(self, new: RequestState) -> None:
        check_transition(PREFILL_TRANSITIONS, self.request_id, self.state, new)
        self.state = new


@dataclass(eq=False, slots=True)
class Pull:
    """A decode worker's pull of one request's KV, sent in ``parts`` parts (each as soon as its blocks are
    computed: the KV streams while the prompt's later chunks compute); ``plan`` is the engine's (where
    each part goes)."""

    parts: int
    plan: Any = None
    tokens: list[TransferHandle] = field(default_factory=list)  # the sends started, in part order

    @property
    def all_sent(self) -> bool:
        return len(self.tokens) == self.parts

    def in_flight(self) -> bool:
        return any(not t.finished() for t in self.tokens)

    def failure(self) -> str | None:
        return next((t.error or "transfer failed" for t in self.tokens if t.failed()), None)


@dataclass(frozen=True, slots=True)
class Chunk:
    """Prompt tokens [start, end) of ``seq`` to compute in this step."""

    seq: PrefillSeq
    start: int
    end: int

    @property
    def last(self) -> bool:
        """Does it end the prompt (its logits give the first token)?"""
        return self.end == self.seq.prompt_len

    @property
    def ids(self) -> list[int]:
        """The prompt's tokens up to its end."""
        return self.seq.prompt_ids[: self.end]


AGE_STEPS = 8  # steps a runnable request may go without a token before it goes first
TOP_UP_SHARE = 0.5  # a step giving a new prompt its first token: at most this share of the budget in all (the
# new prompts' own chunks aside), so chunks that end running prompts lengthen it by little


@dataclass(slots=True)
class PrefillScheduler:
    batch_size: int
    kv: KVCache
    chunk: int = 0  # prompt tokens per step (0: whole prompts, one at a time)
    age_steps: int = AGE_STEPS
    cost: StepCost | None = None  # what a step costs, learned (chunked: each step takes what `chunk` fresh tokens do)
    _waiting: deque[PrefillSeq] = field(default_factory=deque)
    _live: "OrderedDict[str, PrefillSeq]" = field(default_factory=OrderedDict)  # not final
    _running: "OrderedDict[str, PrefillSeq]" = field(default_factory=OrderedDict)
    _transferring: dict[str, PrefillSeq] = field(default_factory=dict)
    _arrivals: int = 0

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if self.chunk < 0:
            raise ValueError("chunk must be >= 0 (0: unchunked)")
        if self.age_steps < 1:
            raise ValueError("age_steps must be >= 1")

    # --- queries -----------------------------------------------------------
    def get(self, request_id: str) -> PrefillSeq | None:
        return self._live.get(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_transferring(self) -> int:
        return len(self._transferring)

    def running(self) -> list[PrefillSeq]:
        return list(self._running.values())

    def transferring(self) -> list[PrefillSeq]:
        return list(self._transferring.values())

    def expired(self, now: float, ttl: float) -> list[PrefillSeq]:
        """Unclaimed requests whose KV has waited for a pull (no send started) for ``ttl`` seconds or more."""
        return [s for s in self.held() if not s.claimed and now - s.held_since >= ttl]

    def held(self) -> list[PrefillSeq]:
        """Requests whose KV waits for a pull (no send started, not being dropped)."""
        return [s for s in self._transferring.values() if s.pull is None and not s.cancel_requested]

    def queued_tokens(self) -> int:
        """Prompt tokens still to compute: the waiting requests' and the running ones' (cached prefixes
        and chunks already computed excluded); what a router weighs as this worker's queue."""
        return sum(s.prompt_len for s in self._waiting) + sum(s.remaining for s in self._running.values())

    def sends_in_flight(self) -> bool:
        return any(s.pull is not None and s.pull.in_flight() for s in self._sending())

    def sending(self) -> list[PrefillSeq]:
        """Requests with a send in flight (running, streamed, or prefilled)."""
        return [s for s in self._sending() if s.pull.in_flight()]

    def has_work(self) -> bool:
        return bool(self._live)

    # --- transitions -------------------------------------------------------
    def add(self, seq: PrefillSeq) -> None:
        if seq.request_id in self._live:
            raise ValueError(f"duplicate request id {seq.request_id}")
        seq.order = self._arrivals
        self._arrivals += 1
        self._live[seq.request_id] = seq
        self._waiting.append(seq)

    def plan(self) -> list[Chunk]:
        """The next step's work (empty: nothing can run now). Planned requests are ``in_step`` until ``chunk_done``/``prefilled``/``fail_running`` report them."""
        if any(s.in_step for s in self._running.values()):
            raise ValueError("the previous step has not been reported back")
        if self.chunk == 0:
            if self._running:
                return []  # (cannot happen: an unchunked step computes a whole prompt)
            seq = next(iter(self._admissible()), None)
            return [self._take(seq, seq.remaining)] if seq is not None and self._admit(seq) else []
        budget, aged = self.chunk, self.age_steps
        seconds = self._step_seconds()  # (None: nothing learned yet, tokens alone)
        candidates = [s for s in self._running.values() if not s.cancel_requested] + self._admissible()
        candidates.sort(key=lambda s: (s.starved < aged, s.remaining if s.kv else s.prompt_len, s.order))
        steps: list[Chunk] = []
        blocked = False  # an aged request waits for KV blocks: no waiting request overtakes it
        first = False  # the step computes a new prompt whole: other chunks join it only to end their prompt
        top_up = None  # (then, once the cost is known) the seconds left for them: TOP_UP_SHARE of the step in all
        full = seconds
        for seq in candidates:
            waiting = seq.state is S.WAITING
            if budget == 0 or (waiting and (blocked or not self._admit(seq))):
                blocked = blocked or (waiting and seq.starved >= aged)
                seq.starved += 1
                continue
            want = min(budget, seq.remaining)
            limit = seconds if top_up is None or waiting or seq.starved >= aged else min(seconds, top_up)
            fits = want if seconds is None else min(want, self.cost.coefficients.tokens_within(seq.computed, limit))
            n = self._cut(seq, fits or (0 if steps else 1))  # (a step computes a token at least)
            if n == 0 or (first and n < seq.remaining and seq.starved < aged):
                seq.starved += 1
                continue
            steps.append(self._take(seq, n))
            first = first or (waiting and steps[-1].last)
            taken = steps[-1].end - steps[-1].start
            budget = budget - taken if fits == want else 0  # (cut short by the step's time: the step is full)
            if seconds is not None:
                spent = self.cost.coefficients.chunk_seconds(steps[-1].start, taken)
                seconds -= spent
                if top_up is not None:
                    top_up -= spent
                elif first:  # (the step's first new prompt just joined: what is spent so far counts)
                    top_up = full * TOP_UP_SHARE - (full - seconds)
        return steps

    def chunk_done(self, chunk: Chunk) -> None:
        """A chunk that does not end its prompt is computed: its request waits for its next step (or ends
        here if it was released meanwhile)."""
        seq = chunk.seq
        self._expect_in_step(seq)
        if chunk.last:
            raise ValueError(f"request {seq.request_id}: the last chunk is reported with prefilled()")
        seq.in_step = False
        seq.computed = chunk.end
        self._end_if_dropped(seq)

    def prefilled(self, seq: PrefillSeq, first_token: int | None, now: float = 0.0) -> None:
        """The whole prompt is computed: hold the KV (leased from ``now``) until a decode worker pulls it."""
        self._expect_in_step(seq)
        seq.in_step = False
        seq.computed = seq.prompt_len
        del self._running[seq.request_id]
        seq.first_token = first_token
        seq.held_since = now
        seq.set_state(S.TRANSFERRING)
        self._transferring[seq.request_id] = seq
        self._end_if_dropped(seq)

    def fail_running(self, seq: PrefillSeq, error: str) -> None:
        if seq.request_id not in self._running:
            raise ValueError(f"request {seq.request_id} is not running")
        seq.in_step = False
        seq.error = error
        seq.cancel_requested, seq.end_state = True, S.FAILED
        self._end_if_dropped(seq)  # (now, unless sends of its first parts are in flight)

    def start_pull(self, request_id: str, parts: int, plan: Any = None) -> PrefillSeq:
        """Its decode worker pulls the KV of ``request_id`` (running or prefilled), in ``parts`` parts."""
        seq = self._live.get(request_id)
        if seq is None or seq.state not in (S.RUNNING, S.TRANSFERRING) or seq.pull is not None or seq.cancel_requested:
            raise ValueError(f"request {request_id} has no KV waiting to be pulled")
        if parts < 1:
            raise ValueError("a pull has at least one part")
        seq.pull = Pull(parts, plan)
        return seq

    def part_sent(self, seq: PrefillSeq, token: TransferHandle) -> None:
        """The send of the pull's next part started."""
        if seq.pull is None or seq.pull.all_sent or seq.state.is_final:
            raise ValueError(f"request {seq.request_id} has no part left to send")
        seq.pull.tokens.append(token)

    def start_send(self, request_id: str, token: TransferHandle) -> PrefillSeq:
        """A pull in one part, started at once."""
        seq = self.start_pull(request_id, 1)
        self.part_sent(seq, token)
        return seq

    def poll(self) -> tuple[list[PrefillSeq], list[PrefillSeq]]:
        """Check send tokens without blocking: (requests that ended, releasing their blocks; requests one
        of whose parts failed, now being dropped: the caller aborts their other sends)."""
        ended, broken = [], []
        for seq in self._sending():
            pull = seq.pull
            error = pull.failure()
            if error is not None and not seq.cancel_requested:
                seq.error, seq.cancel_requested, seq.end_state = error, True, S.FAILED
                broken.append(seq)
            if pull.in_flight():
                continue
            if seq.cancel_requested:
                if self._end_if_dropped(seq):
                    ended.append(seq)
            elif seq.state is S.TRANSFERRING and pull.all_sent:
                self._end(seq, S.FINISHED)
                ended.append(seq)
        return ended, broken

    def release(self, request_id: str, state: RequestState = S.ABORTED) -> PrefillSeq | None:
        """Drop a request (decode does not need it, or the client went away).

        A request in the step being computed, or with a send in flight, is only marked: it ends when its
        step is reported back, or when its send token is finished (the caller aborts the send in the
        backend). Any other ends now, its blocks released.
        """
        seq = self._live.get(request_id)
        if seq is None:
            return None
        if seq.state is S.WAITING:
            self._waiting.remove(seq)
            self._end(seq, state)
        else:
            seq.cancel_requested, seq.end_state = True, state
            self._end_if_dropped(seq)
        return seq

    # --- internals ---------------------------------------------------------
    def _admissible(self) -> list[PrefillSeq]:
        """Waiting requests that may start now as far as places go (oldest first; ``admission``)."""
        holding = ((s.peer, len(s.kv.blocks)) for s in (*self._running.values(), *self._transferring.values()))
        room = self.batch_size - self.num_running - self.num_transferring
        return admissible(self._waiting, holding, room, self.batch_size, self.kv.allocator.num_blocks,
                          self.kv.blocks_for)

    def _step_seconds(self) -> float | None:
        """A chunked step's time for its chunks (its overhead apart): what ``chunk`` tokens of a fresh prompt
        take. None while no cost is known (the step is budgeted in tokens alone)."""
        if self.cost is None or not self.cost.known:
            return None
        return self.cost.coefficients.chunk_seconds(0, self.chunk)

    def _admit(self, seq: PrefillSeq) -> bool:
        """Give ``seq`` the KV blocks of its whole prompt (its cached prefix shared): True if it starts."""
        n = seq.prompt_len
        # (the last token is computed: its logits; all of them when the prompt is scored)
        kv = self.kv.admit(seq.hashes, n, reuse_tokens=n - 1 if seq.reuse else 0)
        if kv is None:
            return False  # not enough free KV blocks yet: it runs when requests release theirs
        self._waiting.remove(seq)
        seq.kv = kv
        seq.computed = kv.cached_tokens
        seq.set_state(S.RUNNING)
        self._running[seq.request_id] = seq
        return True

    @staticmethod
    def _cut(seq: PrefillSeq, n: int) -> int:
        """``n`` tokens, or fewer if they would cross ``split_at`` (its last chunk computes only what its last
        KV part holds)."""
        return seq.split_at - seq.computed if seq.computed < seq.split_at < seq.computed + n else n

    def _take(self, seq: PrefillSeq, n: int) -> Chunk:
        n = self._cut(seq, n)
        seq.in_step = True
        seq.starved = 0
        return Chunk(seq, seq.computed, seq.computed + n)

    def _sending(self) -> list[PrefillSeq]:
        return [s for q in (self._running, self._transferring) for s in q.values() if s.pull is not None]

    def _end_if_dropped(self, seq: PrefillSeq) -> bool:
        """End a dropped request once it is in no step and none of its sends is in flight."""
        if not seq.cancel_requested or seq.in_step or (seq.pull is not None and seq.pull.in_flight()):
            return False
        self._end(seq, seq.end_state)
        return True

    def _expect_in_step(self, seq: PrefillSeq) -> None:
        if not seq.in_step or self._running.get(seq.request_id) is not seq:
            raise ValueError(f"request {seq.request_id} is not in the step being computed")

    def _end(self, seq: PrefillSeq, state: RequestState) -> None:
        seq.set_state(state)
        self._running.pop(seq.request_id, None)
        self._transferring.pop(seq.request_id, None)
        self._live.pop(seq.request_id, None)
        if seq.kv is not None:
            self.kv.free(seq.kv)
            seq.kv = None

    def check_invariants(self) -> None:
        """Raise InvariantError if the scheduling rules are broken (used by tests)."""
        require(self.chunk > 0 or self.num_running <= 1, "more than one unchunked prefill running")
        require(self.num_running + self.num_transferring <= self.batch_size, "batch exceeded")
        for seq in self._transferring.values():
            require(seq.state is S.TRANSFERRING and _holds_prompt(seq, self.kv), "bad transferring seq")
        for seq in self._running.values():
            require(seq.state is S.RUNNING and _holds_prompt(seq, self.kv), "bad running seq")
            require(seq.kv.cached_tokens <= seq.computed < seq.prompt_len, "bad running progress")
        for seq in self._waiting:
            require(seq.state is S.WAITING and seq.kv is None, "bad waiting seq")
        require(len(self._live) == len(self._waiting) + self.num_running + self.num_transferring,
                "lost track of a request")


def _holds_prompt(seq: PrefillSeq, kv: KVCache) -> bool:
    return seq.kv is not None and len(seq.kv.blocks) == kv.blocks_for(seq.prompt_len)
