"""A worker's answers to one request, written from its engine's events: the SSE body of a streamed request
(``stream_events``), the JSON answer (``collect``), and how both are named and shaped (``StreamShape``).

    engine thread -> OutputSink (TokenEvent | ErrorEvent) -> events() -> stream_events: chunks, [usage], [timing], [DONE]
                                                                      -> collect: one completion response

A stream that stops before its end (the client went away) drops the request in the engine. With the proxy's
``token_ids`` asked (``xpyd.api.resume``), every token chunk and the JSON answer name their output tokens.

A stream silent for ``KEEPALIVE_SECONDS`` (its request queued, waiting for its KV, or preempted behind longer
ones) writes an SSE comment (``SSE_KEEPALIVE``), which every SSE reader skips: the proxy's read timeout and the
client's count from the last bytes, so a request that waits long is not cut while the worker still has it.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

from xpyd.api.openai import APIError, RequestKind
from xpyd.api.responses import (KEEPALIVE_SECONDS, SSE_DONE, SSE_KEEPALIVE, completion_response, merge_logprobs, sse,
                                stream_chunk, usage_chunk)
from xpyd.api.resume import CHUNK_IDS_KEY
from xpyd.worker.logprob_format import ResponseExtras
from xpyd.worker.timing import AnswerClock
from xpyd.worker.work_item import ErrorEvent, OutputSink, TokenEvent, WorkItem




class _KeepAlive:
    """`events`' word that the stream has been silent for its keep-alive interval."""


KEEPALIVE = _KeepAlive()


class Aborts(Protocol):
    def abort(self, request_id: str) -> None: ...


def error_body(ev: ErrorEvent) -> dict:
    """An in-stream error event's body: the status as an integer ``code`` (as vLLM does: the proxy answers with
    it, a 504 stays 504), and ``"kv_path": true`` when the failure lies between the two workers of the request
    (the proxy then avoids that pair for a while)."""
    body = APIError(ev.status, ev.message, "server_error", code=ev.status).to_dict()
    if ev.kv_path:
        body["error"]["kv_path"] = True
    return body



async def collect(item: WorkItem, extras: ResponseExtras, shape: StreamShape,
                   single_event: bool) -> dict | APIError:
    """The JSON answer of ``item`` once it ended (or its error)."""
    text, logprobs, finish, prompt_tokens, completion_tokens, cached, ids = [], [], None, 0, 0, 0, []
    async for ev in events(item.sink, single_event):
        if isinstance(ev, ErrorEvent):
            return APIError(ev.status, ev.message, "server_error" if ev.status >= 500 else "invalid_request_error")
        text.append(extras.first_text(ev.text) if not text else ev.text)
        logprobs.append(extras.event_logprobs(ev.completion_tokens, ev.logprobs))
        finish, prompt_tokens, completion_tokens = ev.finish_reason, ev.prompt_tokens, ev.completion_tokens
        cached = ev.cached_tokens
        ids.extend(ev.token_ids)
    answer, calls = "".join(text), None
    if extras.tools is not None:  # content and tool calls (a colocated answer)
        message = extras.tools.message(answer)
        answer, calls, finish = message["content"] or "", message["tool_calls"], extras.tools.finish_reason(finish)
    answer = completion_response(shape.id, shape.created, shape.model, shape.kind, answer, finish,
                                 prompt_tokens, completion_tokens, cached, _stop_reason(item),
                                 merge_logprobs(logprobs), extras.prompt_logprobs(), calls)
    if shape.token_ids:
        answer[CHUNK_IDS_KEY] = ids
    return answer


def _stop_reason(item: WorkItem | None) -> str | int | None:
    """The stop string or token id that ended ``item`` (the engine set it before it put the last event)."""
    return item.output.stop_reason if item is not None and item.output is not None else None


async def events(sink: OutputSink, single_event: bool,
                 keepalive: float | None = None) -> AsyncIterator[TokenEvent | ErrorEvent | _KeepAlive]:
    """The request's events up to its last; with ``keepalive``, ``KEEPALIVE`` after each that many seconds
    without one."""
    while True:
        queue = sink.queue
        if keepalive is None or not queue.empty():
            ev = await queue.get()
        else:
            try:
                async with asyncio.timeout(keepalive):
                    ev = await queue.get()
            except TimeoutError:
                yield KEEPALIVE
                continue
        yield ev
        if isinstance(ev, ErrorEvent) or ev.finish_reason is not None or single_event:
            return


@dataclass(frozen=True, slots=True)
class StreamShape:
    """How a response is written around its tokens: its name, and the chunks it opens and ends with."""

    kind: RequestKind
    id: str
    created: int
    model: str
    include_usage: bool  # end with the usage chunk
    role_chunk: bool  # chat: open with the assistant role chunk
    token_ids: bool = False  # each token chunk names its tokens (``CHUNK_IDS_KEY``, last): the proxy asked

    def chunk(self, text: str | None, finish_reason: str | None, role: bool = False,
              stop_reason: str | int | None = None, logprobs: dict | None = None, delta: dict | None = None,
              ids: list[int] | None = None) -> bytes:
        obj = stream_chunk(self.id, self.created, self.model, self.kind, text, finish_reason, role=role,
                           stop_reason=stop_reason, logprobs=logprobs, delta=delta)
        if ids is not None:
            obj[CHUNK_IDS_KEY] = ids
        return sse(obj)

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> bytes:
        return sse(usage_chunk(self.id, self.created, self.model, self.kind, prompt_tokens, completion_tokens,
                               cached_tokens))


class _Ended:
    """Whether a stream ended (answered to its end, or its request already dropped)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = False


def _abort_unless_ended(engine: Aborts, rid: str, ended: _Ended) -> None:
    if not ended.value:
        ended.value = True
        engine.abort(rid)


def stream_events(engine: Aborts, rid: str, shape: StreamShape, sink: OutputSink,
                  single_event: bool, clock: AnswerClock | None = None,
                  item: WorkItem | None = None, extras: ResponseExtras | None = None,
                  keepalive: float | None = KEEPALIVE_SECONDS) -> AsyncIterator[bytes]:
    """The SSE body of a streamed request. Whenever it stops before the end (the client went away) the
    request is dropped: in the generator's ``finally``, or, for a generator that never ran (the handler
    cancelled between returning the response and its first iteration), when the generator object goes."""
    ended = _Ended()
    gen = _stream(engine, rid, shape, sink, single_event, ended, clock, item, extras, keepalive)
    weakref.finalize(gen, _abort_unless_ended, engine, rid, ended)
    return gen


async def _stream(engine: Aborts, rid: str, shape: StreamShape, sink: OutputSink, single_event: bool,
                  ended: _Ended, clock: AnswerClock | None, item: WorkItem | None = None,
                  extras: ResponseExtras | None = None, keepalive: float | None = None) -> AsyncIterator[bytes]:
    prompt_tokens = completion_tokens = cached = 0  # (decode learns the prompt's length from prefill: from events)
    first = True
    ids: list[int] | None = [] if shape.token_ids else None  # the tokens of the next chunk's text
    try:
        if shape.kind is RequestKind.CHAT and shape.role_chunk:
            yield shape.chunk(None, None, role=True)
        async for ev in events(sink, single_event, keepalive):
            if ev is KEEPALIVE:
                yield SSE_KEEPALIVE
                continue
            if isinstance(ev, ErrorEvent):
                ended.value = True
                # the status as an integer `code`, as vLLM does: the proxy answers with it (a 504 stays 504)
                yield sse(error_body(ev))
                yield SSE_DONE
                return
            prompt_tokens, completion_tokens, cached = ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens
            text, logprobs = ev.text, None
            if extras is not None:
                text = extras.first_text(text) if first else text
                logprobs = extras.event_logprobs(ev.completion_tokens, ev.logprobs)
            first = False
            if ids is not None:
                ids.extend(ev.token_ids)
            if extras is not None and extras.tools is not None:  # content and tool calls (a colocated answer)
                tools = extras.tools
                ending = ev.finish_reason is not None
                for delta in tools.delta(text) + (tools.finish() if ending else []):
                    yield shape.chunk(None, None, delta=delta)
                if ending:
                    yield shape.chunk(None, tools.finish_reason(ev.finish_reason), stop_reason=_stop_reason(item))
                continue
            if text or ev.finish_reason is not None or logprobs is not None:
                if clock is not None and text:
                    clock.chunk()
                yield shape.chunk(text, ev.finish_reason,
                                  stop_reason=_stop_reason(item) if ev.finish_reason is not None else None,
                                  logprobs=logprobs, ids=ids)
                if ids is not None:
                    ids = []
        ended.value = True
        if shape.include_usage:
            yield shape.usage(prompt_tokens, completion_tokens, cached)
        if clock is not None and clock.wanted:
            yield clock.comment()
        yield SSE_DONE
    finally:
        _abort_unless_ended(engine, rid, ended)  # the client went away: drop the request everywhere
