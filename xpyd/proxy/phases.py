"""The proxy's part of an answer's TTFT (``xpyd.api.phases``), on its own monotonic clock::

    received (the request's handler started) -> the first-token call started -> its answer read
    [-> the other choices' first tokens read]   several choices
    [-> the answer's last token read]           a JSON answer
    -> the first token's chunk handed to the client's connection, or the JSON answer built (``written``)

``written`` is stamped before the chunk is written, never after: the proxy's interval then lies inside the
client's (sent -> first chunk read) however the scheduler delays the proxy between its write and its stamp.

The first-token call is prefill's (or, colocated, the worker's call up to its first chunk with text; a prompt its
decode worker prefilled itself, the decode call up to its first token's chunk: ``with_local``).
``network`` is that call less the worker's own time (when it said it: ``--expose-worker-timing``), the remainder
neither side measured. ``joined`` is what a JSON answer, or one of several choices, tells the client: each
side's phases, without the gaps between chunks (the client saw none of them, or an interleaving of several).
"""

from __future__ import annotations

import msgspec

from xpyd.api.phases import ColocatedPhases, ProxyPhases, spans_us
from xpyd.api.timing import WorkerTiming
from xpyd.proxy.worker_api import FirstToken


def split(received: float, span: tuple[float, float], written: float, own_us: int | None,
          choices: float | None = None, rest: float | None = None) -> ProxyPhases:
    """``span``: the first-token call (started, answer read); ``own_us``: the worker's own time in it (None: not
    said); ``choices``, ``rest``: when the other choices' first tokens, and the answer's last token, were read."""
    marks = [m for m in (choices, rest) if m is not None]
    ingress, call, *waits, egress = spans_us(received, *span, *marks, written)
    named = dict(zip([n for n, m in (("choices_us", choices), ("rest_us", rest)) if m is not None], waits))
    return ProxyPhases(ingress_us=ingress, prefill_call_us=call, egress_us=egress,
                       network_us=None if own_us is None else call - own_us, **named)


def proxy_phases(received: float, first: FirstToken, written: float, choices: float | None = None,
                 rest: float | None = None) -> ProxyPhases | None:
    """A P/D answer's; None when the prefill call was not timed (``FirstToken.span``)."""
    if first.span is None:
        return None
    own = first.timing.prefill if first.timing is not None else None
    return split(received, first.span, written, None if own is None else own.total_us, choices, rest)


def colocated_own_us(timing: WorkerTiming | None) -> int | None:
    """A colocated worker's own time to its first chunk or answer, as its timing says it (None: not said)."""
    phases: ColocatedPhases | None = timing.colocated if timing is not None else None
    return None if phases is None else phases.total_us


def with_local(first: FirstToken, decoded: WorkerTiming | None,
               proxy: ProxyPhases | None) -> tuple[ColocatedPhases | None, ProxyPhases | None]:
    """A prompt its decode worker prefilled itself (``first`` came from decode's stream, not a prefill answer):
    decode's own split of its first token (parse, queue, compute, respond: its timing comment's ``colocated``),
    and the proxy's phases with ``network`` = the call less that (known only once decode's stream ended);
    otherwise (None, ``proxy``) as they were."""
    if first.timing is not None or decoded is None or decoded.decode is not None or decoded.colocated is None:
        return None, proxy
    local = decoded.colocated
    if proxy is not None and proxy.network_us is None:
        proxy = msgspec.structs.replace(proxy, network_us=proxy.prefill_call_us - local.total_us)
    return local, proxy


def joined(first: FirstToken, decoded: WorkerTiming | None, proxy: ProxyPhases | None) -> WorkerTiming:
    """Each side's phases of a P/D answer (no TTFT and no gaps: see the module's docstring)."""
    prefill = first.timing.prefill if first.timing is not None else None
    local, proxy = with_local(first, decoded, proxy)
    return WorkerTiming(prefill=prefill, decode=decoded.decode if decoded is not None else None, proxy=proxy,
                        colocated=local)
