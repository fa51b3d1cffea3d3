"""What a response is called (``id``, ``created``, ``model``) when the proxy names it: ``ResponseIdentity``.

The proxy names each client request's response once and sends the name to the decode worker in
``kv_transfer_params.response``::

    {"role": "decode", "response": {"id": "chatcmpl-<hex>", "created": 1700000000, "model": "<served name>"}}

A worker given one writes it into every chunk (and its JSON body), and a stream that continues the
proxy's own (it already sent the chat role chunk and prefill's first token) opens with no role chunk:
the proxy then passes decode's events on as they came. Workers check it strictly (``response_identity``:
a 400 that names the field); a request without it gets the worker's own values.

The client may choose the id: as vLLM does, a client's ``X-Request-Id`` names the response
(``cmpl-<it>`` / ``chatcmpl-<it>``, ``xpyd.api.responses.new_response_id``) and comes back in the response's
``X-Request-Id``. vLLM takes any value; here it must fit a response id (``client_request_id``: 1 to 200
visible ASCII characters, no quotes or backslashes), and one that does not is a 400 naming the header
rather than being replaced, so a client never gets an id back other than the one it sent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from xpyd.api.openai import APIError

MAX_ID_CHARS = 256
MAX_CLIENT_ID_CHARS = 200  # a client's X-Request-Id (a response id adds at most 9: "chatcmpl-")
CLIENT_ID_HEADER = "X-Request-Id"
MAX_MODEL_CHARS = 1024
MAX_CREATED = 2**32 - 1  # Unix seconds (year 2106)
_ID = re.compile(r"[!#-\[\]-~]+")  # visible ASCII but '"' and '\\'
_FIELDS = ("id", "created", "model")
WIRE_KEY = "response"  # its key in kv_transfer_params


def _id_problem(v: object) -> str | None:
    if not isinstance(v, str) or not 1 <= len(v) <= MAX_ID_CHARS or not _ID.fullmatch(v):
        return f"must be a string of 1 to {MAX_ID_CHARS} visible ASCII characters without quotes or backslashes"
    return None


def _created_problem(v: object) -> str | None:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_CREATED:
        return f"must be an integer Unix time in seconds, 0 to {MAX_CREATED}"
    return None


def _model_problem(v: object) -> str | None:
    if not isinstance(v, str) or not 1 <= len(v) <= MAX_MODEL_CHARS or not v.isprintable():
        return f"must be a string of 1 to {MAX_MODEL_CHARS} printable characters"
    return None


_CHECKS = {"id": _id_problem, "created": _created_problem, "model": _model_problem}


@dataclass(frozen=True, slots=True)
class ResponseIdentity:
    id: str  # e.g. chatcmpl-<hex>
    created: int  # Unix seconds
    model: str  # the served model name the client sees

    def __post_init__(self) -> None:
        for name in _FIELDS:
            problem = _CHECKS[name](getattr(self, name))
            if problem is not None:
                raise ValueError(f"response {name} {problem}")

    def to_wire(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.model}


def response_identity(kv_transfer_params: dict | None) -> ResponseIdentity | None:
    """The identity in ``kv_transfer_params.response``, if any; APIError(400) naming the field if invalid."""
    if not kv_transfer_params or kv_transfer_params.get(WIRE_KEY) is None:
        return None
    where = f"kv_transfer_params.{WIRE_KEY}"
    obj = kv_transfer_params[WIRE_KEY]
    if not isinstance(obj, dict):
        raise APIError(400, f"{where} must be an object with id, created and model", param=where)
    unknown = sorted(str(k) for k in obj if k not in _FIELDS)
    if unknown:
        raise APIError(400, f"{where} has unknown field(s): {', '.join(unknown)}", param=where)
    for name in _FIELDS:
        if name not in obj:
            raise APIError(400, f"{where}.{name} is required", param=f"{where}.{name}")
        problem = _CHECKS[name](obj[name])
        if problem is not None:
            raise APIError(400, f"{where}.{name} {problem}", param=f"{where}.{name}")
    return ResponseIdentity(obj["id"], obj["created"], obj["model"])


def client_request_id(value: str | None, name: str = CLIENT_ID_HEADER) -> str | None:
    """A client's ``X-Request-Id`` header (or vLLM's ``request_id`` field: ``name``) as the proxy takes it: None
    when absent or empty; APIError(400) naming it unless it is 1 to MAX_CLIENT_ID_CHARS visible ASCII characters
    without quotes or backslashes (what a response id may hold)."""
    if not value:
        return None
    if len(value) > MAX_CLIENT_ID_CHARS or not _ID.fullmatch(value):
        raise APIError(400, f"{name} must be 1 to {MAX_CLIENT_ID_CHARS} visible ASCII characters "
                       "without quotes or backslashes", param=name)
    return value
