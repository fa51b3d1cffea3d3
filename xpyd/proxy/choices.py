"""A request with several choices (``n`` > 1, or a list of prompts) through the P/D proxy: one P/D call per
choice (``xpyd.api.choices`` splits it and joins the answers).

A prompt's first choice is called first; its other choices go, to the same prefill and decode workers while
they are up, once it has its first token: prefill has the prompt's blocks cached by then (they compute only
its last partial block) and decode finds them in its prefix cache as its pulls land. Every choice's first
token (or error) is awaited before the response starts, so a request a worker refuses is an error status,
as a one-choice request's is; after that a failing choice ends the stream with its error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator
from typing import Protocol

from aiohttp import web

from xpyd.api.choices import Child, join_json, join_streams, split
from xpyd.api.identity import ResponseIdentity
from xpyd.api.openai import APIError, CompletionRequest
from xpyd.proxy.admission import Slot
from xpyd.proxy.http_errors import json_response
from xpyd.proxy.http_server import StreamedResponse
from xpyd.proxy.metrics import Outcome, RequestTimer
from xpyd.proxy.relay import complete_body, stream_body
from xpyd.proxy.worker_api import FirstToken


class _Untimed:
    """A choice's own timer: the request's timer counts the request once."""

    def first_token(self) -> None: ...
    def written(self, _first) -> None: ...
    def token(self) -> None: ...
    def end(self, _outcome: Outcome) -> None: ...


UNTIMED = _Untimed()


class ChoiceProxy(Protocol):
    config: object  # its ProxyConfig (the tool call parser)

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
    if not req.stream:
        try:
            answers = await asyncio.gather(*(_json(child, call, first, proxy.config.tool_call_parser)
                                             for child, call, first in started))
        except APIError as e:
            proxy.worker_failed(e)
            raise
        finally:
            await asyncio.gather(*(call.aclose() for _, call, _ in started), return_exceptions=True)
        timer.end(Outcome.OK)
        return json_response(join_json(req, answers), headers=headers)
    parser = proxy.config.tool_call_parser
    streams = [(child, stream_body(call, child.req, first, UNTIMED, proxy.worker_failed,
                                   proxy._public_error(call), parser)) for child, call, first in started]
    slot.handed_off = True
    body = _joined(req, streams, identity, timer, slot, [call for _, call, _ in started])
    weakref.finalize(body, _abandon, [call for _, call, _ in started], timer, slot)
    headers["Cache-Control"] = "no-cache"
    return StreamedResponse(body, status=200, content_type="text/event-stream", headers=headers)


async def _json(child: Child, call, first: FirstToken, tool_parser: str | None) -> tuple[Child, dict]:
    return child, await complete_body(call, child.req, first, UNTIMED, tool_parser)


async def _joined(req: CompletionRequest, streams: list, identity: ResponseIdentity, timer: RequestTimer,
                  slot: Slot, calls: list) -> AsyncIterator[bytes]:
    ok = False
    try:
        async with contextlib.aclosing(join_streams(req, streams, (identity.id, identity.created,
                                                                   identity.model))) as blocks:
            async for block in blocks:
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
