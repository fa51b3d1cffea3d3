"""The proxy's JSON responses, and every error as OpenAI's ``{"error": {...}}`` with its status.

``APIError`` (the proxy's own and a worker's ``UpstreamError``) keeps its status;
Quart's HTTP errors (404, 405, 413 ...) get a message of their own; anything
else is a 500 that says no more than "internal error in the proxy". A 401 says
``WWW-Authenticate: Bearer``; a 429 or 503 says when to retry.

No error the client reads names the cluster's inside (``Redactor``): worker addresses, the proxy's
request ids (which carry both workers' addresses) and any address a worker's own message mentions
become ``[internal address]`` and ``[internal id]`` (the request's own id: its public one), in the
proxy's messages and in the 4xx bodies and in-stream errors it relays. ``GET /cluster`` (behind the
API key, when one is set) and the proxy's log keep them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from quart import Quart, Response
from werkzeug.exceptions import HTTPException

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


def json_response(obj: dict, status: int = 200, headers: dict | None = None) -> Response:
    return Response(dumps(obj), status=status, content_type="application/json", headers=headers)


def error_response(e: APIError) -> Response:
    headers = None
    if e.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    elif e.status in (429, 503):
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
    return json_response(e.to_dict(), e.status, headers)


def register_error_handlers(app: Quart, max_body_bytes: int, redactor: Redactor) -> None:
    """Make every error ``app`` answers an OpenAI-style JSON error, with no internal address in it."""

    @app.errorhandler(APIError)
    async def api_error(e: APIError) -> Response:
        return error_response(redactor.error(e))

    @app.errorhandler(HTTPException)
    async def http_error(e: HTTPException) -> Response:
        status = e.code or 500
        if status == 413:
            message = f"request body is larger than {max_body_bytes} bytes"
        else:
            message = f"{e.name}: {e.description}" if e.description else str(e.name)
        kind = "invalid_request_error" if status < 500 else "server_error"
        return error_response(APIError(status, message, type=kind))

    @app.errorhandler(Exception)
    async def internal_error(e: Exception) -> Response:
        log.exception("unhandled error")
        return error_response(APIError(500, "internal error in the proxy", type="server_error"))
