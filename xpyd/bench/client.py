"""The HTTP side: one streaming request to an OpenAI-compatible endpoint, recorded as a timeline.

A ``StreamingClient`` owns one aiohttp session for the whole run (connection limit set by the
caller, >= the concurrency) and turns each ``RequestSpec`` into a ``RequestResult``: the send time,
the arrival time of every content chunk (a chunk carries one or more tokens, so gaps are per chunk),
the end time, the generated text, the token counts from the trailing ``usage`` chunk (with
``usage.prompt_tokens_details.cached_tokens``, the prompt tokens the server's prefix cache had,
when the server reports it), the workers that served it when the server names them (an xpyd proxy
with ``--expose-worker-names``: ``x-xpyd-workers: prefill=NAME, decode=NAME``, see ``parse_workers``), the
workers' own timing when the server ends the stream with it (an xpyd proxy with ``--expose-worker-timing``:
the SSE comment ``: xpyd-timing {json}``, ``xpyd.api.timing``), or an error kind. Errors are returned, never raised: a benchmark counts them.

Asked for JSON answers (``stream=False``: ``xpyd bench --no-stream``) the answer is one "chunk" arriving with
its body: its arrival is the TTFT (and the end), the text is choice 0's, and the workers' timing is the
answer's ``X-Xpyd-Timing`` header. ``n`` > 1 asks for that many choices.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from enum import Enum

import aiohttp

from xpyd.api.responses import DONE_DATA
from xpyd.api.sse import SSEParser, sse_data
from xpyd.api.timing import COMMENT_PREFIX, TIMING_HEADER, WorkerTiming, decode_timing, timing_of_comment
from xpyd.bench.workload import RequestSpec


class Endpoint(str, Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"

    @property
    def path(self) -> str:
        return "/v1/completions" if self is Endpoint.COMPLETIONS else "/v1/chat/completions"


class ErrorKind(str, Enum):
    HTTP = "http"  # a non-200 status; the key in reports is http_<status>
    TIMEOUT = "timeout"  # --timeout elapsed before the stream ended
    CONNECTION = "connection"  # refused / reset / DNS before any response
    DISCONNECTED = "disconnected"  # the server closed the stream before [DONE]
    STREAM_ERROR = "stream_error"  # an {"error": ...} event inside the stream
    BAD_RESPONSE = "bad_response"  # not parseable as OpenAI SSE
    EMPTY = "empty"  # the stream ended without any content chunk


WORKERS_HEADER = "x-xpyd-workers"  # xpyd.proxy.worker_names: the proxy's side of it
WORKER_ROLES = ("prefill", "decode", "colocated")
_MAX_WORKER_NAME = 64


def parse_workers(value: str | None) -> dict[str, str] | None:
    """``x-xpyd-workers``'s value -> {role: name} for the roles xpyd names (prefill, decode, colocated);
    None without the header or with nothing usable in it (items that are not ROLE=NAME are skipped)."""
    if not value:
        return None
    out: dict[str, str] = {}
    for item in value.split(","):
        role, sep, name = item.partition("=")
        role, name = role.strip(), name.strip()
        if sep and role in WORKER_ROLES and name and len(name) <= _MAX_WORKER_NAME and name.isprintable():
            out[role] = name
    return out or None


class EndpointUnreachable(Exception):
    """The server could not be reached at all (connection refused, DNS, timeout)."""


class NotOpenAI(Exception):
    """Something answered, but not as an OpenAI-compatible server would."""


@dataclass(slots=True)
class RequestResult:
    """What happened to one request; times are ``time.perf_counter()`` seconds."""

    label: str
    send_time: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    end_time: float = 0.0
    output_tokens: int | None = None  # usage.completion_tokens (None: the server sent no usage)
    prompt_tokens: int | None = None  # usage.prompt_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (None: not reported)
    text: str = ""  # the generated text (multi-turn builds the next turn from it)
    turn: int | None = None  # the spec's turn (multi-turn)
    trace_line: int | None = None  # the spec's line in the trace file (trace replay)
    workers: dict[str, str] | None = None  # {role: name} from x-xpyd-workers (None: the server did not say)
    worker_timing: WorkerTiming | None = None  # the workers' own, from `: xpyd-timing` (None: not sent, or broken)
    streamed: bool = True  # False: a JSON answer (its one chunk arrived with its end)
    error: str | None = None  # error key (ErrorKind value, or http_<status>); None = completed
    error_detail: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


def normalize_base_url(url: str) -> str:
    """``http://h:8000``, ``http://h:8000/`` and ``http://h:8000/v1`` all mean the same server."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def fetch_model_names(base_url: str, api_key: str | None, timeout_s: float = 10.0) -> list[str]:
    """``GET /v1/models`` -> the served model ids.

    Raises ``EndpointUnreachable`` if nothing answers, ``NotOpenAI`` if something answers but not
    with an OpenAI model list."""
    url = normalize_base_url(base_url) + "/v1/models"
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(url, headers=_headers(api_key)) as resp:
                if resp.status != 200:
                    raise NotOpenAI(f"GET {url} answered HTTP {resp.status}")
                body = await resp.json(content_type=None)
    except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as e:
        raise EndpointUnreachable(f"cannot reach {url}: {e or type(e).__name__}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise NotOpenAI(f"GET {url} did not answer JSON") from e
    try:
        return [m["id"] for m in body["data"]]
    except (KeyError, TypeError) as e:
        raise NotOpenAI(f"GET {url} did not answer an OpenAI model list") from e


class _StreamFailure(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


class StreamingClient:
    """Sends streaming (or, ``stream=False``, JSON) requests over one session: ``async with StreamingClient(...)
    as c``."""

    def __init__(self, base_url: str, endpoint: Endpoint, model: str, *, timeout_s: float,
                 max_connections: int, api_key: str | None = None, stream: bool = True, n: int = 1) -> None:
        if timeout_s <= 0 or max_connections < 1 or n < 1:
            raise ValueError("timeout_s must be > 0, max_connections >= 1 and n >= 1")
        self._stream = stream
        self._n = n
        self._url = normalize_base_url(base_url) + endpoint.path
        self._endpoint = endpoint
        self._model = model
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(timeout_s, 10.0))
        self._max_connections = max_connections
        self._headers = _headers(api_key)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> StreamingClient:
        connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout,
                                              headers=self._headers)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def body(self, spec: RequestSpec) -> dict:
        """The JSON body: streaming with usage (unless ``stream`` is off), ``ignore_eos`` so ``max_tokens`` is
        exact."""
        body: dict = {"model": self._model, "max_tokens": spec.max_tokens, "stream": self._stream,
                      "ignore_eos": True}
        if self._stream:
            body["stream_options"] = {"include_usage": True}
        if self._n > 1:
            body["n"] = self._n
        if self._endpoint is Endpoint.CHAT:
            if isinstance(spec.prompt, tuple):
                raise ValueError("a prompt of token ids needs the completions endpoint")
            body["messages"] = (list(spec.messages) if spec.messages is not None
                                else [{"role": "user", "content": spec.prompt}])
        elif spec.prompt is None:
            raise ValueError("the completions endpoint needs a prompt, not messages")
        else:
            body["prompt"] = list(spec.prompt) if isinstance(spec.prompt, tuple) else spec.prompt
        return body

    async def send(self, spec: RequestSpec) -> RequestResult:
        if self._session is None:
            raise RuntimeError("use StreamingClient as an async context manager")
        body = self.body(spec)
        result = RequestResult(label=spec.label, send_time=time.perf_counter(), turn=spec.turn,
                               trace_line=spec.trace_line, streamed=self._stream)
        try:
            async with self._session.post(self._url, json=body) as resp:
                result.workers = parse_workers(resp.headers.get(WORKERS_HEADER))
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    raise _StreamFailure(f"{ErrorKind.HTTP.value}_{resp.status}", text)
                if self._stream:
                    await self._read_stream(resp, result)
                else:
                    await self._read_answer(resp, result)
        except _StreamFailure as e:
            result.error, result.error_detail = e.kind, str(e)
        except asyncio.TimeoutError:
            result.error, result.error_detail = ErrorKind.TIMEOUT.value, "request timed out"
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as e:
            result.error, result.error_detail = ErrorKind.DISCONNECTED.value, str(e) or type(e).__name__
        except (aiohttp.ClientConnectionError, OSError) as e:
            result.error, result.error_detail = ErrorKind.CONNECTION.value, str(e) or type(e).__name__
        except (aiohttp.ClientError, ValueError) as e:  # ValueError: an SSE event over the parser's limit
            result.error, result.error_detail = ErrorKind.BAD_RESPONSE.value, str(e) or type(e).__name__
        result.end_time = time.perf_counter()
        return result

    async def _read_stream(self, resp: aiohttp.ClientResponse, result: RequestResult) -> None:
        done = False
        parts: list[str] = []
        parser = SSEParser(keep=COMMENT_PREFIX)
        async with contextlib.aclosing(sse_data(resp.content.iter_any(), parser=parser)) as events:
            async for data in events:
                now = time.perf_counter()
                event = parse_event(data)
                if event is DONE:
                    done = True
                    result.worker_timing = _timing(parser.kept)
                    break
                if "error" in event:
                    raise _StreamFailure(ErrorKind.STREAM_ERROR.value, json.dumps(event["error"])[:300])
                text = chunk_text(event, self._endpoint)
                if text:
                    result.chunk_times.append(now)
                    parts.append(text)
                usage = event.get("usage")
                if isinstance(usage, dict):
                    read_usage(usage, result)
        result.text = "".join(parts)
        if not done:
            raise _StreamFailure(ErrorKind.DISCONNECTED.value, "stream ended without [DONE]")
        if not result.chunk_times:
            raise _StreamFailure(ErrorKind.EMPTY.value, "no content chunk in the stream")


    async def _read_answer(self, resp: aiohttp.ClientResponse, result: RequestResult) -> None:
        """A JSON answer: its arrival is its one chunk's."""
        data = await resp.read()
        now = time.perf_counter()
        answer = parse_event(data)
        if answer is DONE or "error" in answer:
            raise _StreamFailure(ErrorKind.BAD_RESPONSE.value, f"not a completion: {data[:100]!r}")
        choices = answer.get("choices")
        texts = [answer_text(c, self._endpoint) for c in choices] if isinstance(choices, list) else []
        if any(texts):
            result.chunk_times.append(now)
        result.text = texts[0] if texts else ""
        if isinstance(answer.get("usage"), dict):
            read_usage(answer["usage"], result)
        result.worker_timing = _header_timing(resp.headers.get(TIMING_HEADER))
        if not result.chunk_times:
            raise _StreamFailure(ErrorKind.EMPTY.value, "no text in the answer")


DONE = object()  # the `data: [DONE]` event


def _header_timing(value: str | None) -> WorkerTiming | None:
    """The workers' timing from a JSON answer's ``X-Xpyd-Timing``; None without one, or for a broken one."""
    try:
        return decode_timing(value) if value is not None else None
    except ValueError:
        return None


def answer_text(choice: object, endpoint: Endpoint) -> str:
    """A JSON answer's choice's text ('' if it has none)."""
    if not isinstance(choice, dict):
        return ""
    if endpoint is Endpoint.CHAT:
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else None
    else:
        text = choice.get("text")
    return text if isinstance(text, str) else ""


def _timing(comment: bytes | None) -> WorkerTiming | None:
    """The workers' timing from the stream's timing comment; None without one, or for a broken one (the
    report counts the requests without)."""
    try:
        return timing_of_comment(comment) if comment is not None else None
    except ValueError:
        return None


def parse_event(data: bytes) -> dict | object:
    """One SSE event's data (``xpyd.api.sse``) -> its JSON object, or ``DONE``.

    Raises ``_StreamFailure(bad_response)`` for data that is not a JSON object."""
    if data.strip() == DONE_DATA:
        return DONE
    try:
        obj = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _StreamFailure(ErrorKind.BAD_RESPONSE.value, f"not JSON: {data[:100]!r}") from None
    if not isinstance(obj, dict):
        raise _StreamFailure(ErrorKind.BAD_RESPONSE.value, f"not a JSON object: {data[:100]!r}")
    return obj


def read_usage(usage: dict, result: RequestResult) -> None:
    """Token counts from a ``usage`` object into ``result`` (a later usage chunk overrides an earlier
    one). ``cached_tokens`` stays None unless ``prompt_tokens_details.cached_tokens`` is an integer:
    vLLM sends ``prompt_tokens_details: null`` unless started with --enable-prompt-tokens-details."""
    result.output_tokens = usage.get("completion_tokens", result.output_tokens)
    result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0:
        result.cached_tokens = cached


def chunk_text(event: dict, endpoint: Endpoint) -> str:
    """The generated text a chunk carries ('' for role-only, empty and usage-only chunks)."""
    choices = event.get("choices")
    if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    if endpoint is Endpoint.CHAT:
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else None
    else:
        text = choice.get("text")
    return text if isinstance(text, str) else ""
