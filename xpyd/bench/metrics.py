"""Latency and throughput metrics from request timelines (pure functions, no I/O).

Definitions (client side, as in vLLM's ``benchmark_serving`` / ``vllm bench serve``):

- TTFT: first content chunk arrival - send time.
- ITL: every gap between consecutive content chunks. A chunk may carry more than one token, so ITL
  is per chunk, not per token.
- TPOT: (E2E - TTFT) / (output_tokens - 1), with output_tokens from ``usage.completion_tokens``
  (the number of content chunks when the server sends no usage); undefined for one-token outputs and for
  JSON answers (``--no-stream``: the first token arrives with the last, TTFT is the answer's arrival).
- E2E: end of the stream (``[DONE]``) - send time.
- Percentiles are ``numpy.percentile`` with its default method ("linear"), as ``vllm bench serve``
  computes them: the p-th percentile of sorted x[0..n-1] is x[k] + (x[k+1] - x[k]) * f with
  k + f = p/100 * (n-1). Mean and max are numpy's too.
- Throughputs divide by the wall duration of the run (first send to last response end).
- Failed requests are excluded from every latency and token count but counted as ``failed``.
- Goodput (vLLM's definition, from DistServe): completed requests per second that meet *every* given
  SLO, each inclusive (value <= SLO): TTFT, TPOT (a one-token request meets it), E2E, and - an
  xpyd addition - ITL, met when every ITL gap of the request is <= the SLO. With no SLO given every
  completed request is good (goodput = request throughput). Goodput in output tokens/s counts the
  output tokens of those good requests; SLO attainment is good / (completed + failed): a failed
  request misses every SLO.
- Prefix-cache hit rate: sum(cached_tokens) / sum(prompt_tokens) over the completed requests whose
  usage reports ``prompt_tokens_details.cached_tokens`` (as vLLM and OpenAI do); None ("n/a") when
  none of them does. Multi-turn runs also get it, with the TTFT distribution, per turn index.
- Per worker (when the server names the workers of each request, as an xpyd proxy does with
  ``--expose-worker-names``): the same metrics over the requests each worker served, per role, with the
  run's duration and SLO; a request served by prefill worker P and decode worker D counts under both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from xpyd.bench.client import RequestResult


def percentile(values: Sequence[float], p: float) -> float:
    """Linearly interpolated percentile (numpy's default method); ``values`` need not be sorted."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    return float(np.percentile(values, p))


@dataclass(frozen=True, slots=True)
class Distribution:
    """Mean and percentiles of a sample, in milliseconds; all None for an empty sample."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of_seconds(cls, values_s: Sequence[float]) -> Distribution:
        if not values_s:
            return cls(0, None, None, None, None, None)
        ms = np.asarray(values_s, dtype=np.float64) * 1000.0
        p50, p90, p99 = np.percentile(ms, [50, 90, 99]).tolist()
        return cls(int(ms.size), float(ms.mean()), p50, p90, p99, float(ms.max()))


_SLO_KEYS = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_s", "e2e": "e2e_s", "e2el": "e2e_s"}
_DURATION = re.compile(r"^([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(us|ms|s)?$")
_UNIT_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1e-3}  # a bare number is ms, like vLLM's --goodput


@dataclass(frozen=True, slots=True)
class SLO:
    """Service level objectives in seconds (None = not set)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"SLO {name[:-2]} must be > 0, got {v}")

    @classmethod
    def parse(cls, text: str) -> SLO:
        """``"ttft=500ms,itl=50ms,e2e=2s"``: keys ttft, tpot, itl, e2e (or e2el); units us, ms, s
        (a bare number is milliseconds). Empty text = no SLO."""
        values: dict[str, float] = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, sep, val = item.partition("=")
            key = key.strip().lower()
            if not sep or key not in _SLO_KEYS:
                raise ValueError(f"bad SLO item {item!r}: expected KEY=VALUE with KEY one of "
                                 f"ttft, tpot, itl, e2e (e.g. ttft=500ms,itl=50ms,e2e=2s)")
            m = _DURATION.match(val.strip().lower())
            if not m:
                raise ValueError(f"bad SLO value {val!r} for {key}: expected a number with unit us, ms "
                                 f"or s (e.g. 500ms, 2s)")
            attr = _SLO_KEYS[key]
            if attr in values:
                raise ValueError(f"SLO {key} given twice")
            values[attr] = float(m.group(1)) * _UNIT_S[m.group(2)]
        return cls(**values)

    @property
    def empty(self) -> bool:
        return all(v is None for v in (self.ttft_s, self.tpot_s, self.itl_s, self.e2e_s))

    def as_ms(self) -> dict[str, float]:
        return {k[:-2]: v * 1000.0 for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s")
                if (v := getattr(self, k)) is not None}

    def misses(self, lat: RequestLatency) -> list[str]:
        """The SLOs this completed request misses (empty: it is good)."""
        out = []
        if self.ttft_s is not None and lat.ttft_s > self.ttft_s:
            out.append("ttft")
        if self.tpot_s is not None and lat.tpot_s is not None and lat.tpot_s > self.tpot_s:
            out.append("tpot")
        if self.itl_s is not None and lat.itls_s and max(lat.itls_s) > self.itl_s:
            out.append("itl")
        if self.e2e_s is not None and lat.e2e_s > self.e2e_s:
            out.append("e2e")
        return out


@dataclass(frozen=True, slots=True)
class RequestLatency:
    """The latencies of one completed request, in seconds."""

    ttft_s: float
    tpot_s: float | None  # None for a single output token
    itls_s: tuple[float, ...]
    e2e_s: float
    output_tokens: int
    usage_missing: bool  # output_tokens is the chunk count, the server sent no usage

    @classmethod
    def of(cls, r: RequestResult) -> RequestLatency:
        if not r.ok or not r.chunk_times:
            raise ValueError("latencies exist only for completed requests with content")
        ttft = r.chunk_times[0] - r.send_time
        e2e = r.end_time - r.send_time
        itls = tuple(b - a for a, b in zip(r.chunk_times, r.chunk_times[1:]))
        missing = r.output_tokens is None
        tokens = len(r.chunk_times) if missing else r.output_tokens
        tpot = (e2e - ttft) / (tokens - 1) if tokens > 1 and r.streamed else None
        return cls(ttft, tpot, itls, e2e, tokens, missing)


@dataclass(frozen=True, slots=True)
class CacheHits:
    """Prefix-cache reuse as the server reports it, over the completed requests that report it."""

    requests: int  # completed requests whose usage had cached_tokens (and prompt_tokens)
    prompt_tokens: int  # their prompt tokens
    cached_tokens: int  # of those, the tokens the server found in its prefix cache

    @classmethod
    def of(cls, results: Iterable[RequestResult]) -> CacheHits:
        rs = [r for r in results if r.ok and r.cached_tokens is not None and r.prompt_tokens is not None]
        return cls(len(rs), sum(r.prompt_tokens for r in rs), sum(r.cached_tokens for r in rs))

    @property
    def hit_rate(self) -> float | None:
        """None when no request reported cached tokens (the server does not say)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


@dataclass(frozen=True, slots=True)
class Summary:
    """The metrics of one group of requests over a run of ``duration_s`` seconds."""

    completed: int
    failed: int
    duration_s: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    requests_per_s: float
    output_tokens_per_s: float
    goodput_requests_per_s: float  # without an SLO every completed request is good
    goodput_output_tokens_per_s: float  # the output tokens of the good requests, per second
    good: int
    slo_misses: dict[str, int]  # completed requests missing each SLO
    errors: dict[str, int]  # failed requests by error kind
    total_output_tokens: int
    total_prompt_tokens: int
    usage_missing: int  # completed requests whose stream had no usage chunk
    cache: CacheHits
    error_samples: list[str] = field(default_factory=list)

    @property
    def slo_attainment(self) -> float | None:
        """The share of the requests sent that met every SLO (failed ones did not); None for none."""
        sent = self.completed + self.failed
        return self.good / sent if sent else None


def summarize(results: Iterable[RequestResult], duration_s: float, slo: SLO | None = None) -> Summary:
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    results = list(results)
    done = [RequestLatency.of(r) for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    errors: dict[str, int] = {}
    for r in failed:
        errors[r.error] = errors.get(r.error, 0) + 1
    samples = list(dict.fromkeys(f"{r.error}: {r.error_detail}" for r in failed))[:5]
    slo = slo or SLO()
    misses = {k: 0 for k in slo.as_ms()}
    good = good_tokens = 0
    for lat in done:
        missed = slo.misses(lat)
        good += not missed
        good_tokens += 0 if missed else lat.output_tokens
        for k in missed:
            misses[k] += 1
    out_tokens = sum(lat.output_tokens for lat in done)
    return Summary(
        completed=len(done),
        failed=len(failed),
        duration_s=duration_s,
        ttft=Distribution.of_seconds([lat.ttft_s for lat in done]),
        tpot=Distribution.of_seconds([lat.tpot_s for lat in done if lat.tpot_s is not None]),
        itl=Distribution.of_seconds([g for lat in done for g in lat.itls_s]),
        e2e=Distribution.of_seconds([lat.e2e_s for lat in done]),
        requests_per_s=len(done) / duration_s,
        output_tokens_per_s=out_tokens / duration_s,
        goodput_requests_per_s=good / duration_s,
        goodput_output_tokens_per_s=good_tokens / duration_s,
        good=good,
        slo_misses=misses,
        errors=errors,
        total_output_tokens=out_tokens,
        total_prompt_tokens=sum(r.prompt_tokens or 0 for r in results if r.ok),
        usage_missing=sum(lat.usage_missing for lat in done),
        cache=CacheHits.of(results),
        error_samples=samples,
    )


@dataclass(frozen=True, slots=True)
class TurnStats:
    """The requests of one turn index across the conversations of a multi-turn run."""

    turn: int
    completed: int
    failed: int
    ttft: Distribution
    cache: CacheHits


@dataclass(frozen=True, slots=True)
class TurnSummary:
    turns: list[TurnStats]  # by turn index, 1 first
    first: CacheHits  # turn 1 (the context is new unless shared)
    later: CacheHits  # turns 2.. (the history so far should be cached)
    not_sent: int  # turns never sent: a failed turn ends its conversation; --duration


def summarize_turns(results: Iterable[RequestResult], expected: int) -> TurnSummary:
    """Per turn index: completed, failed, TTFT and prefix-cache hits; ``expected`` = turns planned."""
    results = [r for r in results if r.turn is not None]
    stats = []
    for turn in sorted({r.turn for r in results}):
        rs = [r for r in results if r.turn == turn]
        done = [r for r in rs if r.ok]
        stats.append(TurnStats(turn, len(done), len(rs) - len(done),
                               Distribution.of_seconds([RequestLatency.of(r).ttft_s for r in done]),
                               CacheHits.of(done)))
    return TurnSummary(stats, CacheHits.of(r for r in results if r.turn == 1),
                       CacheHits.of(r for r in results if r.turn > 1), max(expected - len(results), 0))


@dataclass(frozen=True, slots=True)
class WorkerSummaries:
    """Per worker, from the names an xpyd proxy gives with ``--expose-worker-names`` (``RequestResult.workers``):
    for each role (prefill, decode, colocated) each worker's requests, summarized over the whole run's duration
    with the run's SLO. A request counts once under each of its workers (once per role)."""

    roles: dict[str, dict[str, Summary]]  # role -> worker name -> its requests' summary; names sorted
    unattributed: int  # requests the server named no worker for (e.g. refused before any response)


def summarize_workers(results: Iterable[RequestResult], duration_s: float,
                      slo: SLO | None = None) -> WorkerSummaries | None:
    """None when no request was named any worker (a server that does not say, e.g. vLLM)."""
    results = list(results)
    if not any(r.workers for r in results):
        return None
    groups: dict[str, dict[str, list[RequestResult]]] = {}
    for r in results:
        for role, name in (r.workers or {}).items():
            groups.setdefault(role, {}).setdefault(name, []).append(r)
    roles = {role: {name: summarize(rs, duration_s, slo) for name, rs in sorted(by_name.items())}
             for role, by_name in sorted(groups.items(), key=lambda kv: _ROLE_ORDER.get(kv[0], len(_ROLE_ORDER)))}
    return WorkerSummaries(roles, sum(not r.workers for r in results))


_ROLE_ORDER = {"prefill": 0, "decode": 1, "colocated": 2}
