"""The proxy's JSON responses, and every error as OpenAI's ``{"error": {...}}`` with its status.

``APIError`` (the proxy's own and a worker's ``UpstreamError``) keeps its status;
the server's own HTTP errors (404, 405, 413 ...) get a message of their own; anything
else is a 500 that says no more than "internal error in the proxy". A 401 says
``WWW-Authenticate: Bearer``; a 429 or 503 says when to retry. ``error_middleware`` makes every
answer of an app so; its ``before`` and ``after`` hooks see each request (the API key, headers).

No error the client reads names the cluster's inside (``Redactor``): worker addresses, the proxy's
request ids (which carry both workers' addresses) and any address a worker's own message mentions
become ``[internal address]`` and ``[internal id]`` (the request's own id: its public one), in the
proxy's messages and in the 4xx bodies and in-stream errors it relays. ``GET /cluster`` (behind the
API key, when one is set) and the proxy's log keep them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import urlsplit

from aiohttp import web

from xpyd.api.openai import APIError
from xpyd.api.responses import dumps
from xpyd.discovery.types import WorkerInfo
from xpyd.proxy.admission import RETRY_AFTER_SECONDS
from xpyd.proxy.upstream import UpstreamError

log = logging.getLogger(__name__)

INTERNAL_ADDRESS = "[internal address]"
INTERNAL_ID = "[internal id]"
# An id the proxy gives workers, or the transfer id of (a part of) one: xpyd-<hex>[.<part>][~p~..~d~..[~m~..]]
_REQUEST_ID = re.compile(r"xpyd-(?P<uid>[0-9a-f]{32})(?:\.[0-9]+|(?:~[a-z]~[\w.\-\[\]:]*[\w\]])+)?")
_ADDRESS = re.compile("|".join((
    r"(?i:\b[a-z][a-z0-9+.\-]*://(?:\[[0-9a-f:.]+\]|[^\s/'\"<>()\[\]{},:]+)(?::[0-9]+)?(?:/[^\s'\"<>(){},]*)?)",
    r"\[[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*\](?::[0-9]{1,5})?",  # [IPv6][:port]
    r"(?<![\w.])[0-9]{1,3}(?:\.[0-9]{1,3}){3}(?::[0-9]{1,5})?(?!\.?\w)",  # IPv4[:port]
    r"(?<![\w:.])(?=[0-9A-Fa-f:]*::)[0-9A-Fa-f:]{2,39}(?![\w:])",  # IPv6 with '::' (::1, fe80::2)
    r"(?i:(?<![\w.\-])(?:localhost|[a-z0-9\-]+(?:\.[a-z0-9\-]+)+):[0-9]{1,5}(?!\w))",  # host.domain:port
)))
_NAMED_WORKER = re.compile(rf"\bworker {re.escape(INTERNAL_ADDRESS)}")  # "decode worker <url> failed": "decode worker failed"
_SOCKET_TUPLE = re.compile(rf"\('{re.escape(INTERNAL_ADDRESS)}', [0-9]+(?:, [0-9]+)*\)")  # ('10.0.0.5', 8100)


def _known_addresses(workers: Iterable[WorkerInfo]) -> list[str]:
    """Each worker's URL, its host:port and its signal address, longest first (so none is cut in two)."""
    found: set[str] = set()
    for w in workers:
        found.update((w.http_url, w.signal_addr))
        netloc = urlsplit(w.http_url).netloc
        if netloc:
            found.add(netloc)
    return sorted((a for a in found if a), key=len, reverse=True)


class Redactor:
    """Takes the cluster's internal addresses and ids out of what a client reads.

    ``workers`` lists the workers the proxy knows (the registry's); the addresses of workers it does not
    know, or that left, are still caught by their shape (URLs, IP addresses, dotted host names with a port).
    """

    def __init__(self, workers: Callable[[], Iterable[WorkerInfo]]) -> None:
        self._workers = workers

    def text(self, text: str, request_id: str | None = None, public_id: str | None = None,
             workers: Iterable[WorkerInfo] = ()) -> str:
        """``text`` without internal addresses or ids; ``request_id`` (the call's, as the workers know it)
        becomes ``public_id`` (in any of its forms), and ``workers`` are known as well as the registry's."""
        call = _REQUEST_ID.match(request_id) if request_id and public_id is not None else None

        def name_id(m: re.Match) -> str:
            return public_id if call is not None and m.group("uid") == call.group("uid") else INTERNAL_ID

        text = _REQUEST_ID.sub(name_id, text)
        for address in _known_addresses([*workers, *self._workers()]):
            text = text.replace(address, INTERNAL_ADDRESS)
        text = _ADDRESS.sub(INTERNAL_ADDRESS, text)
        text = _SOCKET_TUPLE.sub(INTERNAL_ADDRESS, text)
        return _NAMED_WORKER.sub("worker", text)

    def error(self, e: APIError, request_id: str | None = None, public_id: str | None = None,
              workers: Iterable[WorkerInfo] = ()) -> APIError:
        """``e`` itself, its message (and a worker's error body it passes on) redacted as ``text`` does."""
        workers = list(workers)

        def clean(obj: object) -> object:
            if isinstance(obj, str):
                return self.text(obj, request_id, public_id, workers)
            if isinstance(obj, dict):
                return {clean(k): clean(v) for k, v in obj.items()}
            if isinstance(obj, list):
                return [clean(v) for v in obj]
            return obj

        e.message = self.text(e.message, request_id, public_id, workers)
        e.args = (e.message,)
        if isinstance(e, UpstreamError) and e.body is not None:
            e.body = clean(e.body)
        return e


# The messages of the server's own errors (as werkzeug words them: what clients of the proxy have read so far).
_HTTP_MESSAGES = {
    404: "Not Found: The requested URL was not found on the server. If you entered the URL manually please "
         "check your spelling and try again.",
    405: "Method Not Allowed: The method is not allowed for the requested URL.",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(obj: dict, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json", headers=headers)


def error_response(e: APIError) -> web.Response:
    headers = None
    if e.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    elif e.status in (429, 503):
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
    return json_response(e.to_dict(), e.status, headers)


def http_error(e: web.HTTPException, max_body_bytes: int) -> APIError:
    """The server's own HTTP error (no route, wrong method, body too large ...) as an APIError."""
    status = e.status
    if status == 413:
        message = f"request body is larger than {max_body_bytes} bytes"
    else:
        message = _HTTP_MESSAGES.get(status) or f"{e.reason}"
    return APIError(status, message, type="invalid_request_error" if status < 500 else "server_error")


def error_middleware(max_body_bytes: int, redactor: Redactor,
                     before: Callable[[web.Request], None] | None = None,
                     after: Callable[[web.Request, web.StreamResponse], None] | None = None):
    """An aiohttp middleware: ``before(request)`` (may raise an APIError), the handler, and every error as an
    OpenAI-style JSON answer with no internal address in it; then ``after(request, response)`` on every answer,
    errors too (before a streamed body's first byte). A cancelled request (the client left) is not answered."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if before is not None:
                before(request)
            response = await handler(request)
        except APIError as e:
            response = error_response(redactor.error(e))
        except web.HTTPException as e:
            response = error_response(http_error(e, max_body_bytes))
            if e.status == 405 and "Allow" in e.headers:
                response.headers["Allow"] = e.headers["Allow"]
        except Exception:
            log.exception("unhandled error")
            response = error_response(APIError(500, "internal error in the proxy", type="server_error"))
        if after is not None:
            after(request, response)
        return response

    return middleware
