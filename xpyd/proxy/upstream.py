"""Worker failures as the proxy reports them: ``UpstreamError``, with a status and a ``Fault``.

A worker's 4xx carries its status and body so the client sees them verbatim, but for 401 and 403: those
refuse the proxy (its cluster token, the request id it signed), not the client's request, so the client
gets a 502 (a decode worker's 403, refusing the prefill worker the id names, is the pair's ``PATH`` fault:
retried on another pair, as when decode cannot reach that prefill worker). A worker's 503 stays 503 and
its 504 stays 504; any other 5xx or a broken connection is a 502, and a timeout of ours a 504. The
``fault`` says what the failure means for the worker (the proxy marks it down, and may retry elsewhere).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from enum import Enum

import aiohttp

from xpyd.api.openai import APIError
from xpyd.discovery.types import Role, WorkerInfo
from xpyd.proxy.h1client import ConnectionFailed, Response

MAX_ERROR_BODY = 64 * 1024  # bytes of a worker's error body we read and pass on
_KEPT_5XX = (503, 504)  # a worker starting or overloaded, or timed out itself: the client hears the same
_REFUSED_PROXY = (401, 403)  # a worker's gate refused the proxy's credential or request id (worker.request_gate)


class Fault(Enum):
    """What a failed call says about the worker."""

    NONE = "none"  # it refused this request (4xx) or answered it wrongly: nothing to do
    UNHEALTHY = "unhealthy"  # 5xx or a timeout: stop choosing it until it is healthy
    UNREACHABLE = "unreachable"  # the connection failed or broke: as UNHEALTHY, and the
    #                              request may be retried elsewhere if the client saw nothing
    PATH = "path"  # both workers answer, the path between them failed (decode could not reach prefill, the KV
    #                did not arrive): avoid the pair (``pairs.PairHealth``); retried as UNREACHABLE is


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
        self.pair: tuple[WorkerInfo, WorkerInfo] | None = None  # PATH: (prefill, decode), set by the call

    def to_dict(self) -> dict:
        return self.body if self.body is not None else super().to_dict()


def server_error_status(worker_status: int) -> int:
    """The status the client gets for a worker's non-4xx failure status: 503 and 504 as they are, else 502."""
    return worker_status if worker_status in _KEPT_5XX else 502


def who(worker: WorkerInfo) -> str:
    return f"{worker.role.value} worker {worker.http_url}"


@contextlib.contextmanager
def upstream_errors(worker: WorkerInfo) -> Iterator[None]:
    """Turn network and protocol failures talking to ``worker`` into UpstreamError."""
    name = who(worker)
    try:
        yield
    except TimeoutError as e:  # also aiohttp's ServerTimeoutError
        raise UpstreamError(504, f"{name} timed out", worker=worker, fault=Fault.UNHEALTHY) from e
    except (ConnectionFailed, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
        raise UpstreamError(502, f"{name} unreachable: {type(e).__name__}: {e}", worker=worker,
                            fault=Fault.UNREACHABLE) from e
    except aiohttp.ClientError as e:
        raise UpstreamError(502, f"{name} failed: {type(e).__name__}: {e}", worker=worker) from e
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise UpstreamError(502, f"{name} sent an invalid response: {e}", worker=worker) from e


async def raise_for_status(resp: Response | aiohttp.ClientResponse, worker: WorkerInfo) -> None:
    """UpstreamError unless ``resp`` is a 2xx (reads at most MAX_ERROR_BODY of an error body)."""
    if 200 <= resp.status < 300:
        return
    raw = await resp.content.read(MAX_ERROR_BODY)
    try:
        body = json.loads(raw)
        message = str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        text = raw.decode(errors="replace")
        # (cut at a space: half an address would slip past the redaction of what reaches the client)
        body, message = None, text if len(text) <= 200 else text[:200].rsplit(None, 1)[0] + " ..."
    name = who(worker)
    if resp.status in _REFUSED_PROXY:  # (a decode worker's 403 refuses the pair: the prefill worker named)
        path = resp.status == 403 and worker.role is Role.DECODE
        raise UpstreamError(502, f"{name} refused the proxy (HTTP {resp.status}; is the proxy's --cluster-token "
                            f"the workers'?): {message}", worker=worker, fault=Fault.PATH if path else Fault.NONE)
    if resp.status == 409:  # (a request its other worker released, e.g. decode gave up waiting for its KV, or an
        # id taken twice: nothing the client did; nothing was sent to it yet, so the request may start over)
        raise UpstreamError(502, f"{name}: {message or 'HTTP 409'}", worker=worker, fault=Fault.PATH)
    if 400 <= resp.status < 500:
        raise UpstreamError(resp.status, message or f"{name}: HTTP {resp.status}", body, worker)
    raise UpstreamError(server_error_status(resp.status), f"{name} failed with HTTP {resp.status}: {message}",
                        worker=worker, fault=Fault.UNHEALTHY)


def in_stream_error(error: object, worker: WorkerInfo) -> UpstreamError:
    """A worker's SSE error event (``{"error": {...}}``) as an UpstreamError.

    The status is the event's integer ``code`` when that is a 5xx (vLLM's convention;
    503 and 504 are kept), else 502. The worker stays healthy: it answered. An event with
    ``"kv_path": true`` (a decode worker that could not reach the request's prefill worker, or whose KV
    did not arrive) is a ``Fault.PATH``.
    """
    message, code = (error.get("message"), error.get("code")) if isinstance(error, dict) else (error, None)
    status = 502
    if isinstance(code, int) and not isinstance(code, bool) and 500 <= code < 600:
        status = server_error_status(code)
    path = isinstance(error, dict) and error.get("kv_path") is True
    return UpstreamError(status, f"{who(worker)} failed: {message}", worker=worker,
                         fault=Fault.PATH if path else Fault.NONE)
