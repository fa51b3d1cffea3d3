"""Per-request work items handed to an engine thread, and what comes back."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from xpyd.model.logprobs import TokenLogprob
from xpyd.model.output import OutputProcessor, StopParams
from xpyd.model.sampling_params import GREEDY_BELOW, SamplingParams, TokenHistory
from xpyd.signal.request_id import RequestId
from xpyd.worker.phases import PhaseStamps


@dataclass(frozen=True, slots=True)
class TokenEvent:
    text: str  # delta to show the client
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int  # generated so far, including the first token
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage.prompt_tokens_details)
    logprobs: tuple[TokenLogprob, ...] = ()  # the logprobs of the tokens this event adds (when asked for)
    token_ids: tuple[int, ...] = ()  # the output's ids generated since the last event (its text is this one's)


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    status: int
    message: str
    # The failure lies on the path between this worker and its peer worker for the request (the signal
    # plane, or the KV transfer), not in either worker: the proxy then avoids that prefill/decode pair.
    kv_path: bool = False


Event = TokenEvent | ErrorEvent


class EventDispatch:
    """Hands events from the engine thread to the event loop in batches (one per worker and loop).

    The first event after a flush schedules one ``call_soon_threadsafe``; every event put before that
    flush runs rides along. So while the event loop is busy (writing other streams), the requests of one
    engine step cost it one wake-up and one self-pipe write, not one per request. Order is kept.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, Event]] = []

    def put(self, queue: asyncio.Queue, event: Event) -> None:
        with self._lock:
            self._pending.append((queue, event))
            if len(self._pending) > 1:  # a flush is scheduled already
                return
        try:
            self._loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, event in pending:
            queue.put_nowait(event)


class OutputSink:
    """Thread-safe hand-off from the engine thread to the request's asyncio task.

    ``ended``: an error or the last token was put (a request that failed here is not failed again).
    """

    def __init__(self, dispatch: EventDispatch) -> None:
        self._dispatch = dispatch
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.ended = False

    def put(self, event: Event) -> None:
        if isinstance(event, ErrorEvent) or event.finish_reason is not None:
            self.ended = True
        self._dispatch.put(self.queue, event)


@dataclass(eq=False, slots=True, weakref_slot=True)  # (the engine tracks its items weakly)
class WorkItem:
    """A tokenized, validated request as the engine thread sees it."""

    request_id: RequestId
    prompt_ids: list[int]
    sampling: SamplingParams
    stop: StopParams
    sink: OutputSink
    generator: object | None = None  # the runner's random state for this request (its sampler makes it)
    output: OutputProcessor | None = None
    arrival: float = field(default_factory=time.monotonic)  # validated and handed over (for latency metrics)
    open_ended: bool = False  # no max_tokens given: as many as the context allows (decode settles it when ready)
    cache_salt: str | None = None  # the request's cache_salt: its KV blocks are shared only with the same salt
    token_history: TokenHistory | None = None  # what penalties and min_tokens read (made by ``start_output``)
    logprobs: int | None = None  # each sampled token's logprob with this many alternatives (None: not asked)
    prompt_scores: int | None = None  # each prompt token's logprob with this many alternatives (None: not asked)
    prompt_only: bool = False  # max_tokens 0 (with echo): the prompt is computed (and scored), nothing sampled
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1.., as computed
    sampled_logprob: TokenLogprob | None = None  # the last sampled token's (set by the step, taken by the engine)
    grammar: object | None = None  # structured output: its grammar matcher (``xpyd.model.grammar.Matcher``)
    # A migrated request (``xpyd.proxy.migration``): the output tokens its client already has, in order. Its
    # ``prompt_ids`` (where tokenized) end with them: their KV is computed as the prompt's; the output replays
    # them (text, stop strings, penalties, grammar, one random draw each) before it samples the next.
    resumed: tuple[int, ...] = ()
    local_prefill: bool = False  # a decode worker computes its prompt and samples its first token itself
    reported: int = 0  # output ids already named by an event (``new_ids``)
    stamps: PhaseStamps = field(default_factory=PhaseStamps)  # when it passed each point (``xpyd.worker.phases``)

    def start_output(self, tokenizer, sampler) -> None:
        self.generator = sampler.new_generator(self.sampling.seed)
        self.output = OutputProcessor(tokenizer, self.stop)
        if not self.sampling.plain:  # (the output's ids: the first token too, on the decode worker prefill's)
            prompt = self.prompt_ids[:len(self.prompt_ids) - len(self.resumed)] if self.resumed else self.prompt_ids
            self.token_history = TokenHistory(prompt if self.sampling.needs_prompt else (), self.output.token_ids)
        if self.resumed:
            self._replay(sampler)

    def _replay(self, sampler) -> None:
        """Bring the output to where the migrated request stood: its client has these tokens' text."""
        draws = self.sampling.temperature >= GREEDY_BELOW  # (greedy draws nothing)
        for token in self.resumed:
            _, finish = self.output.append(token)
            if finish is not None:
                raise ValueError(f"the resumed output ends at token {token}: nothing is left to generate")
            if self.grammar is not None and not self.grammar.accept(token):
                raise ValueError(f"the resumed output's token {token} breaks the request's grammar")
            if draws:
                sampler.skip_draw(self.generator)
        self.reported = len(self.resumed)

    def new_ids(self) -> tuple[int, ...]:
        """The output's ids no event named yet (for the next event: its text is theirs)."""
        ids = self.output.token_ids
        new, self.reported = tuple(ids[self.reported:]), len(ids)
        return new

    def prompt_tokens(self, context_len: int) -> int:
        """The client's prompt length, from the length of the context computed as prompt (a migrated request's
        includes the output it resumes)."""
        return context_len - len(self.resumed)

    def take_logprobs(self) -> tuple[TokenLogprob, ...]:
        """The logprob of the token just sampled, for its event (empty when not asked for)."""
        lp, self.sampled_logprob = self.sampled_logprob, None
        return () if lp is None else (lp,)

    @property
    def reuses_cache(self) -> bool:
        """Whether its prompt may start after a cached prefix: not when every prompt token is scored."""
        return self.prompt_scores is None

    def history(self) -> TokenHistory | None:
        """The token history as of now, for the sampler (None for plain sampling parameters)."""
        h = self.token_history
        return None if h is None else h.sync()
