"""Which workers served a request, from the proxy's ``--log-requests`` lines (clients see only the public id)."""

from __future__ import annotations

import re
from collections import defaultdict

from xpyd.signal.request_id import RequestId, parse_request_id

# "<response id> -> <the workers' request id> (prefill URL, decode URL)", once per dispatch (retries too)
_LINE = re.compile(r"\s(?P<public>\S+) -> (?P<internal>xpyd-\S+) \(prefill \S+, decode \S+\)$", re.M)


def dispatches(log_text: str) -> dict[str, list[RequestId]]:
    """Response id -> the request ids it was dispatched as, in order (a retry adds one)."""
    out: dict[str, list[RequestId]] = defaultdict(list)
    for m in _LINE.finditer(log_text):
        out[m["public"]].append(parse_request_id(m["internal"]))
    return dict(out)


def involves(ids: list[RequestId], signal_addr: str) -> bool:
    """Did any dispatch of the request go to the worker with this signal address?"""
    return any(signal_addr in (rid.prefill_addr, rid.decode_addr) for rid in ids)
