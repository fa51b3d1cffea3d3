"""The worker HTTP contract as the proxy speaks it: request bodies out, tokens and usage in.

For one client request::

    prefill worker  <- prefill_body: body + max_tokens=1, stream=false -> parse_first_token (JSON)
    decode worker   <- decode_body: body + stream=true + the response's identity
                       -> streaming: the chunks the client gets for tokens 2..n (+ usage if asked)
                       -> not streaming: parse_delta per SSE choice, and the usage chunk
                       (``local``: decode prefills the request itself and its stream has token 1 too,
                       read by ``DecodeStream.first``: ``xpyd.api.local_prefill``)

Both carry the request's id in ``X-Request-Id``; decode's ``kv_transfer_params.response`` names the
response (``xpyd.api.identity``) so its chunks need no rewriting. The parsers raise ValueError,
KeyError, TypeError or IndexError on a malformed answer (``upstream_errors``
turns those into a 502).
"""

from __future__ import annotations

from dataclasses import dataclass

from xpyd.api.identity import WIRE_KEY, ResponseIdentity
from xpyd.api.openai import CompletionRequest, RequestKind
from xpyd.api.local_prefill import LOCAL_PREFILL_KEY
from xpyd.api.resume import CHUNK_IDS_KEY, RESUME_KEY, TOKEN_IDS_KEY, ids_of
from xpyd.api.timing import WorkerTiming, decode_timing
from xpyd.discovery.types import WorkerInfo

REQUEST_ID_HEADER = "X-Request-Id"
ABORT_PATH = "/xpyd/abort"  # a worker drops the request named in X-Request-Id
ROUTES = {RequestKind.COMPLETION: "/v1/completions", RequestKind.CHAT: "/v1/chat/completions"}


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens the prefill worker's prefix cache served

@dataclass(frozen=True, slots=True)
class FirstToken:
    text: str  # as it should be shown to the client; may be "" (held back)
    finish_reason: str | None  # not None: the request ended on prefill
    usage: Usage
    timing: WorkerTiming | None = None  # prefill's own (X-Xpyd-Timing), when the proxy asked for it
    stop_reason: str | int | None = None  # (ended on prefill) the stop string or token id that ended it
    logprobs: dict | None = None  # its logprobs (and an echoed prompt's), in the response's shape
    prompt_logprobs: list | None = None  # vLLM's prompt_logprobs, when asked
    token_ids: tuple[int, ...] | None = None  # the output tokens it names (``xpyd.api.resume``); None: not named
    span: tuple[float, float] | None = None  # the prefill call: started, answer read (the proxy's monotonic clock)


@dataclass(frozen=True, slots=True)
class Delta:
    text: str
    finish_reason: str | None
    stop_reason: str | int | None = None  # with the finish_reason: the stop string or token id, if one
    logprobs: dict | None = None  # of this chunk's tokens, when asked


_RESUMED_DROPS = ("echo", "prompt_logprobs")  # a migrated request's client has its prompt's part already


def prefill_body(req: CompletionRequest, worker: WorkerInfo, resume: tuple[int, ...] = ()) -> dict:
    """``resume``: a migrated request's output so far (``xpyd.api.resume``)."""
    drop = ("stream_options", "max_completion_tokens", *(_RESUMED_DROPS if resume else ()))
    body = {k: v for k, v in req.raw.items() if k not in drop}
    kvp = {"role": "prefill", "max_tokens": req.max_tokens, TOKEN_IDS_KEY: True}
    if resume:
        kvp[RESUME_KEY] = list(resume)
    body.update(model=worker.model_id, max_tokens=1, stream=False, kv_transfer_params=kvp)
    return body


def decode_body(req: CompletionRequest, worker: WorkerInfo, identity: ResponseIdentity,
                resume: tuple[int, ...] = (), local: bool = False) -> dict:
    """Decode always streams; to a streaming client its chunks go as they are (the usage chunk only if
    the client asked), while for a JSON answer the proxy needs decode's usage. ``prompt_logprobs`` are
    prefill's to compute (and streams have none): decode is not asked for them. Its chunks name their tokens
    (the proxy strips the names), so the request can move on if decode fails (``resume``: it has)."""
    drop = _RESUMED_DROPS if resume else ("prompt_logprobs",)  # (prefill's part of the answer)
    kvp = {"role": "decode", WIRE_KEY: identity.to_wire(), TOKEN_IDS_KEY: True}
    if resume:
        kvp[RESUME_KEY] = list(resume)
    if local:
        kvp[LOCAL_PREFILL_KEY] = True
    return {
        **{k: v for k, v in req.raw.items() if k not in drop},
        "model": worker.model_id,
        "stream": True,
        "stream_options": {"include_usage": req.include_usage or not req.stream},
        "kv_transfer_params": kvp,
    }


def _str_or_none(v: object) -> str | None:
    if v is not None and not isinstance(v, str):
        raise TypeError(f"expected a string or null, got {type(v).__name__}")
    return v


def _stop_reason(choice: dict) -> str | int | None:
    v = choice.get("stop_reason")
    if v is not None and (isinstance(v, bool) or not isinstance(v, (str, int))):
        raise TypeError(f"stop_reason: expected a string, an integer or null, got {type(v).__name__}")
    return v


def parse_usage(d: dict) -> Usage:
    prompt, completion = d["prompt_tokens"], d["completion_tokens"]
    details = d.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") or 0 if isinstance(details, dict) else 0
    if not (isinstance(prompt, int) and isinstance(completion, int) and isinstance(cached, int)):
        raise TypeError("usage token counts must be integers")
    return Usage(prompt, completion, cached)


def parse_first_token(data: dict, kind: RequestKind, timing: str | None = None) -> FirstToken:
    """Prefill's JSON answer, and its ``X-Xpyd-Timing`` header if any (a malformed one is left out: it
    never fails a request)."""
    choice = data["choices"][0]
    text = choice["message"]["content"] if kind is RequestKind.CHAT else choice["text"]
    try:
        own = decode_timing(timing) if timing is not None else None
    except ValueError:
        own = None
    prompt_logprobs = (data if kind is RequestKind.CHAT else choice).get("prompt_logprobs")
    return FirstToken(
        text=_str_or_none(text) or "",
        finish_reason=_str_or_none(choice.get("finish_reason")),
        usage=parse_usage(data["usage"]),
        timing=own,
        stop_reason=_stop_reason(choice),
        logprobs=_object_or_none(choice.get("logprobs"), dict),
        prompt_logprobs=_object_or_none(prompt_logprobs, list),
        token_ids=_ids_or_none(data.get(CHUNK_IDS_KEY)),
    )


def _ids_or_none(v: object) -> tuple[int, ...] | None:
    return None if v is None else tuple(ids_of(v))


def _object_or_none(v: object, kind: type) -> object:
    if v is not None and not isinstance(v, kind):
        raise TypeError(f"expected a {kind.__name__} or null, got {type(v).__name__}")
    return v


def parse_delta(choice: dict, kind: RequestKind) -> Delta | None:
    """One choice of a decode SSE chunk; None if it carries neither text nor a finish reason."""
    if kind is RequestKind.CHAT:
        text = (choice.get("delta") or {}).get("content")
    else:
        text = choice.get("text")
    text = _str_or_none(text) or ""
    finish_reason = _str_or_none(choice.get("finish_reason"))
    logprobs = _object_or_none(choice.get("logprobs"), dict)
    if not text and finish_reason is None and logprobs is None:
        return None  # e.g. the chat role chunk: the proxy sends its own
    return Delta(text, finish_reason, _stop_reason(choice) if finish_reason is not None else None, logprobs)
