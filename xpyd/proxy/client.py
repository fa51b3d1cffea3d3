"""Talking to the workers: one prefill call and one decode stream per client request.

A client request becomes a ``PDCall``; both upstream calls start at once::

    prefill worker  <- body + max_tokens=1, stream=false   -> first token (JSON)
    decode worker   <- body + stream=true, include_usage    -> tokens 2..n (SSE), usage

Worker failures become ``UpstreamError``: a 4xx carries the worker's status and
body so the client sees them verbatim; a worker's 503 stays 503, any other 5xx
or a broken connection is a 502, a timeout a 504. Its ``fault`` says what the
failure means for the worker (the proxy marks it down, and may retry elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from enum import Enum

import aiohttp

from xpyd.api.openai import APIError, CompletionRequest, RequestKind
from xpyd.api.responses import dumps
from xpyd.discovery.types import Role, WorkerInfo

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
MAX_ERROR_BODY = 64 * 1024  # bytes of a worker's error body we read and pass on
DRAIN_TIMEOUT = 1.0  # after [DONE], wait this long for the stream's end before dropping it
ABORT_PATH = "/xpyd/abort"  # a worker drops the request named in X-Request-Id
RELEASE_TIMEOUT = 2.0
_PATHS = {RequestKind.COMPLETION: "/v1/completions", RequestKind.CHAT: "/v1/chat/completions"}


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class FirstToken:
    text: str  # as it should be shown to the client; may be "" (held back)
    finish_reason: str | None  # not None: the request ended on prefill
    usage: Usage


@dataclass(frozen=True, slots=True)
class Delta:
    text: str
    finish_reason: str | None


class Fault(Enum):
    """What a failed call says about the worker."""

    NONE = "none"  # it refused this request (4xx) or answered it wrongly: nothing to do
    UNHEALTHY = "unhealthy"  # 5xx or a timeout: stop choosing it until it is healthy
    UNREACHABLE = "unreachable"  # the connection failed or broke: as UNHEALTHY, and the
    #                              request may be retried elsewhere if the client saw nothing


class UpstreamError(APIError):
    """A worker failed or refused. ``body`` (a worker's own 4xx error) is passed on verbatim."""

    def __init__(
        self,
        status: int,
        message: str,
        body: dict | None = None,
        worker: WorkerInfo | None = None,
        fault: Fault = Fault.NONE,
    ) -> None:
        kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
        super().__init__(status, message, type=kind)
        self.body = body
        self.worker = worker
        self.fault = fault

    def to_dict(self) -> dict:
        return self.body if self.body is not None else super().to_dict()


# ------------------------------------------------------------ request bodies


def prefill_body(req: CompletionRequest, worker: WorkerInfo) -> dict:
    body = {k: v for k, v in req.raw.items() if k not in ("stream_options", "max_completion_tokens")}
    body.update(
        model=worker.model_id,
        max_tokens=1,
        stream=False,
        kv_transfer_params={"role": "prefill", "max_tokens": req.max_tokens},
    )
    return body


def decode_body(req: CompletionRequest, worker: WorkerInfo) -> dict:
    return {
        **req.raw,
        "model": worker.model_id,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": {"role": "decode"},
    }


# ------------------------------------------------------------ worker client


@contextlib.contextmanager
def _upstream_errors(worker: WorkerInfo) -> Iterator[None]:
    """Turn network and protocol failures talking to ``worker`` into UpstreamError."""
    who = f"{worker.role.value} worker {worker.http_url}"
    try:
        yield
    except TimeoutError as e:  # also aiohttp's ServerTimeoutError
        raise UpstreamError(504, f"{who} timed out", worker=worker, fault=Fault.UNHEALTHY) from e
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
        raise UpstreamError(502, f"{who} unreachable: {type(e).__name__}: {e}", worker=worker,
                            fault=Fault.UNREACHABLE) from e
    except aiohttp.ClientError as e:
        raise UpstreamError(502, f"{who} failed: {type(e).__name__}: {e}", worker=worker) from e
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise UpstreamError(502, f"{who} sent an invalid response: {e}", worker=worker) from e


async def _raise_for_status(resp: aiohttp.ClientResponse, worker: WorkerInfo) -> None:
    if 200 <= resp.status < 300:
        return
    raw = await resp.content.read(MAX_ERROR_BODY)
    try:
        body = json.loads(raw)
        message = str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        body, message = None, raw.decode(errors="replace")[:200]
    who = f"{worker.role.value} worker {worker.http_url}"
    if 400 <= resp.status < 500:
        raise UpstreamError(resp.status, message or f"{who}: HTTP {resp.status}", body, worker)
    # A worker that is starting or overloaded (503) makes the proxy unavailable too.
    status = 503 if resp.status == 503 else 502
    raise UpstreamError(status, f"{who} failed with HTTP {resp.status}: {message}", worker=worker,
                        fault=Fault.UNHEALTHY)


def _str_or_none(v: object) -> str | None:
    if v is not None and not isinstance(v, str):
        raise TypeError(f"expected a string or null, got {type(v).__name__}")
    return v


def _usage(d: dict) -> Usage:
    prompt, completion = d["prompt_tokens"], d["completion_tokens"]
    if not (isinstance(prompt, int) and isinstance(completion, int)):
        raise TypeError("usage token counts must be integers")
    return Usage(prompt, completion)


def _first_token(data: dict, kind: RequestKind) -> FirstToken:
    choice = data["choices"][0]
    text = choice["message"]["content"] if kind is RequestKind.CHAT else choice["text"]
    return FirstToken(
        text=_str_or_none(text) or "",
        finish_reason=_str_or_none(choice.get("finish_reason")),
        usage=_usage(data["usage"]),
    )


def _delta(choice: dict, kind: RequestKind) -> Delta | None:
    if kind is RequestKind.CHAT:
        text = (choice.get("delta") or {}).get("content")
    else:
        text = choice.get("text")
    text = _str_or_none(text) or ""
    finish_reason = _str_or_none(choice.get("finish_reason"))
    if not text and finish_reason is None:
        return None  # e.g. the chat role chunk: the proxy sends its own
    return Delta(text, finish_reason)


class DecodeStream:
    """The decode worker's SSE response; ``deltas()`` yields tokens 2..n, then ``usage`` is set."""

    def __init__(self, resp: aiohttp.ClientResponse, worker: WorkerInfo, kind: RequestKind) -> None:
        self._resp = resp
        self._worker = worker
        self._kind = kind
        self.usage: Usage | None = None

    async def deltas(self) -> AsyncIterator[Delta]:
        finished = False
        with _upstream_errors(self._worker):
            async for line in self._resp.content:
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments, event names
                data = line[5:].strip()
                if data == b"[DONE]":
                    await self._release()
                    break
                obj = json.loads(data)
                if "error" in obj:
                    raise UpstreamError(502, f"decode worker {self._worker.http_url} failed: "
                                        f"{obj['error'].get('message')}", worker=self._worker)
                if obj.get("usage"):
                    self.usage = _usage(obj["usage"])
                for choice in obj.get("choices") or ():
                    delta = _delta(choice, self._kind)
                    if delta is not None:
                        finished = finished or delta.finish_reason is not None
                        yield delta
        if not finished:
            raise UpstreamError(502, f"decode worker {self._worker.http_url} ended the stream "
                                "without a finish_reason", worker=self._worker)

    async def _release(self) -> None:
        """Read the (empty) rest of the body so the connection goes back to the pool."""
        with contextlib.suppress(TimeoutError, aiohttp.ClientError):
            async with asyncio.timeout(DRAIN_TIMEOUT):
                while await self._resp.content.readany():
                    pass
        self._resp.release()  # closes instead if the body did not end

    def fail(self, error: UpstreamError) -> None:
        """End ``deltas()`` with ``error`` from another task (it may be waiting for a read)."""
        self._resp.content.set_exception(error)

    def close(self) -> None:
        self._resp.close()


def worker_session(
    connect_timeout: float, read_timeout: float, max_connections: int
) -> aiohttp.ClientSession:
    """The proxy's one pooled session to its workers (requests and health polls)."""
    timeout = aiohttp.ClientTimeout(
        total=None,  # streams may run long; every read has its own limit instead
        sock_connect=connect_timeout,
        sock_read=read_timeout,
    )
    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(_on_headers_sent)
    connector = aiohttp.TCPConnector(limit=max_connections)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, trace_configs=[trace])


async def _on_headers_sent(_session, ctx, _params) -> None:
    flag = (ctx.trace_request_ctx or {}).get("sent")
    if flag is not None:
        flag.set()


class WorkerClient:
    """Posts to workers over one pooled session from ``worker_session`` (owned by the caller)."""

    def __init__(self, session: aiohttp.ClientSession, connect_timeout: float) -> None:
        self._session = session
        self.connect_timeout = connect_timeout
        self._releases: set[asyncio.Task] = set()

    def release_later(self, worker: WorkerInfo, request_id: str) -> None:
        """In the background: ``POST /xpyd/abort`` so ``worker`` drops ``request_id`` (best effort)."""
        try:
            task = asyncio.get_running_loop().create_task(self._release(worker, request_id))
        except RuntimeError:  # no loop (shutting down): the worker's kv_ttl frees it
            return
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, worker: WorkerInfo, request_id: str) -> None:
        try:
            async with self._session.post(worker.http_url + ABORT_PATH, headers={REQUEST_ID_HEADER: request_id},
                                          timeout=aiohttp.ClientTimeout(total=RELEASE_TIMEOUT)) as resp:
                await resp.read()
        except (TimeoutError, aiohttp.ClientError, RuntimeError) as e:  # RuntimeError: session closed
            log.debug("%s: abort on %s failed: %s", request_id, worker.http_url, e)

    def _post(self, worker: WorkerInfo, kind: RequestKind, body: dict, request_id: str,
              sent: asyncio.Event | None = None):
        return self._session.post(
            worker.http_url + _PATHS[kind],
            data=dumps(body),
            headers={"Content-Type": "application/json", REQUEST_ID_HEADER: request_id},
            trace_request_ctx={"sent": sent},
        )

    async def prefill(
        self, worker: WorkerInfo, kind: RequestKind, body: dict, request_id: str
    ) -> FirstToken:
        with _upstream_errors(worker):
            async with self._post(worker, kind, body, request_id) as resp:
                await _raise_for_status(resp, worker)
                data = await resp.json(content_type=None)
            return _first_token(data, kind)

    async def open_decode(
        self, worker: WorkerInfo, kind: RequestKind, body: dict, request_id: str,
        sent: asyncio.Event | None = None,
    ) -> DecodeStream:
        """Post to decode; ``sent`` is set once the request is on the wire (before any answer)."""
        with _upstream_errors(worker):
            resp = await self._post(worker, kind, body, request_id, sent)
            try:
                await _raise_for_status(resp, worker)
            except BaseException:
                resp.close()
                raise
        return DecodeStream(resp, worker, kind)


# ------------------------------------------------------------ one P/D request


class PDCall:
    """One client request split across a prefill and a decode worker, called concurrently.

    ``first_token()`` starts both calls and returns prefill's answer (or the first
    error from either side); ``rest()`` yields decode's deltas unless the request
    already ended on prefill. Always finish with ``aclose()`` (or ``abort()`` where
    awaiting is impossible): it cancels whatever is still running.
    """

    def __init__(
        self,
        client: WorkerClient,
        req: CompletionRequest,
        prefill: WorkerInfo,
        decode: WorkerInfo,
        request_id: str,
    ) -> None:
        if prefill.role is not Role.PREFILL or decode.role is not Role.DECODE:
            raise ValueError("PDCall needs a prefill worker and a decode worker")
        self._client = client
        self._req = req
        self._prefill = prefill
        self._decode = decode
        self.request_id = request_id
        self._prefill_task: asyncio.Task[FirstToken] | None = None
        self._decode_task: asyncio.Task[DecodeStream] | None = None
        self._first: FirstToken | None = None
        self._prefilled: FirstToken | None = None  # prefill's answer, even if first_token() failed after it
        self._stream: DecodeStream | None = None
        self._decoded_tokens = 0
        self._completed = False  # decode's stream ended normally
        self._release_sent = False
        self._decode_sent = asyncio.Event()
        self._lost: asyncio.Future[UpstreamError] = asyncio.get_running_loop().create_future()

    @property
    def prefill_url(self) -> str:
        return self._prefill.http_url

    def prefill_lost(self, error: UpstreamError) -> bool:
        """The prefill worker died: end the call with ``error`` unless decode already has the KV.

        Decode's first delta comes after its KV pull completed, so until then the
        request may be waiting for KV that will never come (a decode worker can be
        slow to notice). True if the call was ended.
        """
        if self._first is None:
            return False  # prefill has not answered: its own call fails (or times out)
        if self._decoded_tokens or self._first.finish_reason is not None or self._lost.done():
            return False
        self._lost.set_result(error)
        if self._stream is not None:
            self._stream.fail(error)
        return True

    async def first_token(self) -> FirstToken:
        """Prefill's answer, once decode has the request too (so nothing reaches the
        client while a dead decode worker could still mean a retry elsewhere)."""
        kind = self._req.kind
        self._prefill_task = asyncio.create_task(self._client.prefill(
            self._prefill, kind, prefill_body(self._req, self._prefill), self.request_id))
        self._decode_task = asyncio.create_task(self._client.open_decode(
            self._decode, kind, decode_body(self._req, self._decode), self.request_id,
            self._decode_sent))
        pending: set[asyncio.Task] = {self._prefill_task, self._decode_task}
        while True:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if self._prefill_task in done and self._prefill_task.exception() is not None:
                raise self._prefill_task.exception()
            if self._decode_task in done and self._decode_task.exception() is not None:
                raise self._decode_task.exception()  # e.g. decode refused the body: 4xx
            if self._prefill_task in done:
                first = self._prefilled = self._prefill_task.result()
                if first.finish_reason is None:
                    await self._decode_connected()
                self._first = first
                return first

    async def _decode_connected(self) -> None:
        """Wait until decode's request is sent or has failed (usually long done by now)."""
        task = self._decode_task
        assert task is not None
        if not (task.done() or self._decode_sent.is_set()):
            sent = asyncio.create_task(self._decode_sent.wait())
            try:
                await asyncio.wait({task, sent}, timeout=self._client.connect_timeout,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                sent.cancel()
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()

    async def rest(self) -> AsyncIterator[Delta]:
        if self._first is None:
            raise RuntimeError("first_token() must succeed before rest()")
        if self._first.finish_reason is not None:
            return  # ended on prefill; aclose() drops the decode stream
        assert self._decode_task is not None
        if not self._decode_task.done():
            await asyncio.wait({self._decode_task, self._lost}, return_when=asyncio.FIRST_COMPLETED)
        if self._lost.done():
            raise self._lost.result()
        self._stream = await self._decode_task
        async for delta in self._stream.deltas():
            self._decoded_tokens += 1
            yield delta  # the stream goes on to its usage chunk and [DONE]
        self._completed = True

    @property
    def usage(self) -> Usage:
        """Token counts for the whole request (valid once ``rest()`` is exhausted)."""
        if self._first is None:
            raise RuntimeError("no usage before first_token()")
        if self._first.finish_reason is not None:
            return self._first.usage
        if self._stream is not None and self._stream.usage is not None:
            return self._stream.usage
        # The decode worker sent no usage chunk: count what we saw.
        return Usage(self._first.usage.prompt_tokens, 1 + self._decoded_tokens)

    def abort(self) -> None:
        """Cancel both calls and drop the decode stream, without waiting.

        If prefill answered and decode did not finish, prefill may still hold the
        request's KV for a decode worker that will never pull it (dead, or it
        failed before the pull): tell prefill to drop it (a no-op if it was pulled).
        """
        first = self._prefilled
        if first is not None and first.finish_reason is None and not self._completed and not self._release_sent:
            self._release_sent = True
            self._client.release_later(self._prefill, self.request_id)
        for task in (self._prefill_task, self._decode_task):
            if task is None:
                continue
            if not task.done():
                task.cancel()
            elif not task.cancelled() and task.exception() is None:
                if isinstance(task.result(), DecodeStream):
                    task.result().close()
        if self._stream is not None:
            self._stream.close()

    async def aclose(self) -> None:
        self.abort()
        tasks = [t for t in (self._prefill_task, self._decode_task) if t is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        # A decode task that completed while being cancelled still holds an open stream.
        self.abort()
