"""The proxy's Prometheus metrics, served as text at ``GET /metrics``: requests as the client sees them.

=========================================  =========  ================================================
name                                       type       labels / meaning
=========================================  =========  ================================================
xpyd_proxy_requests_total                  counter    endpoint, outcome (see ``Outcome``)
xpyd_proxy_time_to_first_token_seconds     histogram  request received -> first token ready to send
xpyd_proxy_inter_token_latency_seconds     histogram  between two chunks of one response
xpyd_proxy_e2e_request_latency_seconds     histogram  request received -> last token (ok requests)
xpyd_proxy_phase_seconds                   histogram  phase=ingress|prefill_call|network|choices|rest|egress:
                                                      an answer's time to its first token here (a JSON
                                                      answer: to the answer), split (``xpyd.proxy.phases``;
                                                      network only with --expose-worker-timing, choices
                                                      with several, rest for a JSON answer)
xpyd_requests_in_flight                    gauge      role="proxy": requests being served
xpyd_proxy_workers                         gauge      role, health=up|down: workers the proxy knows
xpyd_proxy_queue_waiting                   gauge      requests waiting for room on a decode worker
xpyd_proxy_pair_failures_total             counter    requests that failed between their two workers
                                                      (the pair is then avoided: ``pairs.PairHealth``)
xpyd_proxy_routing_seconds                 histogram  picking a request's pair and starting its calls
                                                      (sub-millisecond buckets: ``ROUTING_BUCKETS``)
xpyd_etcd_operations_total                 counter    role="proxy", op: the etcd registry's calls and
                                                      watch events (``xpyd.discovery.counts``)
=========================================  =========  ================================================

One ``ProxyMetrics`` per app, with its own registry. Everything runs on the
proxy's event loop; a ``RequestTimer`` follows one client request.
"""

from __future__ import annotations

import asyncio
import time
from enum import Enum

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from werkzeug.exceptions import HTTPException

from xpyd.api.openai import APIError
from xpyd.discovery.counts import EtcdOps
from xpyd.api.phases import PROXY_PHASES, ProxyPhases
from xpyd.histograms import INTER_TOKEN_BUCKETS, LATENCY_BUCKETS, PHASE_BUCKETS
from xpyd.proxy.phases import proxy_phases
from xpyd.proxy.upstream import UpstreamError
from xpyd.proxy.worker_api import FirstToken

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
# A pick takes microseconds to a millisecond (cache-aware with many workers): 1-2-5 steps from 5 us to 1 s.
ROUTING_BUCKETS = (5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.2,
                   0.5, 1.0)


class Outcome(str, Enum):
    OK = "ok"  # the whole response was sent
    CLIENT_ERROR = "client_error"  # 4xx: the request was invalid (refused by the proxy or a worker)
    UPSTREAM_ERROR = "upstream_error"  # a worker failed, timed out or was unreachable (5xx, or in-stream)
    UNAVAILABLE = "unavailable"  # 503 from the proxy itself: no worker of a role
    ABORTED = "aborted"  # the client went away first
    INTERNAL_ERROR = "internal_error"  # a bug in the proxy


def outcome_of(e: BaseException) -> Outcome:
    """What an exception that ended a request means for the request count."""
    if isinstance(e, UpstreamError):
        return Outcome.CLIENT_ERROR if e.status < 500 else Outcome.UPSTREAM_ERROR
    if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
        return Outcome.ABORTED
    if isinstance(e, APIError):
        status = e.status
    elif isinstance(e, HTTPException):
        status = e.code or 500
    else:
        return Outcome.INTERNAL_ERROR
    if status < 500:
        return Outcome.CLIENT_ERROR
    return Outcome.UNAVAILABLE if status == 503 else Outcome.INTERNAL_ERROR


class RequestTimer:
    """One client request: counted in flight until ``end`` (idempotent: the first outcome counts)."""

    __slots__ = ("_metrics", "_endpoint", "_start", "_last", "_ended", "phases", "decoded_at")

    def __init__(self, metrics: "ProxyMetrics", endpoint: str) -> None:
        self._metrics = metrics
        self._endpoint = endpoint
        self._start = self._last = time.monotonic()
        self._ended = False
        self.phases: ProxyPhases | None = None  # once the client's first token is written (or the answer built)
        self.decoded_at: float | None = None  # a JSON answer's last token read (``decoded``)
        metrics._in_flight.inc()

    @property
    def received(self) -> float:
        """When the request's handler started (``time.monotonic``)."""
        return self._start

    def first_token(self) -> None:
        self._last = time.monotonic()
        self._metrics._ttft.observe(self._last - self._start)

    def written(self, first: FirstToken, choices: float | None = None) -> None:
        """The chunk of prefill's token ``first`` is handed to the client's connection (called just before it is
        written: xpyd.proxy.phases): the TTFT's phases here (once);
        ``choices``: when the other choices' first tokens were read (several choices)."""
        if self.phases is None:
            self.settle(proxy_phases(self._start, first, time.monotonic(), choices))

    def decoded(self) -> None:
        """A JSON answer's last token is read."""
        self.decoded_at = time.monotonic()

    def answered(self, first: FirstToken, choices: float | None = None, rest: float | None = None) -> None:
        """A JSON answer whose first token was prefill's ``first`` is built now: its phases here (once);
        ``rest``: when its last token was read (default: ``decoded``)."""
        if self.phases is None:
            now = time.monotonic()
            rest = rest if rest is not None else self.decoded_at if self.decoded_at is not None else now
            self.settle(proxy_phases(self._start, first, now, choices, rest))

    def settle(self, phases: ProxyPhases | None) -> None:
        """The answer's phases here, recorded once (None: not timed)."""
        if self.phases is None and phases is not None:
            self.phases = phases
            self._metrics.observe_phases(phases)

    def network_known(self, phases: ProxyPhases) -> None:
        """``phases`` = the recorded ones with ``network`` learned later (a prompt its decode worker prefilled: its
        own time came at the stream's end): that phase recorded now, once."""
        if self.phases is not None and self.phases.network_us is None and phases.network_us is not None:
            self.phases = phases
            self._metrics._phase["network"].observe(max(0, phases.network_us) / 1e6)

    def token(self) -> None:
        now = time.monotonic()
        self._metrics._itl.observe(now - self._last)
        self._last = now

    def end(self, outcome: Outcome) -> None:
        if self._ended:
            return
        outcome = Outcome(outcome)
        self._ended = True
        m = self._metrics
        m._in_flight.dec()
        m._requests[(self._endpoint, outcome)].inc()
        if outcome is Outcome.OK:
            m._e2e.observe(time.monotonic() - self._start)


class _EtcdCounts(Collector):
    def __init__(self, ops: EtcdOps) -> None:
        self._ops = ops

    def collect(self):
        family = CounterMetricFamily("xpyd_etcd_operations", "etcd operations (calls made and watch events "
                                     "received), by kind", labels=("role", "op"))
        for op, n in self._ops.snapshot().items():
            family.add_metric(("proxy", op), n)
        return [family]


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, etcd: EtcdOps | None = None) -> None:
        """``etcd``: the etcd registry's operation counts (none with static workers)."""
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        if etcd is not None:
            r.register(_EtcdCounts(etcd))
        requests = Counter("xpyd_proxy_requests", "Client requests that ended, by endpoint and outcome",
                           ("endpoint", "outcome"), registry=r)
        self._requests = {(e, o): requests.labels(e, o.value) for e in ENDPOINTS for o in Outcome}
        self._ttft = Histogram("xpyd_proxy_time_to_first_token_seconds",
                               "Request received to its first token ready for the client",
                               buckets=LATENCY_BUCKETS, registry=r)
        self._itl = Histogram("xpyd_proxy_inter_token_latency_seconds",
                              "Time between two chunks of one response", buckets=INTER_TOKEN_BUCKETS, registry=r)
        self._e2e = Histogram("xpyd_proxy_e2e_request_latency_seconds",
                              "Request received to its last token (successful requests)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self._in_flight = Gauge("xpyd_requests_in_flight", "Client requests the proxy is serving",
                                ("role",), registry=r).labels("proxy")
        self._workers = Gauge("xpyd_proxy_workers", "Workers the proxy knows, by role and health",
                              ("role", "health"), registry=r)
        self._queue = Gauge("xpyd_proxy_queue_waiting", "Requests waiting for room on a decode worker",
                            registry=r)
        self._pair_failures = Counter("xpyd_proxy_pair_failures", "Requests that failed on the path between "
                                      "their prefill and decode worker (the pair is avoided for a while)",
                                      registry=r)
        self._migrations = Counter("xpyd_proxy_migrations", "Requests moved on to another pair mid-answer "
                                   "(their decode worker or the path failed; the client's stream went on)",
                                   registry=r)
        paths = Counter("xpyd_proxy_prefill_path", "P/D requests by where their prompt was computed: remote (a "
                        "prefill worker) or local (their decode worker: a short or mostly cached prompt)",
                        ("path",), registry=r)
        self._paths = {path: paths.labels(path) for path in ("remote", "local")}
        phase = Histogram("xpyd_proxy_phase_seconds", "An answer's time to its first token here (a JSON "
                          "answer: to the answer), by phase (xpyd.api.phases)", ("phase",), buckets=PHASE_BUCKETS,
                          registry=r)
        self._phase = {name: phase.labels(name) for name in PROXY_PHASES}
        self._routing = Histogram("xpyd_proxy_routing_seconds", "Picking a request's prefill and decode worker "
                                  "and starting its calls", buckets=ROUTING_BUCKETS, registry=r)

    def observe_phases(self, p: ProxyPhases) -> None:
        for name in PROXY_PHASES:
            us = getattr(p, f"{name}_us")
            if us is not None:
                self._phase[name].observe(max(0, us) / 1e6)

    def routed(self, seconds: float) -> None:
        self._routing.observe(seconds)

    def request(self, endpoint: str) -> RequestTimer:
        if endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {endpoint!r}; expected one of {ENDPOINTS}")
        return RequestTimer(self, endpoint)

    def set_workers(self, role: str, up: int, down: int) -> None:
        self._workers.labels(role, "up").set(up)
        self._workers.labels(role, "down").set(down)

    def set_queue(self, waiting: int) -> None:
        self._queue.set(waiting)

    def pair_failed(self) -> None:
        self._pair_failures.inc()

    def prefill_path(self, path: Enum) -> None:
        """A P/D request was routed; its prompt is computed on ``path`` (``xpyd.proxy.prefill_path``)."""
        self._paths[path.value].inc()

    def migrated(self) -> None:
        self._migrations.inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
