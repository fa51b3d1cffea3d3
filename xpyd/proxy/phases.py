"""The proxy's part of a streamed answer's TTFT (``xpyd.api.phases``), on its own monotonic clock::

    received (the request's handler started) -> the prefill call started -> prefill's answer read
    -> the first token's chunk written to the client's connection (``RequestTimer.written``)

``network`` is the prefill call less the prefill worker's own time (when it said it: ``--expose-worker-timing``),
the remainder neither side measured.
"""

from __future__ import annotations

from xpyd.api.phases import ProxyPhases, spans_us
from xpyd.proxy.worker_api import FirstToken


def proxy_phases(received: float, first: FirstToken, written: float) -> ProxyPhases | None:
    """None when the prefill call was not timed (``FirstToken.span``)."""
    if first.span is None:
        return None
    ingress, call, egress = spans_us(received, *first.span, written)
    own = first.timing.prefill if first.timing is not None else None
    return ProxyPhases(ingress_us=ingress, prefill_call_us=call, egress_us=egress,
                       network_us=None if own is None else call - own.total_us)
