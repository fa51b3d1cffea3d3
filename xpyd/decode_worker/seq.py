"""A request as the decode scheduler tracks it (``DecodeSeq``), and a chunk of what it computes on this worker
(``PromptChunk``: a local prompt's, or a preempted request's recompute)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from xpyd.worker.kv_cache import RequestKV
from xpyd.worker.kv_connector import TransferHandle
from xpyd.worker.request import DECODE_TRANSITIONS, RequestState, check_transition

S = RequestState


@dataclass(eq=False, slots=True)
class DecodeSeq:
    request_id: str
    prefill_addr: str
    payload: Any = None  # the worker's per-request extras (sampling, output sink)
    state: RequestState = S.WAITING
    ready: bool = False  # prefill has the KV and the first token
    known: bool = False  # the prompt's length and block hashes are known (prefilling or ready)
    part_blocks: int = 0  # prefilling: pull in parts of this many blocks, each sent as soon as it is computed
    transfer_ids: list[str] = field(default_factory=list)  # the receives expected for it (abort them all)
    first_token: int | None = None
    kv: RequestKV | None = None
    recv_token: TransferHandle | None = None  # its receive (the KV connector's handle)
    landed: bool = False  # its KV is all here (the connector said so, or nothing had to move)
    error: str | None = None
    deadline: float = math.inf  # monotonic time by which prefill must be ready / the KV must have arrived
    prompt_len: int = 0  # prompt tokens (their KV comes from prefill): known once prefill says "ready"
    final_len: int = 0  # prompt + max_tokens: the most tokens it can reach
    hashes: list[int] = field(default_factory=list)  # chain hashes of the prompt's full blocks (from prefill)
    tail: tuple[int, ...] = ()  # the prompt's tokens after its full blocks (from prefill)
    cached_tokens: int = 0  # prompt tokens prefill reused from its cache (reported in usage)
    prefill_steps: int | None = None  # not ready: the prefill worker's forward passes when it last said so
    local: bool = False  # its prompt is computed here (``plan_prefill``), not pulled from a prefill worker
    prompt_ids: Sequence[int] = ()  # local: the prompt's tokens (known, with its facts, when it is added)
    computed: int = 0  # prefilling: leading ``prefill_ids`` whose KV is in its blocks (its cached prefix, then chunks)
    order: int = 0  # arrival order (set by the scheduler): the newest is preempted first
    preemptions: int = 0  # times it gave its blocks back
    recompute: Sequence[int] = ()  # preempted after its first token: its prompt and output but the last token
    stalled_since: float | None = None  # preempted while it ran: when its last token came (the engine's)

    @property
    def needs_kv(self) -> bool:
        """False when prefill's first token is its last (max_tokens 1): nothing is decoded after it."""
        return self.final_len != self.prompt_len + 1

    @property
    def prefill_ids(self) -> Sequence[int]:
        """What this worker computes before the request (re)joins the batch: a local prompt, or what a request
        preempted after its first token recomputes."""
        return self.recompute if self.ready else self.prompt_ids

    def set_state(self, new: RequestState) -> None:
        check_transition(DECODE_TRANSITIONS, self.request_id, self.state, new)
        self.state = new


@dataclass(frozen=True, slots=True)
class PromptChunk:
    """Prompt tokens [start, end) of a local request, computed in this step (the shape
    ``xpyd.worker.stepping.prefill_chunks`` takes)."""

    seq: DecodeSeq
    start: int
    end: int
    replay: bool = False  # of a recompute (``DecodeSeq.recompute``): nothing is sampled from it

    @property
    def last(self) -> bool:
        """Does it end what the request computes (a prompt's last: its logits give the first token)?"""
        return self.end == (len(self.seq.recompute) if self.replay else self.seq.prompt_len)

    @property
    def ids(self) -> Sequence[int]:
        """The tokens up to its end."""
        return (self.seq.recompute if self.replay else self.seq.prompt_ids)[: self.end]
