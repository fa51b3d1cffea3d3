# Not pydantic: pydantic 2 models parsed slower (chat 21->30 us, completion 14->17 us), +100 ms import, vaguer errors.
"""The OpenAI HTTP API as xpyd speaks it: request parsing and validation.

Shared by the proxy (which validates every client body before any worker sees
it) and the workers (which parse the bodies the proxy forwards). Parsing is
strict: a field we would silently ignore in a way that changes the output
(``tools``, ``response_format``, ``best_of`` ...) is a clear 400,
never a quiet approximation. Sampling fields a request leaves out are None where the model's
``generation_config.json`` may give a default (temperature, top_p, top_k, min_p, repetition_penalty: the
worker applies it, as vLLM does). Unknown fields are ignored, as vLLM does.
The response bodies and SSE framing are built in ``xpyd.api.responses``.

``kv_transfer_params`` is the xpyd extension the proxy adds for the workers::

    prefill: {"role": "prefill", "max_tokens": <client's max_tokens or null>}
    decode:  {"role": "decode", "response": {"id": ..., "created": ..., "model": ...}}

(``response``: what the worker calls its response, ``xpyd.api.identity``.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

from xpyd.api.errors import APIError
from xpyd.api.structured import Constraint, parse_constraint
from xpyd.api.chat_request import ChatTemplateArgs, parse_chat_args, parse_messages
from xpyd.api.fields import is_int as _is_int
from xpyd.api.fields import is_number as _is_number
from xpyd.api.fields import optional_bool as _optional_bool
from xpyd.api.fields import optional_number as _optional_number
from xpyd.api.tools import Tools, parse_tools

MAX_STOP_SEQUENCES = 64
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI / vLLM default for /v1/completions
MAX_CACHE_SALT_CHARS = 256  # (xpyd.prefix_hash.MAX_SALT_CHARS)
MAX_CHOICES = 128  # n times the number of prompts (each choice is a request of its own on the workers)
MAX_LOGPROBS = 20  # top alternatives a request may ask for (vLLM's default max_logprobs; xpyd.model.logprobs)
_UINT64 = 2**64


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
    temperature: float | None  # None (and top_p, top_k, min_p, repetition_penalty): the model's default
    top_p: float | None
    top_k: int | None  # 0 = off
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool  # stream_options.include_usage (only meaningful when streaming)
    kv_transfer_params: dict | None
    raw: dict  # the parsed body, as received; copy before editing
    cache_salt: str | None = None  # vLLM's field: only requests with the same salt share prefix-cache blocks
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias clamped to [-100, 100]), as vLLM
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: the model's context)
    truncation_side: str = "left"  # vLLM's: which end truncate_prompt_tokens cuts ("right": keep the first k)
    add_special_tokens: bool | None = None  # None: completions True, chat False (the template has them)
    logprobs: int | None = None  # each generated token's logprob with this many top alternatives (None: none)
    echo: bool = False  # completions: the prompt comes back before the output (with its logprobs if asked)
    prompt_logprobs: int | None = None  # vLLM's: every prompt token's logprob, with this many alternatives
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    request_id: str | None = None  # vLLM's request_id field: names the response as X-Request-Id does
    n: int = 1  # choices per prompt (``xpyd.api.choices`` splits a request with several)
    prompts: tuple[str | list[int], ...] | None = None  # a completion's prompts when it sent a list of several
    chat: ChatTemplateArgs = ChatTemplateArgs()  # a chat's template arguments
    tools: Tools | None = None  # a chat's tools and tool_choice (``xpyd.api.tools``)
    constraint: Constraint | None = None  # structured output (``xpyd.api.structured``)

    @property
    def prompt_scores(self) -> int | None:
        """How many alternatives each prompt token's logprob needs (None: the prompt is not scored): echo
        with logprobs scores it as the output is, ``prompt_logprobs`` asks for it on its own."""
        echoed = self.logprobs if self.echo else None
        if echoed is None:
            return self.prompt_logprobs
        return echoed if self.prompt_logprobs is None else max(echoed, self.prompt_logprobs)


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# Fields we do not implement, with the values that mean "feature off". Any
# other value is rejected, because ignoring it would silently change the output.
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "suffix": ("",),
    "length_penalty": (1, 1.0),
    "use_beam_search": (False,),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "logits_processors": (),
    "prompt_embeds": (),
    "functions": ([],),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    # vLLM's (0.32) fields this server does not implement: only their "off" values are taken
    "watermarking": (),
    "logprob_token_ids": (),
    "priority": (0,),
    "routed_experts_prompt_start": (0,),
    "return_token_ids": (False,),
    "return_token_offsets": (False,),
    "return_prompt_text": (False,),
    "mm_payload": ("tensors",),
    "return_mm_kwargs": (False,),
    "ec_transfer_params": (),
    "vllm_xargs": ({},),
    "repetition_detection": (),
    "thinking_token_budget": (),
    "stream_interval": (1,),
    "media_io_kwargs": ({},),
    "mm_processor_kwargs": ({},),
}


def _is_off(value: Any, off: tuple[Any, ...]) -> bool:
    if value is None:
        return True
    return any(type(value) is type(o) and value == o for o in off)


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


def _optional_in(d: dict, key: str, low: float, high: float, default: float | None) -> float | None:
    """A number in [low, high], or ``default`` when absent."""
    if d.get(key) is None:
        return default
    v = _optional_number(d, key, 0.0)
    if not low <= v <= high:
        raise _bad(f"'{key}' must be in [{low:g}, {high:g}], got {v:g}", key)
    return v


def _parse_stop_token_ids(d: dict) -> tuple[int, ...]:
    v = d.get("stop_token_ids")
    if v is None:
        return ()
    if not isinstance(v, list) or not all(_is_int(t) and 0 <= t < 2**31 for t in v):
        raise _bad("'stop_token_ids' must be a list of token ids (integers >= 0)", "stop_token_ids")
    if len(v) > MAX_STOP_TOKEN_IDS:
        raise _bad(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are supported", "stop_token_ids")
    return tuple(dict.fromkeys(v))


def _parse_logit_bias(d: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"<token id>": bias}: each bias clamped to [-100, 100], as vLLM does."""
    v = d.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise _bad("'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise _bad(f"'logit_bias' may name at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    out = {}
    for key, bias in v.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise _bad(f"'logit_bias' keys must be token ids (non-negative integers), got {key!r}", "logit_bias")
        if not _is_number(bias):
            raise _bad(f"'logit_bias' values must be numbers, got {bias!r} for {key}", "logit_bias")
        out[int(key)] = min(100.0, max(-100.0, float(bias)))
    if len(out) != len(v):
        raise _bad("'logit_bias' names a token id twice", "logit_bias")
    return tuple(out.items())


def _parse_truncate(d: dict) -> int | None:
    v = d.get("truncate_prompt_tokens")
    if v is None:
        return None
    if not _is_int(v) or not (v >= 1 or v == -1):
        raise _bad("'truncate_prompt_tokens' must be an integer >= 1, or -1 (the model's context length)",
                   "truncate_prompt_tokens")
    return v


def _parse_max_tokens(d: dict, kind: RequestKind, echo: bool) -> int | None:
    """At least 1; 0 only for a completion with ``echo`` (the prompt back, with its logprobs if asked, and no
    output: what an evaluation harness's loglikelihood request sends), as vLLM."""
    key = "max_tokens"
    v = d.get(key)
    if kind is RequestKind.CHAT and d.get("max_completion_tokens") is not None:
        key, v = "max_completion_tokens", d["max_completion_tokens"]
    if v is None:
        return COMPLETION_DEFAULT_MAX_TOKENS if kind is RequestKind.COMPLETION else None
    if not _is_int(v):
        raise _bad(f"'{key}' must be an integer", key)
    if v < 0 or (v == 0 and not echo):
        raise _bad(f"'{key}' must be at least 1, got {v} (0 only with 'echo': the prompt alone)", key)
    return v


def _top_count(d: dict, key: str) -> int:
    v = d[key]
    if not _is_int(v) or not 0 <= v <= MAX_LOGPROBS:
        raise _bad(f"'{key}' must be an integer in [0, {MAX_LOGPROBS}], got {v!r}", key)
    return v


def _parse_logprobs(d: dict, kind: RequestKind, stream: bool) -> tuple[int | None, bool, int | None]:
    """(logprobs, echo, prompt_logprobs) as vLLM reads them: a completion's ``logprobs`` is the number of top
    alternatives (0-20) per token; a chat's is a boolean with ``top_logprobs`` (0-20, which needs it true);
    ``echo`` is a completion's (a chat's ``echo`` is not supported); ``prompt_logprobs`` (0-20) is refused when
    streaming, as vLLM does."""
    echo = False
    if kind is RequestKind.CHAT:
        if d.get("echo"):
            raise _bad("'echo' is not supported for chat completions by this server", "echo")
        asked = _optional_bool(d, "logprobs")
        top = _top_count(d, "top_logprobs") if d.get("top_logprobs") is not None else 0
        if top and not asked:
            raise _bad("when using 'top_logprobs', 'logprobs' must be set to true", "top_logprobs")
        logprobs = top if asked else None
    else:
        logprobs = _top_count(d, "logprobs") if d.get("logprobs") is not None else None
        echo = _optional_bool(d, "echo")
    prompt = _top_count(d, "prompt_logprobs") if d.get("prompt_logprobs") is not None else None
    if prompt is not None and stream:
        raise _bad("'prompt_logprobs' is not supported when streaming", "prompt_logprobs")
    return logprobs, echo, prompt


def _parse_token_list(v: list) -> list[int]:
    if not v:
        raise _bad("'prompt' must not be empty", "prompt")
    if not all(_is_int(t) and 0 <= t < 2**31 for t in v):
        raise _bad("a token-id 'prompt' must be a list of non-negative integers", "prompt")
    return list(v)


def _one_prompt(v: Any) -> str | list[int]:
    if isinstance(v, str):
        if not v:
            raise _bad("'prompt' must not be empty", "prompt")
        return v
    if isinstance(v, list):
        return _parse_token_list(v)
    raise _bad("'prompt' must be a string, a list of token ids, or a list of those", "prompt")


def _parse_prompts(d: dict) -> tuple[str | list[int], ...]:
    """A completion's prompts: one (a string or token ids), or a list of several (strings or token-id lists)."""
    v = d.get("prompt")
    if v is None:
        raise _bad("'prompt' is required", "prompt")
    if isinstance(v, list) and v and isinstance(v[0], (str, list)):
        if not all(isinstance(p, type(v[0])) for p in v):
            raise _bad("a list of prompts must hold only strings or only token-id lists", "prompt")
        return tuple(_one_prompt(p) for p in v)
    return (_one_prompt(v),)


def _parse_n(d: dict, prompts: int) -> int:
    v = d.get("n")
    if v is None:
        return 1
    if not _is_int(v) or v < 1:
        raise _bad(f"'n' must be an integer >= 1, got {v!r}", "n")
    if v * prompts > MAX_CHOICES:
        raise _bad(f"at most {MAX_CHOICES} choices a request (n x prompts), got {v * prompts}", "n")
    return v


def _parse_side(d: dict) -> str:
    v = d.get("truncation_side")
    if v is None:
        return "left"
    if v not in ("left", "right"):
        raise _bad("'truncation_side' must be left or right", "truncation_side")
    return v


def _parse_request_id(d: dict) -> str | None:
    v = d.get("request_id")
    if v is not None and not (isinstance(v, str) and v):
        raise _bad("'request_id' must be a non-empty string", "request_id")
    return v


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


def parse_request(body: bytes, kind: RequestKind, trusted_templates: bool = False) -> CompletionRequest:
    """Parse and validate an OpenAI request body; raise APIError(400) if invalid. ``trusted_templates``: a
    request's own chat_template is taken (the server's --trust-request-chat-template)."""
    d = _load_object(body)
    model = d.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    _check_unsupported(d)
    kv = d.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise _bad("'kv_transfer_params' must be an object", "kv_transfer_params")

    temperature = top_p = None
    if d.get("temperature") is not None:
        temperature = _optional_number(d, "temperature", 1.0)
        if temperature < 0:
            raise _bad(f"'temperature' must be >= 0, got {temperature}", "temperature")
    if d.get("top_p") is not None:
        top_p = _optional_number(d, "top_p", 1.0)
        if not 0 < top_p <= 1:
            raise _bad(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = d.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < -1):
        raise _bad("'top_k' must be an integer >= 0 (0 or -1 disables it)", "top_k")
    repetition_penalty = None
    if d.get("repetition_penalty") is not None:
        repetition_penalty = _optional_number(d, "repetition_penalty", 1.0)
        if not 0 < repetition_penalty <= 100:
            raise _bad(f"'repetition_penalty' must be in (0, 100], got {repetition_penalty:g}", "repetition_penalty")
    min_tokens = d.get("min_tokens")
    if min_tokens is None:
        min_tokens = 0
    elif not _is_int(min_tokens) or not 0 <= min_tokens < 2**31:
        raise _bad("'min_tokens' must be an integer >= 0", "min_tokens")
    stream = _optional_bool(d, "stream")
    logprobs, echo, prompt_logprobs = _parse_logprobs(d, kind, stream)
    max_tokens = _parse_max_tokens(d, kind, echo)
    if kv is None and max_tokens is not None and min_tokens > max_tokens:  # (a worker checks kv's max_tokens)
        raise _bad(f"'min_tokens' ({min_tokens}) must be at most max_tokens ({max_tokens})", "min_tokens")
    seed = d.get("seed")
    if seed is not None and not (_is_int(seed) and 0 <= seed < _UINT64):
        raise _bad("'seed' must be an integer in [0, 2**64)", "seed")  # what the sampler takes
    cache_salt = d.get("cache_salt")
    if cache_salt is not None and not (isinstance(cache_salt, str) and 1 <= len(cache_salt) <= MAX_CACHE_SALT_CHARS):
        raise _bad(f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
                   "cache_salt")

    is_chat = kind is RequestKind.CHAT
    prompts = None if is_chat else _parse_prompts(d)
    tools = parse_tools(d) if is_chat else None
    if tools is not None and tools.parsed and (logprobs is not None or echo):
        raise _bad("'logprobs' cannot be combined with tool calls (tool_choice auto, required or named)", "logprobs")
    return CompletionRequest(
        kind=kind,
        model=model,
        prompt=None if is_chat else prompts[0],
        messages=parse_messages(d) if is_chat else None,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=None if top_k is None else max(top_k, 0),
        seed=seed,
        stop=_parse_stop(d),
        ignore_eos=_optional_bool(d, "ignore_eos"),
        stream=stream,
        include_usage=_parse_stream_options(d, stream),
        kv_transfer_params=kv,
        raw=d,
        cache_salt=cache_salt,
        min_p=_optional_in(d, "min_p", 0.0, 1.0, None),
        repetition_penalty=repetition_penalty,
        presence_penalty=_optional_in(d, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=_optional_in(d, "frequency_penalty", -2.0, 2.0, 0.0),
        min_tokens=min_tokens,
        stop_token_ids=_parse_stop_token_ids(d),
        logit_bias=_parse_logit_bias(d),
        include_stop_str_in_output=_optional_bool(d, "include_stop_str_in_output"),
        skip_special_tokens=_optional_bool(d, "skip_special_tokens", True),
        spaces_between_special_tokens=_optional_bool(d, "spaces_between_special_tokens", True),
        truncate_prompt_tokens=_parse_truncate(d),
        add_special_tokens=None if d.get("add_special_tokens") is None else _optional_bool(d, "add_special_tokens"),
        logprobs=logprobs,
        echo=echo,
        prompt_logprobs=prompt_logprobs,
        tokens_as_ids=_optional_bool(d, "return_tokens_as_token_ids"),
        n=_parse_n(d, 1 if prompts is None else len(prompts)),
        truncation_side=_parse_side(d),
        request_id=_parse_request_id(d),
        chat=parse_chat_args(d, tools, trusted_templates) if is_chat else ChatTemplateArgs(),
        tools=tools,
        constraint=parse_constraint(d, tools),
        prompts=prompts if prompts is not None and len(prompts) > 1 else None,
    )
