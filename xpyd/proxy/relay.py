"""A P/D call's output as the client gets it: one JSON body, or an SSE stream.

Either way the client sees the call's ``identity`` (one response id and
``created``, the served model name), prefill's first token and then decode's
part. A streaming response goes::

    [role chunk (chat)] -> first token            the proxy's own chunks
    -> tokens 2..n -> [usage chunk if asked]      decode's events, passed on as they came
    -> [: xpyd-timing {json}]                     with ``timing`` (--expose-worker-timing): the workers' own
    -> [DONE]                                     (prefill's TTFT, decode's gaps) and each side's phases,
                                                  the proxy's too (``answer_timing``, ``xpyd.api.phases``)

(a request that ended on prefill: the proxy writes the usage chunk itself).

A failure once the status line is sent becomes an error event and ``[DONE]``
(as vLLM does; its message as ``public`` gives it: without internal addresses or ids);
the body owns the call and the request's timer, and drops the call when it ends or,
if the client left before it started, when it is collected.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import AsyncIterator, Callable

from xpyd.api.openai import APIError, CompletionRequest, RequestKind
from xpyd.api.responses import SSE_DONE, completion_response, merge_logprobs, sse, stream_chunk, usage_chunk
from xpyd.api.tool_output import ToolOutput
from xpyd.api.phases import ProxyPhases
from xpyd.api.timing import COMMENT_PREFIX, WorkerTiming, timing_of_comment
from xpyd.proxy.http_server import LastChunk, StreamedResponse
from xpyd.proxy.metrics import Outcome, RequestTimer, outcome_of
from xpyd.proxy.decode_stream import TOKEN_CHUNK_KEY
from xpyd.proxy.pd_call import PDCall
from xpyd.proxy.phases import with_local
from xpyd.proxy.worker_api import FirstToken

log = logging.getLogger(__name__)

# ``TOKEN_CHUNK_KEY`` is in every token chunk once, as its JSON key (a quote inside a generated text is escaped, so
# the text cannot contain it): counting it finds the tokens of a relayed block without parsing.
DONE = LastChunk(SSE_DONE)  # sent with the end of the chunked body


async def complete_body(call: PDCall, req: CompletionRequest, first: FirstToken, timer: RequestTimer,
                        tool_parser: str | None = None) -> dict:
    """The whole (non-streaming) response, once decode has finished; with tools in play, its content and tool
    calls (``tool_parser``: the server's, for tool_choice auto)."""
    parts, finish_reason, stop_reason = [first.text], first.finish_reason, first.stop_reason
    logprobs = [first.logprobs]
    async for delta in call.rest():
        timer.token()
        parts.append(delta.text)
        logprobs.append(delta.logprobs)
        if delta.finish_reason is not None:
            finish_reason, stop_reason = delta.finish_reason, delta.stop_reason
    timer.decoded()  # (its last token read: xpyd.proxy.phases)
    usage, name = call.usage, call.identity
    text, calls = "".join(parts), None
    if req.tools is not None and req.tools.parsed:
        tools = ToolOutput(req.tools, tool_parser)
        message = tools.message(text)
        text, calls, finish_reason = message["content"] or "", message["tool_calls"], tools.finish_reason(finish_reason)
    return completion_response(name.id, name.created, name.model, req.kind, text, finish_reason,
                               usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens, stop_reason,
                               merge_logprobs(logprobs), first.prompt_logprobs, calls)


def stream_response(call: PDCall, req: CompletionRequest, first: FirstToken, headers: dict,
                    timer: RequestTimer, on_error: Callable[[APIError], None],
                    public: Callable[[APIError], APIError], timing: bool = False,
                    tool_parser: str | None = None) -> StreamedResponse:
    """A 200 SSE response relaying ``call``; it owns the call and ``timer`` from here. ``on_error`` sees a
    failure as it is; the client, as ``public`` makes it. ``timing``: end with the workers' timing comment
    (without it a timing comment from decode is dropped)."""
    body = _stream(call, req, first, on_error, public, timer, timing, tool_parser)
    # If the client leaves before the body starts, the generator never runs
    # its finally; drop the upstream calls when it is collected instead.
    weakref.finalize(body, _abandon, call, timer)
    headers["Cache-Control"] = "no-cache"
    return StreamedResponse(body, status=200, content_type="text/event-stream", headers=headers)


def stream_body(call: PDCall, req: CompletionRequest, first: FirstToken, timer: RequestTimer,
                on_error: Callable[[APIError], None], public: Callable[[APIError], APIError],
                tool_parser: str | None = None) -> AsyncIterator[bytes]:
    """The SSE body of ``call`` (as ``stream_response`` sends it); it closes the call when it ends."""
    return _stream(call, req, first, on_error, public, timer, tool_parser=tool_parser)


def _abandon(call: PDCall, timer: RequestTimer) -> None:
    call.abort()
    timer.end(Outcome.ABORTED)  # no-op if the body ran to its end


async def _stream(
    call: PDCall, req: CompletionRequest, first: FirstToken,
    on_error: Callable[[APIError], None], public: Callable[[APIError], APIError], timer: RequestTimer,
    timing: bool = False, tool_parser: str | None = None,
) -> AsyncIterator[bytes]:
    kind, name = req.kind, call.identity
    decoded: bytes | None = None

    def chunk(text: str | None, finish_reason: str | None, role: bool = False,
              stop_reason: str | int | None = None, logprobs: dict | None = None, delta: dict | None = None) -> bytes:
        return sse(stream_chunk(name.id, name.created, name.model, kind, text, finish_reason, role=role,
                                stop_reason=stop_reason, logprobs=logprobs, delta=delta))

    try:
        if kind is RequestKind.CHAT:
            yield chunk(None, None, role=True)
        if req.tools is not None and req.tools.parsed:  # content and tool calls: decode's deltas read, not relayed
            async for block in _with_tools(call, req, first, ToolOutput(req.tools, tool_parser), chunk, timer):
                yield block
        elif first.finish_reason is not None:
            if first.text:  # (stamped as the chunk is handed to the connection: xpyd.proxy.phases)
                timer.written(first)
            yield chunk(first.text or None, first.finish_reason, stop_reason=first.stop_reason,
                        logprobs=first.logprobs)
            if req.include_usage:
                usage = first.usage
                yield sse(usage_chunk(name.id, name.created, name.model, kind, usage.prompt_tokens,
                                      usage.completion_tokens, usage.cached_tokens))
        else:
            if first.text or first.logprobs is not None:
                if first.text:  # the client's first token is prefill's (xpyd.proxy.phases)
                    timer.written(first)
                yield chunk(first.text, None, logprobs=first.logprobs)
            async for block in call.relay():  # decode's chunks, named by the call: bytes as they came
                if block.startswith(COMMENT_PREFIX):  # decode's timing, alone in the last block
                    decoded = block
                    continue
                for _ in range(block.count(TOKEN_CHUNK_KEY)):  # its token chunks (not the usage chunk)
                    timer.token()
                yield block
        timer.end(Outcome.OK)
        if timing:
            said = answer_timing(first, _timing_or_none(decoded), timer.phases)
            if said.proxy is not None:
                timer.network_known(said.proxy)
            yield said.comment()
        yield DONE
    except APIError as e:  # the status line is already sent: report in-stream, as vLLM does
        timer.end(outcome_of(e))
        on_error(e)
        log.warning("%s (%s): %s (in stream)", name.id, call.request_id, e.message)
        e = public(e)
        yield sse(APIError(e.status, e.message, type=e.type).to_dict())
        yield DONE
    except Exception:
        timer.end(Outcome.INTERNAL_ERROR)
        log.exception("%s (%s): streaming failed", name.id, call.request_id)
        yield sse(APIError(500, "internal error in the proxy", type="server_error").to_dict())
        yield DONE
    finally:
        timer.end(Outcome.ABORTED)  # no-op unless the client went away
        await call.aclose()


async def _with_tools(call: PDCall, req: CompletionRequest, first: FirstToken, tools: ToolOutput,
                      chunk: Callable[..., bytes], timer: RequestTimer) -> AsyncIterator[bytes]:
    """A streamed answer with tools in play: prefill's first token and decode's deltas through ``tools`` (content
    deltas and tool call deltas), then the finish chunk and the usage chunk if asked."""
    finish, stop = first.finish_reason, first.stop_reason
    for delta in tools.delta(first.text):
        timer.written(first)
        yield chunk(None, None, delta=delta)
    if finish is None:
        async for piece in call.rest():
            timer.token()
            for delta in tools.delta(piece.text):
                yield chunk(None, None, delta=delta)
            if piece.finish_reason is not None:
                finish, stop = piece.finish_reason, piece.stop_reason
    for delta in tools.finish():
        yield chunk(None, None, delta=delta)
    yield chunk(None, tools.finish_reason(finish), stop_reason=stop)
    if req.include_usage:
        u, name = call.usage, call.identity
        yield sse(usage_chunk(name.id, name.created, name.model, req.kind, u.prompt_tokens, u.completion_tokens,
                              u.cached_tokens))


def answer_timing(first: FirstToken, decoded: WorkerTiming | None, proxy: ProxyPhases | None = None) -> WorkerTiming:
    """The workers' own timing of a P/D answer, as the client saw it: TTFT from the worker that wrote the
    client's first content chunk (prefill, unless its token had no text), the gaps from decode's chunks; and
    where the time went (``xpyd.api.phases``): prefill's phases, decode's, and the proxy's own."""
    prefill = first.timing
    local, proxy = with_local(first, decoded, proxy)
    phases = {"prefill": prefill.prefill if prefill is not None else None,
              "decode": decoded.decode if decoded is not None else None, "proxy": proxy, "colocated": local}
    if first.text or first.finish_reason is not None:
        ttft = prefill.ttft_us if prefill is not None and first.text else None
        if decoded is None:
            return WorkerTiming(ttft_us=ttft, **phases)
        return WorkerTiming(ttft_us=ttft, gaps_us=decoded.gaps_us, gaps=decoded.gaps, **phases)
    if decoded is None:
        return WorkerTiming(**phases)
    return WorkerTiming(ttft_us=decoded.ttft_us, gaps_us=decoded.gaps_us, gaps=decoded.gaps, **phases)


def _timing_or_none(block: bytes | None) -> WorkerTiming | None:
    if block is None:
        return None
    try:
        return timing_of_comment(block)
    except ValueError:  # a worker's broken comment never fails an answer: its timing is left out
        log.debug("a decode worker's timing comment is malformed: %r", block[:200])
        return None
