"""A request with several choices (``n`` > 1, or a list of prompts) through the P/D proxy: one P/D call per
choice (``xpyd.api.choices`` splits it and joins the answers).

A prompt's first choice is called first; its other choices go, to the same prefill and decode workers while
they are up, once it has its first token: prefill has the prompt's blocks cached by then (they compute only
its last partial block) and decode finds them in its prefix cache as its pulls land. Every choice's first
token (or error) is awaited before the response starts, so a request a worker refuses is an error status,
as a one-choice request's is; after that a failing choice ends the stream with its error event.

Where the time went (``xpyd.api.phases``): the request's split follows choice 0 (its ingress, prefill call and
network), then ``choices``, the wait for the other choices' first tokens, [``rest``: a JSON answer's wait for
every choice's last token] and egress to the first content chunk written (or the JSON answer built). With
``--expose-worker-timing`` a stream ends with it in its timing comment and a JSON answer has it in
``X-Xpyd-Timing``, with choice 0's prefill and decode phases (no gaps: the choices' chunks interleave).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Protocol

from aiohttp import web

from xpyd.api.choices import Child, join_json, join_streams, split
from xpyd.api.identity import ResponseIdentity
from xpyd.api.openai import APIError, CompletionRequest
from xpyd.api.responses import KEEPALIVE_SECONDS, SSE_KEEPALIVE
from xpyd.api.timing import TIMING_HEADER
from xpyd.proxy.admission import Slot
from xpyd.proxy.config import ProxyConfig
from xpyd.proxy.http_errors import json_response
from xpyd.proxy.http_server import StreamedResponse
from xpyd.proxy.metrics import Outcome, RequestTimer
from xpyd.proxy.phases import joined
from xpyd.proxy.relay import complete_body, stream_body
from xpyd.proxy.worker_api import FirstToken


class _ChoiceTimer:
    """A choice's own timer: the request's timer counts the request once; this one only notes when a JSON
    answer's last token was read."""

    __slots__ = ("decoded_at",)

    def __init__(self) -> None:
        self.decoded_at: float | None = None

    def first_token(self) -> None: ...
    def written(self, _first: FirstToken) -> None: ...
    def token(self) -> None: ...
    def end(self, _outcome: Outcome) -> None: ...

    def decoded(self) -> None:
        self.decoded_at = time.monotonic()


def _latest(times: Iterable[float | None]) -> float | None:
    return max((t for t in times if t is not None), default=None)


class ChoiceProxy(Protocol):
    config: ProxyConfig  # (the tool call parser, expose_worker_timing)

    async def first_of(self, req: CompletionRequest, identity: ResponseIdentity,
                       prefer: tuple | None = None) -> tuple: ...
    def worker_failed(self, e: APIError) -> None: ...
    def _public_error(self, call): ...


async def _started(proxy: ChoiceProxy, children: list[Child], identity: ResponseIdentity) -> list[tuple]:
    """(child, call, first) for every choice, each prompt's first choice before its others; on any failure the
    calls started are closed and the error raised."""
    out: dict[int, tuple] = {}

    async def prompt_group(group: list[Child]) -> None:
        call, first = await proxy.first_of(group[0].req, identity)
        out[group[0].index] = (group[0], call, first)
        rest = await asyncio.gather(*(proxy.first_of(c.req, identity, call.pair) for c in group[1:]),
                                    return_exceptions=True)
        error = None
        for child, got in zip(group[1:], rest):
            if isinstance(got, BaseException):
                error = error or got
            else:
                out[child.index] = (child, *got)
        if error is not None:
            raise error

    groups: dict[int, list[Child]] = {}
    for c in children:
        groups.setdefault(c.prompt_index, []).append(c)
    try:
        results = await asyncio.gather(*(prompt_group(g) for g in groups.values()), return_exceptions=True)
    except BaseException:  # (cancelled: the client left)
        for _, call, _ in out.values():
            call.abort()
        raise
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await asyncio.gather(*(call.aclose() for _, call, _ in out.values()), return_exceptions=True)
        raise errors[0]
    return [out[c.index] for c in children]


async def serve_choices(proxy: ChoiceProxy, req: CompletionRequest, identity: ResponseIdentity, headers: dict,
                        timer: RequestTimer, slot: Slot) -> web.StreamResponse:
    started = await _started(proxy, split(req), identity)
    timer.first_token()
    _, call0, first0 = started[0]  # (choice 0: the request's split follows it)
    others = _latest(first.span[1] for _, _, first in started if first.span is not None)
    exposed = proxy.config.expose_worker_timing
    if not req.stream:
        timers = [_ChoiceTimer() for _ in started]
        try:
            answers = await asyncio.gather(*(_json(child, call, first, proxy.config.tool_call_parser, t)
                                             for (child, call, first), t in zip(started, timers)))
        except APIError as e:
            proxy.worker_failed(e)
            raise
        finally:
            await asyncio.gather(*(call.aclose() for _, call, _ in started), return_exceptions=True)
        answer = json_response(join_json(req, answers), headers=headers)
        timer.answered(first0, others, _latest(t.decoded_at for t in timers))
        timer.end(Outcome.OK)
        if exposed:
            answer.headers[TIMING_HEADER] = joined(first0, call0.decode_timing, timer.phases).header()
        return answer
    parser = proxy.config.tool_call_parser
    streams = [(child, stream_body(call, child.req, first, _ChoiceTimer(), proxy.worker_failed,
                                   proxy._public_error(call), parser)) for child, call, first in started]
    slot.handed_off = True

    def trailer() -> bytes:  # (choice 0's decode timing: its stream ended)
        return joined(first0, call0.decode_timing, timer.phases).comment()

    body = _joined(req, streams, identity, timer, slot, [call for _, call, _ in started],
                   lambda: timer.written(first0, others), trailer if exposed else None)
    weakref.finalize(body, _abandon, [call for _, call, _ in started], timer, slot)
    headers["Cache-Control"] = "no-cache"
    return StreamedResponse(body, status=200, content_type="text/event-stream", headers=headers)


async def _json(child: Child, call, first: FirstToken, tool_parser: str | None,
                timer: _ChoiceTimer) -> tuple[Child, dict]:
    return child, await complete_body(call, child.req, first, timer, tool_parser)


async def _joined(req: CompletionRequest, streams: list, identity: ResponseIdentity, timer: RequestTimer,
                  slot: Slot, calls: list, first_text: Callable[[], None],
                  trailer: Callable[[], bytes] | None) -> AsyncIterator[bytes]:
    ok = False
    try:
        async with contextlib.aclosing(join_streams(req, streams, (identity.id, identity.created, identity.model),
                                                    first_text, trailer, keepalive=KEEPALIVE_SECONDS)) as blocks:
            async for block in blocks:
                if block != SSE_KEEPALIVE:
                    timer.token()
                yield block
        ok = True
    finally:
        for call in calls:  # (each choice's stream closed its own; one never started did not)
            call.abort()
        timer.end(Outcome.OK if ok else Outcome.ABORTED)
        slot.release()


def _abandon(calls: list, timer: RequestTimer, slot: Slot) -> None:
    """The client left before the body started: drop every choice's calls."""
    for call in calls:
        call.abort()
    timer.end(Outcome.ABORTED)
    slot.release()
