"""The OpenAI HTTP API as xpyd speaks it: response bodies and SSE framing.

Builders for ``text_completion`` / ``chat.completion`` objects, their streaming
chunks (plus the trailing usage chunk), ``/v1/models``, and the compact JSON and
``data: ...`` server-sent-event encodings. Requests are parsed in ``xpyd.api.openai``.
"""

from __future__ import annotations

import time
import uuid

import msgspec

from xpyd.api.openai import RequestKind

DONE_DATA = b"[DONE]"  # the data of the event that ends an OpenAI stream
SSE_DONE = b"data: " + DONE_DATA + b"\n\n"
SSE_KEEPALIVE = b": keep-alive\n\n"  # an SSE comment a silent stream writes now and then (every reader skips it)
KEEPALIVE_SECONDS = 15.0  # ... after this long without bytes (well inside any read timeout: the proxy's is 300 s)


def new_response_id(kind: RequestKind, base: str | None = None) -> str:
    """``cmpl-<hex>`` or ``chatcmpl-<hex>``, like OpenAI and vLLM; with ``base`` (a client's ``X-Request-Id``,
    checked by ``xpyd.api.identity.client_request_id``) ``cmpl-<base>``, as vLLM names it."""
    prefix = "chatcmpl" if kind is RequestKind.CHAT else "cmpl"
    return f"{prefix}-{base or uuid.uuid4().hex}"


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens served from the
    prefix cache (not computed again)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_response(
    request_id: str,
    created: int,
    model: str,
    kind: RequestKind,
    text: str,
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    stop_reason: str | int | None = None,
    logprobs: dict | None = None,
    prompt_logprobs: list | None = None,
    tool_calls: list | None = None,
) -> dict:
    """A complete non-streaming ``text_completion`` / ``chat.completion`` object; ``stop_reason`` (vLLM's): the
    stop string or stop token id that ended it; ``logprobs``: the choice's, in its kind's shape;
    ``prompt_logprobs`` (vLLM's): in the choice of a completion, at the top of a chat completion."""
    if kind is RequestKind.CHAT:
        obj = "chat.completion"
        message = {"role": "assistant", "content": text}
        if tool_calls is not None:  # (tools in play: the text left after the calls, None if none)
            message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
        choice = {
            "index": 0,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
    else:
        obj = "text_completion"
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                  "stop_reason": stop_reason}
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
    out = {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": _usage(prompt_tokens, completion_tokens, cached_tokens),
    }
    if prompt_logprobs is not None and kind is RequestKind.CHAT:
        out["prompt_logprobs"] = prompt_logprobs
    return out


def merge_logprobs(parts) -> dict | None:
    """The logprobs objects of one choice's pieces (a stream's chunks, P/D's two workers) as one: lists joined
    in order; None if no piece has any."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    if "content" in present[0]:
        return {"content": [c for p in present for c in p["content"]]}
    keys = ("text_offset", "token_logprobs", "tokens", "top_logprobs")
    return {k: [v for p in present for v in p[k]] for k in keys}


def _chunk_object(kind: RequestKind) -> str:
    return "chat.completion.chunk" if kind is RequestKind.CHAT else "text_completion"


def _chunk_base(request_id: str, created: int, model: str, kind: RequestKind) -> dict:
    """What every chunk of one stream starts with, in this order."""
    return {"id": request_id, "object": _chunk_object(kind), "created": created, "model": model}


def chunk_head(request_id: str, created: int, model: str, kind: RequestKind) -> bytes:
    """The bytes the JSON of every chunk of this stream starts with (``stream_chunk`` and ``usage_chunk``
    through ``dumps``), up to and including ``"choices":``: a relay checks a chunk's name with it."""
    return dumps(_chunk_base(request_id, created, model, kind))[:-1] + b',"choices":'


def stream_chunk(
    request_id: str,
    created: int,
    model: str,
    kind: RequestKind,
    text: str | None,
    finish_reason: str | None,
    role: bool = False,
    stop_reason: str | int | None = None,
    logprobs: dict | None = None,
    delta: dict | None = None,
) -> dict:
    """One streaming chunk (chat: ``delta`` given whole, e.g. a tool call's, instead of ``text``). Chat: ``role=True`` gives the opening role-only delta;
    ``text=None`` gives an empty delta (the usual shape of a final chunk). ``stop_reason`` as vLLM's chunks
    carry it: in the last one only (with its ``finish_reason``); ``logprobs``: of this chunk's tokens."""
    if kind is RequestKind.CHAT:
        if role:
            delta = {"role": "assistant", "content": ""}
        elif delta is None:
            delta = {} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return {**_chunk_base(request_id, created, model, kind), "choices": [choice]}


def has_text(chunk: dict) -> bool:
    """A stream chunk with generated text in a choice (a completion's ``text``, a chat delta's ``content``): a
    content chunk, as a client's TTFT counts it."""
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if isinstance(choice, dict) and (choice.get("text") or (isinstance(delta, dict) and delta.get("content"))):
            return True
    return False


def usage_chunk(
    request_id: str,
    created: int,
    model: str,
    kind: RequestKind,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
) -> dict:
    """The trailing usage chunk of a stream (``stream_options.include_usage``)."""
    return {**_chunk_base(request_id, created, model, kind), "choices": [],
            "usage": _usage(prompt_tokens, completion_tokens, cached_tokens)}


def dumps(obj: dict) -> bytes:
    """Compact UTF-8 JSON (msgspec: 0.2 us a token chunk where the standard library's json took 4.6 us; the same
    bytes for what the API writes, but a non-finite float, which it never writes, comes out null, not NaN)."""
    return _encode(obj)


_encode = msgspec.json.Encoder().encode


def sse(obj: dict) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def models_response(model_names: list[str], created: int | None = None, max_model_len: int | None = None) -> dict:
    """``/v1/models`` as vLLM answers it: each model with its ``root``, ``parent`` and ``max_model_len`` (None
    while unknown: a proxy before any worker reported it)."""
    created = int(time.time()) if created is None else created
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "xpyd", "root": name, "parent": None,
             "max_model_len": max_model_len}
            for name in model_names
        ],
    }
