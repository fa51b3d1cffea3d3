# Not pydantic: pydantic 2 models parsed slower (chat 21->30 us, completion 14->17 us), +100 ms import, vaguer errors.
"""The OpenAI HTTP API as xpyd speaks it: request parsing and validation.

Shared by the proxy (which validates every client body before any worker sees
it) and the workers (which parse the bodies the proxy forwards). Parsing is
strict: a field we would silently ignore in a way that changes the output
(``logprobs``, ``echo``, ``tools``, penalties, ``n > 1`` ...) is a clear 400,
never a quiet approximation. Unknown fields are ignored, as vLLM does.
The response bodies and SSE framing are built in ``xpyd.api.responses``.

``kv_transfer_params`` is the xpyd extension the proxy adds for the workers::

    prefill: {"role": "prefill", "max_tokens": <client's max_tokens or null>}
    decode:  {"role": "decode", "response": {"id": ..., "created": ..., "model": ...}}

(``response``: what the worker calls its response, ``xpyd.api.identity``.)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

MAX_STOP_SEQUENCES = 64
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI / vLLM default for /v1/completions
MAX_CACHE_SALT_CHARS = 256  # (xpyd.prefix_hash.MAX_SALT_CHARS)
_UINT64 = 2**64


class APIError(Exception):
    """An error that becomes an OpenAI-style error response with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def to_dict(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class RequestKind(str, Enum):
    COMPLETION = "completion"
    CHAT = "chat"


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    kind: RequestKind
    model: str | None
    prompt: str | list[int] | None  # completions only
    messages: list[dict] | None  # chat only: [{"role", "content": str[, "name"]}]
    max_tokens: int | None  # None = up to the context limit
    temperature: float
    top_p: float
    top_k: int  # 0 = off
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool  # stream_options.include_usage (only meaningful when streaming)
    kv_transfer_params: dict | None
    raw: dict  # the parsed body, as received; copy before editing
    cache_salt: str | None = None  # vLLM's field: only requests with the same salt share prefix-cache blocks


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# Fields we do not implement, with the values that mean "feature off". Any
# other value is rejected, because ignoring it would silently change the output.
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "prompt_logprobs": (),
    "echo": (False,),
    "suffix": ("",),
    "logit_bias": ({},),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "min_p": (0, 0.0),
    "min_tokens": (0,),
    "length_penalty": (1, 1.0),
    "use_beam_search": (False,),
    "stop_token_ids": ([],),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "logits_processors": (),
    "prompt_embeds": (),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    "chat_template": (),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
}


def _is_off(value: Any, off: tuple[Any, ...]) -> bool:
    if value is None:
        return True
    return any(type(value) is type(o) and value == o for o in off)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _load_object(body: bytes) -> dict:
    try:
        obj = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise _bad(f"request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise _bad("request body must be a JSON object")
    try:  # JSON may escape lone surrogates ("\ud800"): valid JSON, but not text we can forward or tokenize
        json.dumps(obj, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise _bad("request body contains invalid Unicode (a lone surrogate escape)") from None
    return obj


JSON_CONTENT_TYPES = ("application/json",)


def check_content_type(header: str | None) -> None:
    """Bodies must be JSON: ``application/json`` (any parameters, e.g. charset), ``application/*+json``,
    or no Content-Type at all. Anything else (a form, text/plain) is a 415 that says what to send."""
    if not header:
        return
    media = header.split(";", 1)[0].strip().lower()
    if media in JSON_CONTENT_TYPES or (media.startswith("application/") and media.endswith("+json")):
        return
    raise APIError(415, f"Content-Type {media or header.strip()!r} is not supported: "
                   "send the request body as JSON with 'Content-Type: application/json'",
                   code="unsupported_media_type")


def _optional_number(d: dict, key: str, default: float) -> float:
    v = d.get(key)
    if v is None:
        return default
    if not _is_number(v):
        raise _bad(f"'{key}' must be a number", key)
    return float(v)


def _optional_bool(d: dict, key: str, default: bool = False) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"'{key}' must be a boolean", key)
    return v


def _parse_max_tokens(d: dict, kind: RequestKind) -> int | None:
    key = "max_tokens"
    v = d.get(key)
    if kind is RequestKind.CHAT and d.get("max_completion_tokens") is not None:
        key, v = "max_completion_tokens", d["max_completion_tokens"]
    if v is None:
        return COMPLETION_DEFAULT_MAX_TOKENS if kind is RequestKind.COMPLETION else None
    if not _is_int(v):
        raise _bad(f"'{key}' must be an integer", key)
    if v <= 0:
        raise _bad(f"'{key}' must be at least 1, got {v}", key)
    return v


def _parse_token_list(v: list) -> list[int]:
    if not v:
        raise _bad("'prompt' must not be empty", "prompt")
    if not all(_is_int(t) and 0 <= t < 2**31 for t in v):
        raise _bad("a token-id 'prompt' must be a list of non-negative integers", "prompt")
    return list(v)


def _parse_prompt(d: dict) -> str | list[int]:
    v = d.get("prompt")
    if v is None:
        raise _bad("'prompt' is required", "prompt")
    if isinstance(v, list) and v and isinstance(v[0], (str, list)):
        if len(v) != 1:
            raise _bad("batched prompts are not supported: send one prompt per request", "prompt")
        v = v[0]
    if isinstance(v, str):
        if not v:
            raise _bad("'prompt' must not be empty", "prompt")
        return v
    if isinstance(v, list):
        return _parse_token_list(v)
    raise _bad("'prompt' must be a string or a list of token ids", "prompt")


_ROLES = ("system", "developer", "user", "assistant")


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _bad(f"messages[{i}]: only text content parts are supported", "messages")
            if not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}]: a text part needs a string 'text'", "messages")
            parts.append(part["text"])
        return "\n".join(parts)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _parse_messages(d: dict) -> list[dict]:
    v = d.get("messages")
    if v is None:
        raise _bad("'messages' is required", "messages")
    if not isinstance(v, list) or not v:
        raise _bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role not in _ROLES:
            raise _bad(
                f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}"
                " (tool messages are not supported)",
                "messages",
            )
        if m.get("tool_calls") or m.get("function_call"):
            raise _bad(f"messages[{i}]: tool calls are not supported", "messages")
        msg = {"role": role, "content": _message_text(m.get("content"), i)}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _parse_stop(d: dict) -> tuple[str, ...]:
    v = d.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise _bad(f"at most {MAX_STOP_SEQUENCES} stop sequences are supported", "stop")
    return tuple(stops)


def _parse_stream_options(d: dict, stream: bool) -> bool:
    opts = d.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(opts, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    if opts.get("continuous_usage_stats"):
        raise _bad("'stream_options.continuous_usage_stats' is not supported", "stream_options")
    return _optional_bool(opts, "include_usage")


def _check_unsupported(d: dict) -> None:
    for key, off in _OFF_VALUES.items():
        if key in d and not _is_off(d[key], off):
            raise _bad(f"'{key}' is not supported by this server (got {d[key]!r})", key)


def parse_request(body: bytes, kind: RequestKind) -> CompletionRequest:
    """Parse and validate an OpenAI request body; raise APIError(400) if invalid."""
    d = _load_object(body)
    model = d.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    _check_unsupported(d)

    temperature = _optional_number(d, "temperature", 1.0)
    if temperature < 0:
        raise _bad(f"'temperature' must be >= 0, got {temperature}", "temperature")
    top_p = _optional_number(d, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise _bad(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = d.get("top_k")
    if top_k is None:
        top_k = 0
    elif not _is_int(top_k) or top_k < -1:
        raise _bad("'top_k' must be an integer >= 0 (0 or -1 disables it)", "top_k")
    seed = d.get("seed")
    if seed is not None and not (_is_int(seed) and 0 <= seed < _UINT64):
        raise _bad("'seed' must be an integer in [0, 2**64)", "seed")  # what the sampler takes
    kv = d.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise _bad("'kv_transfer_params' must be an object", "kv_transfer_params")
    stream = _optional_bool(d, "stream")
    cache_salt = d.get("cache_salt")
    if cache_salt is not None and not (isinstance(cache_salt, str) and 1 <= len(cache_salt) <= MAX_CACHE_SALT_CHARS):
        raise _bad(f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
                   "cache_salt")

    is_chat = kind is RequestKind.CHAT
    return CompletionRequest(
        kind=kind,
        model=model,
        prompt=None if is_chat else _parse_prompt(d),
        messages=_parse_messages(d) if is_chat else None,
        max_tokens=_parse_max_tokens(d, kind),
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        seed=seed,
        stop=_parse_stop(d),
        ignore_eos=_optional_bool(d, "ignore_eos"),
        stream=stream,
        include_usage=_parse_stream_options(d, stream),
        kv_transfer_params=kv,
        raw=d,
        cache_salt=cache_salt,
    )
