"""A worker's own view of one answer's timing, as it travels to the proxy and (opted in) to the client.

Asked for with the request header ``X-Xpyd-Timing: 1`` (the proxy sends it only under
``--expose-worker-timing``). A worker that was asked answers with ``WorkerTiming``:

    streamed answer   an SSE comment just before ``data: [DONE]``:   ``: xpyd-timing {json}`` + blank line
                      (SSE clients skip comments; the OpenAI client does)
    JSON answer       the response header ``X-Xpyd-Timing: {json}`` (prefill's first token: its TTFT; a
                      colocated worker's answer: its time to the answer); a proxy under
                      ``--expose-worker-timing`` answers a JSON request the same way (no gaps: the client
                      saw none), with each side's phases of the time to the answer

``ttft_us``: the request's arrival at the worker's HTTP handler -> the first content chunk written (or the JSON
answer built); None where the worker did not write the client's first token. ``gaps_us``: the gaps between
successive content chunks it wrote (chunks with text, as ``xpyd bench`` counts them), the first ``MAX_GAPS``
of them; ``gaps``: how many there were in all (an answer longer than MAX_GAPS + 1 chunks keeps only its
first gaps, so a line stays under ~40 KB). Microseconds, integers.

Through a P/D proxy the client gets one line per answer: prefill's TTFT (it wrote the first token) and
decode's gaps (tokens 2..n, so one gap fewer than the client saw: the first, token 1 -> 2, is nobody's).

Where the time went (version 2; ``xpyd.api.phases``): a prefill worker adds ``prefill``, its TTFT split into
parse, queue, compute and respond; a decode worker ``decode``, its time to its first chunk split into parse,
wait, transfer, queue, step and respond; the proxy ``proxy``, its own ingress, prefill call, network (the
call less prefill's own time) and egress, which add up to the TTFT it served. Version 3: a colocated worker's
``colocated`` (parse, queue, compute, [rest], respond, and a stream's first decode step), the proxy's ``choices``
and ``rest`` (several choices; a JSON answer). Earlier lines still read.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from xpyd.api.phases import MAX_US, ColocatedPhases, DecodePhases, Micros, PrefillPhases, ProxyPhases

TIMING_HEADER = "X-Xpyd-Timing"
ASK = "1"  # the request header's value that asks for timing
COMMENT_PREFIX = b": xpyd-timing "
VERSION = 3
MAX_GAPS = 4096


class WorkerTiming(msgspec.Struct, frozen=True, kw_only=True):
    v: Annotated[int, msgspec.Meta(ge=1)] = VERSION
    ttft_us: Micros | None = None
    gaps_us: Annotated[tuple[Micros, ...], msgspec.Meta(max_length=MAX_GAPS)] = ()
    gaps: Annotated[int, msgspec.Meta(ge=0, le=MAX_US)] = 0
    prefill: PrefillPhases | None = None  # the prefill worker's answer, split (v2)
    decode: DecodePhases | None = None  # the decode worker's time to its first chunk, split (v2)
    proxy: ProxyPhases | None = None  # the proxy's TTFT, split (v2)
    # a colocated worker's time to its first chunk or answer, split (v3); a decode worker's to the first token of a
    # prompt it prefilled itself (xpyd.api.local_prefill), split the same way
    colocated: ColocatedPhases | None = None

    def __post_init__(self) -> None:
        if self.gaps < len(self.gaps_us):
            raise ValueError("gaps counts every gap: it cannot be fewer than gaps_us")

    def to_json(self) -> bytes:
        """Its JSON, without the phases no side said (null)."""
        return _ENCODER.encode({k: v for k, v in msgspec.structs.asdict(self).items() if v is not None})

    def header(self) -> str:
        """``X-Xpyd-Timing``'s value on a JSON answer (its JSON: ASCII, one line)."""
        return self.to_json().decode()

    def comment(self) -> bytes:
        """The SSE comment block that carries it."""
        return COMMENT_PREFIX + self.to_json() + b"\n\n"


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(WorkerTiming)


def decode_timing(data: bytes | str) -> WorkerTiming:
    """The JSON of a ``WorkerTiming``; ValueError if it is not one (msgspec.ValidationError is one)."""
    try:
        return _DECODER.decode(data)
    except msgspec.DecodeError as e:
        raise ValueError(f"not a worker timing: {e}") from None


def comment_payload(line: bytes) -> bytes | None:
    """A comment line's payload if it is a timing comment (``: xpyd-timing {json}``, line end stripped), else None."""
    return line[len(COMMENT_PREFIX):] if line.startswith(COMMENT_PREFIX) else None


def timing_of_comment(line: bytes) -> WorkerTiming | None:
    """The timing a comment line carries; None if it is another comment. ValueError if it is broken."""
    payload = comment_payload(line.rstrip(b"\r\n"))
    return None if payload is None else decode_timing(payload)
