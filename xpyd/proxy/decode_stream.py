"""Reading the decode worker's SSE answer: tokens 2..n, then usage, then ``[DONE]``.

``xpyd.api.sse`` splits the body into events. A request the decode worker prefills itself
(``xpyd.api.local_prefill``) streams its first token too: ``first()`` reads that token's chunk (and, if it
ended the request, the rest of the stream) before either of::

    relay(identity)  streaming client: each read's events as they came, for the client as they are;
                     only events that do not look like an ordinary token chunk of this response
                     are parsed: the last one (finish_reason), the usage chunk, an error; the
                     worker's timing comment (``xpyd.api.timing``), if any, as a block of its own at the end
    deltas()         JSON client: every event parsed into Deltas, and ``usage`` set

Either way the worker's timing comment, when it sent one, is kept as ``timing`` (``xpyd.proxy.phases``).

An error event ends the stream with an UpstreamError (``in_stream_error``), and so
does a stream that ends without a finish reason. After ``[DONE]`` the (empty) rest
of the body is read briefly so the connection goes back to the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable

from xpyd.api.identity import ResponseIdentity
from xpyd.api.openai import RequestKind
from xpyd.api.responses import DONE_DATA, SSE_KEEPALIVE, chunk_head
from xpyd.api.resume import ids_of, split_ids
from xpyd.api.sse import SSEParser, sse_batches, sse_data
from xpyd.api.timing import COMMENT_PREFIX, WorkerTiming, timing_of_comment
from xpyd.discovery.types import WorkerInfo
from xpyd.proxy.h1client import ConnectionFailed, Response
from xpyd.proxy.upstream import Fault, UpstreamError, in_stream_error, upstream_errors, who
from xpyd.proxy.worker_api import Delta, FirstToken, Usage, parse_delta, parse_usage

DRAIN_TIMEOUT = 1.0  # after [DONE], wait this long for the stream's end before dropping it
HEARD_EVERY = 1.0  # a stream that brings bytes says its worker is alive at most this often
_NOT_LAST = b'"finish_reason":null'  # in every token chunk but the last (as ``dumps`` writes it)
TOKEN_CHUNK_KEY = b'"finish_reason":'  # in every token chunk (not in the usage chunk, an error, a comment)


class DecodeStream:
    """The decode worker's SSE response: ``relay()`` or ``deltas()`` (once), then ``close()``."""

    def __init__(self, resp: Response, worker: WorkerInfo, kind: RequestKind,
                 heard: Callable[[WorkerInfo], None] | None = None) -> None:
        self._resp = resp
        self._worker = worker
        self._kind = kind
        self.usage: Usage | None = None  # set by deltas()
        self.timing: WorkerTiming | None = None  # the worker's own, from its timing comment (when asked, and sound)
        self._heard = heard  # told (at most every HEARD_EVERY) that the worker sent bytes: it is alive
        self._heard_at = 0.0
        self._head = b""  # bytes ``watch()`` read before relay()/deltas() began (they come first)
        # The tokens whose text went on from this stream, as its chunks named them (``xpyd.api.resume``); None
        # once a token chunk named none (a worker that does not name them): the request cannot move on then.
        self.token_ids: list[int] | None = []

    async def watch(self) -> None:
        """While prefill has not answered: wait for decode's first bytes. Before its KV arrived (after
        prefill's answer) a decode worker sends nothing, so a stream that ends now is a decode worker that died
        or cut the connection: UpstreamError (UNREACHABLE), at once, not when prefill answers, maybe a queue
        later; the client has seen nothing, so the request may start over elsewhere. Bytes (an error event)
        are kept for ``relay()``/``deltas()``. Cancel it when prefill answers (a read that waits is cancelled
        with nothing consumed)."""
        with upstream_errors(self._worker):
            data = SSE_KEEPALIVE
            while data == SSE_KEEPALIVE:  # (a worker's keep-alive says it is there: the watch goes on)
                data = await self._resp.content.readany()
        if not data:
            raise UpstreamError(502, f"{who(self._worker)} closed its stream before its first token",
                                worker=self._worker, fault=Fault.UNREACHABLE)
        self._head += data

    async def first(self) -> FirstToken:
        """The first token's chunk of a request prefilled on the decode worker, as prefill's answer would have
        said it; the bytes after it stay for ``relay()``/``deltas()``. If it ended the request, the stream is read
        to its end (its usage chunk, if any, is the FirstToken's usage). A stream that ends before its first
        event is a decode worker that died or cut it: UpstreamError (UNREACHABLE: the client has seen nothing)."""
        with upstream_errors(self._worker):
            delta, ids = await self._first_delta()
            usage = Usage(0, max(1, len(ids or ())), 0)  # (the counts are the usage chunk's, when there is one)
            if delta.finish_reason is not None:
                usage = await self._usage_to_end() or usage
        return FirstToken(delta.text, delta.finish_reason, usage, stop_reason=delta.stop_reason,
                          logprobs=delta.logprobs, token_ids=None if ids is None else tuple(ids))

    async def _first_delta(self) -> tuple[Delta, list[int] | None]:
        buf = b""
        while True:
            end = buf.find(b"\n\n")  # (a worker ends every event with a blank line: ``sse``)
            if end < 0:
                data = await self._resp.content.readany()
                if not data:
                    raise UpstreamError(502, f"{who(self._worker)} closed its stream before its first token",
                                        worker=self._worker, fault=Fault.UNREACHABLE)
                self._alive()
                buf += data
                continue
            event, buf = buf[:end + 2], buf[end + 2:]
            for data in SSEParser().feed(event):
                if data == DONE_DATA:
                    raise self._unfinished()
                data, ids = split_ids(data)
                obj = json.loads(data)
                if "error" in obj:
                    raise in_stream_error(obj["error"], self._worker)
                for choice in obj.get("choices") or ():
                    delta = parse_delta(choice, self._kind)
                    if delta is not None:
                        self._head = buf
                        return delta, None if ids is None else ids_of(ids)

    async def _usage_to_end(self) -> Usage | None:
        """The rest of a stream whose request ended: its usage chunk's counts (None without one)."""
        usage = None
        async with contextlib.aclosing(sse_data(self._chunks())) as events:
            async for data in events:
                if data.strip() == DONE_DATA:
                    await self._release()
                    break
                obj = json.loads(split_ids(data)[0])
                if "error" in obj:
                    raise in_stream_error(obj["error"], self._worker)
                if obj.get("usage"):
                    usage = parse_usage(obj["usage"])
        return usage

    async def _chunks(self) -> AsyncIterator[bytes]:
        if self._head:
            head, self._head = self._head, b""
            yield head
        async for chunk in self._resp.content.iter_any():
            yield chunk

    def _alive(self) -> None:
        if self._heard is not None:
            now = time.monotonic()
            if now - self._heard_at >= HEARD_EVERY:
                self._heard_at = now
                self._heard(self._worker)

    async def relay(self, identity: ResponseIdentity) -> AsyncIterator[bytes]:
        """The stream's events up to ``[DONE]`` (not included), one block per read, unchanged; a read that brought
        only a keep-alive comment is passed on as ``SSE_KEEPALIVE``.

        A token chunk that starts with this response's head (id, object, created, model) and has
        ``"finish_reason":null`` goes on without parsing; any other event is parsed and checked:
        an error event raises, a chunk of another response is a 502, a finish reason is noted. The worker's
        timing comment (only if it was asked for one) follows, alone in the last block.
        """
        head = chunk_head(identity.id, identity.created, identity.model, self._kind)
        finished = done = False
        parser = SSEParser(keep=COMMENT_PREFIX)
        with upstream_errors(self._worker):
            async with contextlib.aclosing(sse_batches(self._chunks(), parser=parser, empty=True)) as batches:
                async for batch in batches:
                    self._alive()
                    if not batch:  # a read that completed no event: a keep-alive (or part of an event)
                        if parser.idle:
                            yield SSE_KEEPALIVE  # (the client's read timeout counts from it too)
                        continue
                    block, error = [], None
                    for data in batch:
                        if data == DONE_DATA:
                            done = True
                            break
                        try:
                            data = self._named(data)
                        except Exception as e:
                            error = e
                            break
                        if not (data.startswith(head) and _NOT_LAST in data):
                            try:
                                finished = self._check(data, identity) or finished
                            except Exception as e:  # raised once the events before it are sent
                                error = e
                                break
                        block.append(b"data: " + data + b"\n\n")  # as the worker framed it (``sse``)
                    if block:
                        yield b"".join(block)
                    if error is not None:
                        raise error
                    if done:
                        break
        if done:
            await self._release()
        if not finished:
            raise self._unfinished()
        if parser.kept is not None:
            self.timing = _timing(parser.kept)
            yield parser.kept + b"\n\n"

    def _check(self, data: bytes, identity: ResponseIdentity) -> bool:
        """An event off the fast path: raise if it is an error or not this response's; True if it is the last."""
        obj = json.loads(data)
        if not isinstance(obj, dict):
            raise TypeError("an SSE event that is not a JSON object")
        if "error" in obj:
            raise in_stream_error(obj["error"], self._worker)
        got = (obj.get("id"), obj.get("created"), obj.get("model"))
        if got != (identity.id, identity.created, identity.model):
            raise UpstreamError(502, f"{who(self._worker)} sent a chunk of another response (id, created, "
                                f"model: {got}; expected {identity.to_wire()}); does it speak this proxy's "
                                "worker API?", worker=self._worker)
        choices = obj["choices"]
        if not isinstance(choices, list):
            raise TypeError("choices must be a list")
        return any(c["finish_reason"] is not None for c in choices)

    async def deltas(self) -> AsyncIterator[Delta]:
        finished = False
        parser = SSEParser(keep=COMMENT_PREFIX)
        with upstream_errors(self._worker):
            async with contextlib.aclosing(sse_data(self._chunks(), parser=parser)) as events:
                async for data in events:
                    self._alive()
                    if data.strip() == DONE_DATA:
                        await self._release()
                        break
                    obj = json.loads(self._named(data))
                    if "error" in obj:
                        raise in_stream_error(obj["error"], self._worker)
                    if obj.get("usage"):
                        self.usage = parse_usage(obj["usage"])
                    for choice in obj.get("choices") or ():
                        delta = parse_delta(choice, self._kind)
                        if delta is not None:
                            finished = finished or delta.finish_reason is not None
                            yield delta
        if not finished:
            raise self._unfinished()
        if parser.kept is not None:
            self.timing = _timing(parser.kept)

    def _named(self, data: bytes) -> bytes:
        """An event's data without the token ids it names, which are noted (a token chunk without any: the
        stream's tokens are unknown from here)."""
        data, ids = split_ids(data)
        if self.token_ids is not None:
            if ids is not None:
                self.token_ids.extend(ids)
            elif TOKEN_CHUNK_KEY in data:
                self.token_ids = None
        return data

    def _unfinished(self) -> UpstreamError:
        return UpstreamError(502, f"decode worker {self._worker.http_url} ended the stream "
                             "without a finish_reason", worker=self._worker)

    async def _release(self) -> None:
        """Read the (empty) rest of the body so the connection goes back to the pool."""
        with contextlib.suppress(TimeoutError, ConnectionFailed):
            async with asyncio.timeout(DRAIN_TIMEOUT):
                while await self._resp.content.readany():
                    pass
        self._resp.release()  # closes instead if the body did not end

    def fail(self, error: UpstreamError) -> None:
        """End ``relay()`` or ``deltas()`` with ``error`` from another task (it may be waiting for a read)."""
        self._resp.content.set_exception(error)

    def close(self) -> None:
        self._resp.close()


def _timing(comment: bytes) -> WorkerTiming | None:
    try:
        return timing_of_comment(comment)
    except ValueError:  # a worker's broken comment never fails an answer: its timing is left out
        return None
