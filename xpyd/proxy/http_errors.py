"""The proxy's JSON responses, and every error as OpenAI's ``{"error": {...}}`` with its status.

``APIError`` (the proxy's own and a worker's ``UpstreamError``) keeps its status;
Quart's HTTP errors (404, 405, 413 ...) get a message of their own; anything
else is a 500 that says no more than "internal error in the proxy". A 401 says
``WWW-Authenticate: Bearer``; a 429 or 503 says when to retry.
"""

from __future__ import annotations

import logging

from quart import Quart, Response
from werkzeug.exceptions import HTTPException

from xpyd.api.openai import APIError
from xpyd.api.responses import dumps
from xpyd.proxy.admission import RETRY_AFTER_SECONDS

log = logging.getLogger(__name__)


def json_response(obj: dict, status: int = 200, headers: dict | None = None) -> Response:
    return Response(dumps(obj), status=status, content_type="application/json", headers=headers)


def error_response(e: APIError) -> Response:
    headers = None
    if e.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    elif e.status in (429, 503):
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
    return json_response(e.to_dict(), e.status, headers)


def register_error_handlers(app: Quart, max_body_bytes: int) -> None:
    """Make every error ``app`` answers an OpenAI-style JSON error."""

    @app.errorhandler(APIError)
    async def api_error(e: APIError) -> Response:
        return error_response(e)

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
