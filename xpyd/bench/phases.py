"""Where each request's time went, against the client's own times (``xpyd.api.phases``).

An xpyd proxy with ``--expose-worker-timing`` ends each stream (a JSON answer: in its ``X-Xpyd-Timing`` header)
with the phases each side measured on its own clock: the proxy's (ingress, its first-token call, egress;
several choices' wait for the others, a JSON answer's for its last token), the first token's worker's (prefill,
or a colocated worker: parse, queue, compute, respond) and decode's (parse, wait, transfer, queue, step,
respond; a colocated worker's first decode step: queue, step, respond). Per request:

- the TTFT split, in the order it passed (``TTFT_PHASES`` for a streamed P/D answer): proxy ingress, the
  worker's parse/queue/compute/[rest]/respond, network (the proxy's call less the worker's own time),
  [proxy choices], [proxy rest], proxy egress; their sum is the proxy's TTFT, exactly;
- ``client/other`` = the client's TTFT (first content chunk - send; a JSON answer: its arrival - send) - that
  sum: the hop between the client and the proxy and the client's own reading, the one part no server measured;
- decode's phases (its time to token 2, which ran alongside the TTFT; colocated: its first decode step), next
  to the client's first gap (token 1 -> token 2; none for a JSON answer).

Over a run: each phase's distribution, the sum's and the client's TTFT, and ``sum_p50 / client_ttft_p50``
(the goal: within 2%). Completed requests only; those without a full split are counted as ``missing``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from xpyd.api.phases import DECODE_PHASES, STEP_PHASES, TTFT_PHASES, ttft_split
from xpyd.api.timing import WorkerTiming
from xpyd.bench.client import RequestResult
from xpyd.bench.metrics import Distribution

_US = 1e-6
TTFT_KEYS = tuple(f"{side}.{phase}" for side, phase in TTFT_PHASES)


@dataclass(frozen=True, slots=True)
class RequestPhases:
    """One completed request's split, in seconds."""

    client_ttft_s: float
    ttft_s: dict[str, float]  # side.phase (TTFT_KEYS, streamed P/D) -> seconds; they add up to the proxy's TTFT
    decode_s: dict[str, float] | None  # DECODE_PHASES (colocated: STEP_PHASES) -> seconds (None: not said)
    client_first_gap_s: float | None  # token 1 -> token 2 at the client (None: one chunk only)

    @property
    def sum_s(self) -> float:
        return sum(self.ttft_s.values())

    @property
    def other_s(self) -> float:
        """The client's TTFT less what the servers measured (may be slightly negative: clock rates)."""
        return self.client_ttft_s - self.sum_s

    @classmethod
    def of(cls, r: RequestResult) -> RequestPhases | None:
        t = r.worker_timing
        if t is None or not r.ok or not r.chunk_times:
            return None
        split = ttft_split(t.prefill if t.prefill is not None else t.colocated, t.proxy)
        if split is None:
            return None
        decode = _token_two(t)
        gap = r.chunk_times[1] - r.chunk_times[0] if len(r.chunk_times) > 1 else None
        return cls(r.chunk_times[0] - r.send_time, {k: v * _US for k, v in split.items()}, decode, gap)

    def as_dict(self) -> dict:
        ms = 1000.0
        return {"ttft_ms": {k: v * ms for k, v in self.ttft_s.items()}, "sum_ms": self.sum_s * ms,
                "client_ttft_ms": self.client_ttft_s * ms, "client_other_ms": self.other_s * ms,
                "decode_ms": None if self.decode_s is None else {k: v * ms for k, v in self.decode_s.items()},
                "client_first_gap_ms": None if self.client_first_gap_s is None else self.client_first_gap_s * ms}


def _token_two(t: WorkerTiming) -> dict[str, float] | None:
    """Decode's phases to token 2 (P/D), or a colocated worker's first decode step, in seconds."""
    if t.decode is not None:
        return {p: getattr(t.decode, f"{p}_us") * _US for p in DECODE_PHASES}
    step = t.colocated.step if t.colocated is not None else None
    return None if step is None else {p: getattr(step, f"{p}_us") * _US for p in STEP_PHASES}


def _keys(dicts: Iterable[dict]) -> list[str]:
    """Every key, in the order first seen (one run's requests all have the same ones)."""
    return list({k: None for d in dicts for k in d})


@dataclass(frozen=True, slots=True)
class PhaseSummary:
    requests: int  # completed with a full split
    missing: int  # completed without one
    ttft: dict[str, Distribution]  # per TTFT phase (side.phase)
    sum: Distribution  # the phases' sum per request (the proxy's TTFT)
    client_ttft: Distribution
    other: Distribution  # client/other per request
    decode: dict[str, Distribution]  # per decode phase (requests whose decode worker said them; colocated: its
    # first decode step's)
    client_first_gap: Distribution

    @property
    def sum_over_client_p50(self) -> float | None:
        s, c = self.sum.p50, self.client_ttft.p50
        return s / c if s is not None and c else None


def summarize_phases(results: Iterable[RequestResult]) -> PhaseSummary | None:
    """None when no request carried a full split (a server that does not send one)."""
    done = [r for r in results if r.ok and r.chunk_times]
    each = [p for p in map(RequestPhases.of, done) if p is not None]
    if not each:
        return None
    decoded = [p.decode_s for p in each if p.decode_s is not None]
    return PhaseSummary(
        requests=len(each),
        missing=len(done) - len(each),
        ttft={k: Distribution.of_seconds([p.ttft_s[k] for p in each if k in p.ttft_s])
              for k in _keys(p.ttft_s for p in each)},
        sum=Distribution.of_seconds([p.sum_s for p in each]),
        client_ttft=Distribution.of_seconds([p.client_ttft_s for p in each]),
        other=Distribution.of_seconds([p.other_s for p in each]),
        decode={k: Distribution.of_seconds([d[k] for d in decoded if k in d]) for k in _keys(decoded)},
        client_first_gap=Distribution.of_seconds([p.client_first_gap_s for p in each
                                                  if p.client_first_gap_s is not None]),
    )
