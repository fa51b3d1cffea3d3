"""What one interval of a running cluster looked like, from two scrapes of its Prometheus metrics.

A ``Scrape`` is the samples of one moment: the proxy's ``/metrics`` and, optionally, the workers' (each text
under its source's name, so a worker that comes or goes between two scrapes does not turn a counter's sum
negative). ``observe(before, after)`` turns two scrapes into an ``Interval``:

- arrivals/s: the requests that ended (``xpyd_proxy_requests_total``, every outcome) plus the change in the
  requests in flight (``xpyd_requests_in_flight``), over the seconds between the scrapes;
- mean prompt and output tokens: from the workers' ``vllm:request_prompt_tokens`` and
  ``vllm:request_generation_tokens`` histograms (each request is counted once across a P/D pair), else the
  given defaults (``lengths_measured`` says which);
- TTFT and ITL quantiles: from the proxy's histograms' bucket deltas, interpolated within a bucket as
  Prometheus' ``histogram_quantile`` does; None when nothing was observed;
- each phase's p90 (``xpyd_proxy_phase_seconds``), the requests in flight and waiting for a decode slot now.

A counter that went down (its process restarted) counts from zero.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Interval", "Lengths", "Scrape", "histogram_quantile", "observe"]

Labels = tuple[tuple[str, str], ...]
Series = tuple[str, str, Labels]  # (source, sample name, sorted labels)

PROXY = "proxy"  # the source name of the proxy's text
REQUESTS = "xpyd_proxy_requests_total"
IN_FLIGHT = "xpyd_requests_in_flight"
QUEUE = "xpyd_proxy_queue_waiting"
TTFT = "xpyd_proxy_time_to_first_token_seconds"
ITL = "xpyd_proxy_inter_token_latency_seconds"
PHASE = "xpyd_proxy_phase_seconds"
PROMPT_TOKENS = "vllm:request_prompt_tokens"
OUTPUT_TOKENS = "vllm:request_generation_tokens"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"


@dataclass(frozen=True, slots=True)
class Lengths:
    """Mean prompt and output tokens of a request."""

    input_tokens: float = 1024.0
    output_tokens: float = 128.0

    def __post_init__(self) -> None:
        for name in ("input_tokens", "output_tokens"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 1):
                raise ValueError(f"mean {name.replace('_', ' ')} must be a number >= 1, got {v!r}")


@dataclass(frozen=True, slots=True)
class Scrape:
    at_s: float  # when it was taken (a monotonic clock)
    samples: Mapping[Series, float]

    @classmethod
    def parse(cls, at_s: float, texts: Mapping[str, str]) -> Scrape:
        """``texts``: source name -> its Prometheus text (the proxy's under ``"proxy"``); ValueError naming the
        source for text that is not the exposition format."""
        samples: dict[Series, float] = {}
        for source, text in texts.items():
            try:
                for family in text_string_to_metric_families(text):
                    for s in family.samples:
                        samples[(source, s.name, tuple(sorted(s.labels.items())))] = float(s.value)
            except (ValueError, TypeError, IndexError) as e:
                raise ValueError(f"metrics of {source} are not Prometheus text: {e}") from None
        return cls(at_s, MappingProxyType(samples))

    def busy(self, source: str) -> float | None:
        """The requests ``source`` (a worker) holds: running + waiting (vLLM's gauges); None if it was not
        scraped."""
        if not any(src == source for src, _, _ in self.samples):
            return None
        return self.total(RUNNING, source) + self.total(WAITING, source)

    def total(self, name: str, source: str | None = None, **labels: str) -> float:
        """The sum of ``name``'s samples (of ``source`` only, if given) whose labels include ``labels``."""
        return sum(v for (src, n, ls), v in self.samples.items()
                   if n == name and (source is None or src == source) and _has(ls, labels))


@dataclass(frozen=True, slots=True)
class Interval:
    start_s: float
    duration_s: float
    arrivals_per_s: float
    ended: int  # requests that ended in the interval, every outcome
    ended_ok: int
    mean_input_tokens: float
    mean_output_tokens: float
    lengths_measured: bool  # False: the lengths are the defaults (no worker metrics, or no request ended)
    ttft_p50_s: float | None  # None: no first token in the interval
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p90_s: float | None
    in_flight: int  # at the end of the interval
    queue_waiting: int  # ... waiting for room on a decode worker
    phase_p90_s: tuple[tuple[str, float], ...] = ()  # (phase, p90) of the phases observed

    def __post_init__(self) -> None:
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ValueError(f"an interval lasts > 0 s, got {self.duration_s!r}")
        if not (math.isfinite(self.arrivals_per_s) and self.arrivals_per_s >= 0):
            raise ValueError(f"arrivals/s must be >= 0, got {self.arrivals_per_s!r}")
        for name in ("ended", "ended_ok", "in_flight", "queue_waiting"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', ' ')} must be >= 0, got {getattr(self, name)}")
        Lengths(self.mean_input_tokens, self.mean_output_tokens)
        for name in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p90_s"):
            v = getattr(self, name)
            if v is not None and not (v >= 0):
                raise ValueError(f"{name[:-2]} must be >= 0 s or None, got {v!r}")


def observe(before: Scrape, after: Scrape, defaults: Lengths = Lengths()) -> Interval:
    duration = after.at_s - before.at_s
    if not duration > 0:
        raise ValueError(f"the second scrape must be later than the first ({before.at_s} -> {after.at_s})")
    d = _deltas(before, after)
    ended = round(_sum(d, REQUESTS, PROXY))
    ended_ok = round(_sum(d, REQUESTS, PROXY, outcome="ok"))
    in_flight = round(after.total(IN_FLIGHT, PROXY))
    arrivals = max(0.0, ended + in_flight - before.total(IN_FLIGHT, PROXY))
    prompts = _sum(d, PROMPT_TOKENS + "_count")
    outputs = _sum(d, OUTPUT_TOKENS + "_count")
    measured = prompts > 0 and outputs > 0
    lengths = (Lengths(max(1.0, _sum(d, PROMPT_TOKENS + "_sum") / prompts),
                       max(1.0, _sum(d, OUTPUT_TOKENS + "_sum") / outputs)) if measured else defaults)
    ttft, itl = _buckets(d, TTFT), _buckets(d, ITL)
    phases = sorted({dict(ls).get("phase", "") for (src, n, ls) in d if n == PHASE + "_bucket" and src == PROXY})
    phase_p90 = tuple((p, q) for p in phases if (q := histogram_quantile(0.9, _buckets(d, PHASE, phase=p)))
                      is not None)
    return Interval(before.at_s, duration, arrivals / duration, ended, ended_ok, lengths.input_tokens,
                    lengths.output_tokens, measured, histogram_quantile(0.5, ttft), histogram_quantile(0.9, ttft),
                    histogram_quantile(0.99, ttft), histogram_quantile(0.5, itl), histogram_quantile(0.9, itl),
                    in_flight, round(after.total(QUEUE, PROXY)), phase_p90)


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The ``q`` quantile of a histogram's cumulative bucket counts (upper bound -> count, +Inf included):
    linear within the bucket it falls in, the last finite bound if it falls in +Inf; None with no counts."""
    if not 0 <= q <= 1:
        raise ValueError(f"a quantile is in [0, 1], got {q}")
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for b in bounds:
        count = buckets[b]
        if count >= rank and count > below:
            if math.isinf(b):
                return lower
            return lower + (b - lower) * (rank - below) / (count - below)
        lower, below = (b if not math.isinf(b) else lower), count
    return lower


def _deltas(before: Scrape, after: Scrape) -> dict[Series, float]:
    """Each series of ``after`` less its value in ``before`` (all of it when new or reset)."""
    out = {}
    for key, v in after.samples.items():
        prev = before.samples.get(key, 0.0)
        out[key] = v - prev if v >= prev else v
    return out


def _sum(deltas: Mapping[Series, float], name: str, source: str | None = None, **labels: str) -> float:
    return sum(v for (src, n, ls), v in deltas.items()
               if n == name and (source is None or src == source) and _has(ls, labels))


def _buckets(deltas: Mapping[Series, float], name: str, **labels: str) -> dict[float, float]:
    """A histogram's bucket deltas summed by upper bound over its series (of the proxy)."""
    out: dict[float, float] = {}
    for (src, n, ls), v in deltas.items():
        if n == name + "_bucket" and src == PROXY and _has(ls, labels):
            le = float(dict(ls)["le"])
            out[le] = out.get(le, 0.0) + v
    return out


def _has(labels: Labels, want: Mapping[str, str]) -> bool:
    have = dict(labels)
    return all(have.get(k) == v for k, v in want.items())
