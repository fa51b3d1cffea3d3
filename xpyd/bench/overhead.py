"""What the proxy adds, per request and over a run: the client's times against the workers' own, same requests.

An xpyd proxy with ``--expose-worker-timing`` ends each stream with the workers' own timing
(``xpyd.api.timing.WorkerTiming``, in ``RequestResult.worker_timing``): the TTFT of the worker that wrote the
first content chunk (from its HTTP handler's start to writing the chunk) and the gaps between the content
chunks the decode (or colocated) worker wrote. Against the client's timeline of the same request:

- proxy-added TTFT = client TTFT - worker TTFT: everything outside the worker (the proxy's own work, both
  hops, the client's event loop). Never negative: the worker's interval lies inside the client's.
- ITL: the worker's gaps against the client's gaps between the same chunks. The worker's gaps are the last
  ``gaps`` of the client's (P/D: the client's first gap, token 1 from prefill -> token 2 from decode, is no
  worker's; colocated: they are all of them); a worker keeps at most ``MAX_GAPS`` of its gaps, the first
  ones, and the client's are matched to those. A request whose client saw fewer gaps than its worker
  reports (chunks lost or split on the way) is counted as ``misaligned`` and its gaps are left out.
- ``itl_p99_ratio`` = client ITL p99 / worker ITL p99 over those matched gaps (the goal: <= 1.1).

Completed requests only; those without a timing are counted as ``missing``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from xpyd.bench.client import RequestResult
from xpyd.bench.metrics import Distribution

_US = 1e-6


@dataclass(frozen=True, slots=True)
class RequestOverhead:
    """One completed request's times against its workers' own, in seconds."""

    client_ttft_s: float
    worker_ttft_s: float | None  # None: the worker that wrote the first chunk did not say
    worker_gaps_s: tuple[float, ...]
    client_gaps_s: tuple[float, ...]  # the client's gaps between the same chunks (empty if misaligned)
    misaligned: bool

    @property
    def proxy_ttft_s(self) -> float | None:
        return None if self.worker_ttft_s is None else self.client_ttft_s - self.worker_ttft_s

    @classmethod
    def of(cls, r: RequestResult) -> RequestOverhead | None:
        """None for a request that failed, has no content, or carries no workers' timing."""
        t = r.worker_timing
        if t is None or not r.ok or not r.chunk_times:
            return None
        client_gaps = [b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])]
        offset = len(client_gaps) - t.gaps
        worker = tuple(g * _US for g in t.gaps_us)
        misaligned = offset < 0
        matched = () if misaligned else tuple(client_gaps[offset:offset + len(worker)])
        return cls(r.chunk_times[0] - r.send_time, None if t.ttft_us is None else t.ttft_us * _US,
                   () if misaligned else worker, matched, misaligned)

    def as_dict(self) -> dict:
        ms = 1000.0
        return {"worker_ttft_ms": None if self.worker_ttft_s is None else self.worker_ttft_s * ms,
                "proxy_ttft_ms": None if self.proxy_ttft_s is None else self.proxy_ttft_s * ms,
                "worker_itl_ms": [g * ms for g in self.worker_gaps_s],
                "client_itl_ms": [g * ms for g in self.client_gaps_s],
                "misaligned": self.misaligned}


@dataclass(frozen=True, slots=True)
class Overhead:
    """Over the completed requests that carried their workers' timing."""

    requests: int  # completed with a timing
    missing: int  # completed without one
    misaligned: int  # of ``requests``: gaps left out (see the module's docstring)
    worker_ttft: Distribution
    proxy_ttft: Distribution  # client TTFT - worker TTFT, per request
    worker_itl: Distribution
    client_itl: Distribution  # the client's gaps between the same chunks as worker_itl's

    @property
    def itl_p99_ratio(self) -> float | None:
        w, c = self.worker_itl.p99, self.client_itl.p99
        return c / w if w and c is not None else None

    @property
    def itl_p50_ratio(self) -> float | None:
        w, c = self.worker_itl.p50, self.client_itl.p50
        return c / w if w and c is not None else None


def summarize_overhead(results: Iterable[RequestResult]) -> Overhead | None:
    """None when no request carried its workers' timing (a server that does not send it)."""
    done = [r for r in results if r.ok and r.chunk_times]
    each = [o for o in map(RequestOverhead.of, done) if o is not None]
    if not each:
        return None
    return Overhead(
        requests=len(each),
        missing=len(done) - len(each),
        misaligned=sum(o.misaligned for o in each),
        worker_ttft=Distribution.of_seconds([o.worker_ttft_s for o in each if o.worker_ttft_s is not None]),
        proxy_ttft=Distribution.of_seconds([o.proxy_ttft_s for o in each if o.proxy_ttft_s is not None]),
        worker_itl=Distribution.of_seconds([g for o in each for g in o.worker_gaps_s]),
        client_itl=Distribution.of_seconds([g for o in each for g in o.client_gaps_s]),
    )
