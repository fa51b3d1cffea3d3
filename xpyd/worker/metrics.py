"""A worker's Prometheus metrics, served as text at ``GET /metrics``.

Each ``WorkerMetrics`` owns its registry (no process-global state), so tests and
several engines in one process never share series. Every series carries the
worker's ``role`` label. The engine thread records; the HTTP thread renders
(prometheus_client's metrics are thread-safe).

=========================================  =========  ================================================
name                                       type       labels / meaning
=========================================  =========  ================================================
xpyd_requests_in_flight                    gauge      state=waiting|running|transferring
xpyd_kv_pool_used_bytes                    gauge      KV bytes held for requests
xpyd_kv_pool_capacity_bytes                gauge      size of the KV pool
xpyd_requests_total                        counter    outcome=finished|failed|aborted|rejected
xpyd_time_to_first_token_seconds           histogram  arrival at the worker -> first token
xpyd_inter_token_latency_seconds           histogram  between two tokens of one request
xpyd_e2e_request_latency_seconds           histogram  arrival at the worker -> last token
xpyd_request_phase_seconds                 histogram  phase: one phase of a request here (``xpyd.api.phases``):
                                                      prefill parse|queue|compute|respond (they add up to its
                                                      TTFT), decode parse|wait|transfer|queue|step|respond
                                                      (to its first chunk), colocated parse|queue|compute|
                                                      rest|respond (to its first chunk or JSON answer; rest:
                                                      a JSON answer's tokens after the first) and its first
                                                      decode step decode_queue|decode_step|decode_respond
                                                      (streamed); each request once, when its first chunk
                                                      (prefill: its answer; decode_*: its second) is written
xpyd_engine_step_seconds                   histogram  kind=prefill|decode: one forward pass + sampling
xpyd_engine_batch_size                     histogram  kind=prefill|decode: requests in that pass
xpyd_kv_transfer_bytes_total               counter    direction=send|recv: bytes of completed transfers
xpyd_kv_transfer_seconds                   histogram  direction: start -> completion (completed only)
xpyd_kv_transfers_total                    counter    direction, outcome=ok|failed
xpyd_kv_blocks                             gauge      state=used|cached|free: KV blocks of the paged cache (the
                                                      three add up to the pool: held by requests; held by none
                                                      and kept for their prefix, evictable; empty)
xpyd_prefix_cache_queries_total            counter    prompt tokens looked up in the prefix cache
xpyd_prefix_cache_hits_total               counter    ... and found there (not computed / not moved)
xpyd_kv_reuse_saved_bytes_total            counter    decode: KV bytes not transferred (prefix blocks held)
xpyd_preemptions_total                     counter    decode, colocated: requests that gave their KV blocks back
                                                      for an older request to grow, and compute them again
                                                      (``xpyd.worker.preemption``)
xpyd_signal_messages_total                 counter    direction=sent|received, kind (the message's tag:
                                                      heartbeat, lookup_all...; ``xpyd.signal.counts``)
xpyd_etcd_operations_total                 counter    op (lease_refresh, watch_event...;
                                                      ``xpyd.discovery.counts``)
xpyd_http_requests_total                   counter    route: HTTP requests received (the proxy's probes,
                                                      KV-events polls, POSTs; ``unmatched``: no route)
=========================================  =========  ================================================

Next to them, vLLM's names (``vllm:num_requests_running``, ``vllm:time_to_first_token_seconds`` ...), with
vLLM's labels and buckets, fed by the same hooks and by the requests' sinks (``sink``): ``xpyd.worker.vllm_metrics``.

The signal plane and discovery count in plain ``MessageCounts`` and ``EtcdOps`` (they know no Prometheus);
``signal`` and ``etcd`` here are the ones the worker's signal server or client and its etcd registration and
watcher are given, read when ``/metrics`` is rendered.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from xpyd.discovery.counts import EtcdOps
from xpyd.api.phases import (
    COLOCATED_PHASES, DECODE_PHASES, PREFILL_PHASES, STEP_PHASES, ColocatedPhases, DecodePhases, PrefillPhases,
    StepPhases,
)
from xpyd.histograms import BATCH_BUCKETS, INTER_TOKEN_BUCKETS, LATENCY_BUCKETS, PHASE_BUCKETS
from xpyd.signal.counts import MessageCounts
from xpyd.worker.vllm_metrics import MeteredSink, VLLMMetrics
from xpyd.worker.work_item import EventDispatch

QUEUE_STATES = ("waiting", "running", "transferring")
OUTCOMES = ("finished", "failed", "aborted", "rejected")
STEP_KINDS = ("prefill", "decode")
DIRECTIONS = ("send", "recv")
BLOCK_STATES = ("used", "cached", "free")
_AS_COLOCATED = COLOCATED_PHASES + tuple(f"decode_{p}" for p in STEP_PHASES)
ROLE_PHASES = {"prefill": PREFILL_PHASES, "colocated": _AS_COLOCATED,  # (decode: its local prefills as colocated)
               "decode": DECODE_PHASES + tuple(p for p in _AS_COLOCATED if p not in DECODE_PHASES)}


def _children(metric, role: str, values: tuple[str, ...]) -> dict:
    """One bound child per known label value, created now so every series is exported from the start."""
    return {v: metric.labels(role, v) for v in values}


def _pick(children: dict, value: str, what: str):
    try:
        return children[value]
    except KeyError:
        raise ValueError(f"unknown {what} {value!r}; expected one of {sorted(children)}") from None


class _PlaneCounts(Collector):
    """Exports the signal plane's and discovery's plain counters at each scrape."""

    def __init__(self, role: str, signal: MessageCounts, etcd: EtcdOps) -> None:
        self._role, self._signal, self._etcd = role, signal, etcd

    def collect(self):
        messages = CounterMetricFamily("xpyd_signal_messages", "Signal-plane messages sent and received, by kind",
                                       labels=("role", "direction", "kind"))
        for (direction, kind), n in sorted(self._signal.snapshot().items()):
            messages.add_metric((self._role, direction, kind), n)
        ops = CounterMetricFamily("xpyd_etcd_operations", "etcd operations (calls made and watch events "
                                  "received), by kind", labels=("role", "op"))
        for op, n in self._etcd.snapshot().items():
            ops.add_metric((self._role, op), n)
        return [messages, ops]


class WorkerMetrics:
    """``model_name`` and ``max_model_len``: what the ``vllm:*`` series are labelled with and bucketed by."""

    def __init__(self, role: str, registry: CollectorRegistry | None = None, *, model_name: str = "",
                 max_model_len: int = 2048) -> None:
        if not isinstance(role, str) or not role:
            raise ValueError(f"role must be a non-empty string, got {role!r}")
        self.role = role
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.vllm = VLLMMetrics(r, role, model_name, max_model_len)
        in_flight = Gauge("xpyd_requests_in_flight", "Requests held by the worker, by state",
                          ("role", "state"), registry=r)
        self._in_flight = _children(in_flight, role, QUEUE_STATES)
        self._kv_used = Gauge("xpyd_kv_pool_used_bytes", "KV cache bytes held for requests",
                              ("role",), registry=r).labels(role)
        self._kv_capacity = Gauge("xpyd_kv_pool_capacity_bytes", "Size of the KV cache pool in bytes",
                                  ("role",), registry=r).labels(role)
        requests = Counter("xpyd_requests", "Requests that ended on this worker, by outcome",
                           ("role", "outcome"), registry=r)
        self._requests = _children(requests, role, OUTCOMES)
        self._ttft = Histogram("xpyd_time_to_first_token_seconds",
                               "Arrival at the worker to the first generated token",
                               ("role",), buckets=LATENCY_BUCKETS, registry=r).labels(role)
        self._itl = Histogram("xpyd_inter_token_latency_seconds", "Time between two tokens of a request",
                              ("role",), buckets=INTER_TOKEN_BUCKETS, registry=r).labels(role)
        self._e2e = Histogram("xpyd_e2e_request_latency_seconds", "Arrival at the worker to the last token",
                              ("role",), buckets=LATENCY_BUCKETS, registry=r).labels(role)
        phase = Histogram("xpyd_request_phase_seconds", "One phase of a request on this worker (xpyd.api.phases)",
                          ("role", "phase"), buckets=PHASE_BUCKETS, registry=r)
        self._phase = _children(phase, role, ROLE_PHASES.get(role, ()))
        step = Histogram("xpyd_engine_step_seconds", "One forward pass and sampling",
                         ("role", "kind"), buckets=LATENCY_BUCKETS, registry=r)
        self._step = _children(step, role, STEP_KINDS)
        batch = Histogram("xpyd_engine_batch_size", "Requests in one forward pass",
                          ("role", "kind"), buckets=BATCH_BUCKETS, registry=r)
        self._batch = _children(batch, role, STEP_KINDS)
        xfer_bytes = Counter("xpyd_kv_transfer_bytes", "KV bytes moved by completed transfers",
                             ("role", "direction"), registry=r)
        self._xfer_bytes = _children(xfer_bytes, role, DIRECTIONS)
        xfer_seconds = Histogram("xpyd_kv_transfer_seconds", "Start to completion of a KV transfer",
                                 ("role", "direction"), buckets=LATENCY_BUCKETS, registry=r)
        self._xfer_seconds = _children(xfer_seconds, role, DIRECTIONS)
        transfers = Counter("xpyd_kv_transfers", "KV transfers that ended, by outcome",
                            ("role", "direction", "outcome"), registry=r)
        self._transfers = {(d, o): transfers.labels(role, d, o) for d in DIRECTIONS for o in ("ok", "failed")}
        blocks = Gauge("xpyd_kv_blocks", "KV blocks of the paged cache, by state", ("role", "state"), registry=r)
        self._blocks = _children(blocks, role, BLOCK_STATES)
        self._queries = Counter("xpyd_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                ("role",), registry=r).labels(role)
        self._hits = Counter("xpyd_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                             ("role",), registry=r).labels(role)
        self._saved = Counter("xpyd_kv_reuse_saved_bytes", "KV bytes not transferred because this worker's prefix "
                              "cache held them", ("role",), registry=r).labels(role)
        self._counted = (0, 0)  # prefix-cache queries and hits already counted
        self._preemptions = Counter("xpyd_preemptions", "Requests preempted: their KV blocks given back for an "
                                    "older request to grow, computed again when they re-enter", ("role",),
                                    registry=r).labels(role)
        self._local_prefills = Counter("xpyd_local_prefills", "Requests whose prompt a decode worker computed "
                                       "itself (the proxy's conditional disaggregation)", ("role",),
                                       registry=r).labels(role)
        self.signal = MessageCounts()  # given to the signal server (prefill) or client (decode)
        self.etcd = EtcdOps()  # given to the etcd registration and watcher
        r.register(_PlaneCounts(role, self.signal, self.etcd))
        self._http = Counter("xpyd_http_requests", "HTTP requests received, by route", ("role", "route"),
                             registry=r)

    def http_request(self, route: str) -> None:
        """One HTTP request received on ``route`` (the matched rule: a bounded set)."""
        self._http.labels(self.role, route).inc()

    def set_queue(self, waiting: int, running: int, transferring: int) -> None:
        for state, n in zip(QUEUE_STATES, (waiting, running, transferring)):
            self._in_flight[state].set(n)
        self.vllm.set_queue(waiting, running, transferring)

    def set_kv(self, used_bytes: int, capacity_bytes: int) -> None:
        self._kv_used.set(used_bytes)
        self._kv_capacity.set(capacity_bytes)

    def set_kv_cache(self, stats: dict) -> None:
        """From ``KVCache.stats()``: block states, and the prefix-cache counters' growth since last time."""
        self._blocks["used"].set(stats["blocks_used"])
        self._blocks["cached"].set(stats["blocks_evictable"])  # (a used block may be cached too: counted as used)
        self._blocks["free"].set(stats["blocks_free"] - stats["blocks_evictable"])
        queries, hits = stats["prefix_query_tokens"], stats["prefix_hit_tokens"]
        self._queries.inc(queries - self._counted[0])
        self._hits.inc(hits - self._counted[1])
        self.vllm.set_kv_cache(stats, queries - self._counted[0], hits - self._counted[1])
        self._counted = (queries, hits)

    def local_prefilled(self) -> None:
        """A decode worker computed a request's prompt itself (``xpyd.decode_worker.local_prefill``)."""
        self._local_prefills.inc()

    def preempted(self) -> None:
        """A request gave its KV blocks back, to compute them again (``xpyd.worker.preemption``)."""
        self._preemptions.inc()
        self.vllm.preemptions.inc()

    def kv_reused(self, nbytes: int) -> None:
        self._saved.inc(nbytes)

    def request_done(self, outcome: str) -> None:
        _pick(self._requests, outcome, "outcome").inc()
        if outcome == "aborted":
            self.vllm.aborted()

    def sink(self, dispatch: EventDispatch) -> MeteredSink:
        """A request's output sink whose events count its tokens and its end (``vllm:*``)."""
        return MeteredSink(dispatch, self.vllm)

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)
        self.vllm.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self._itl.observe(seconds)
        self.vllm.observe_itl(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self._e2e.observe(seconds)
        self.vllm.e2e.observe(seconds)

    def observe_phases(self, phases: PrefillPhases | DecodePhases | ColocatedPhases | StepPhases) -> None:
        """One request's phases on this worker (its role's: ``ROLE_PHASES``; a colocated worker's first decode
        step, ``StepPhases``, as ``decode_*``); a phase that did not apply (None) is not observed."""
        prefix = "decode_" if isinstance(phases, StepPhases) else ""
        for field in phases.__struct_fields__:
            us = getattr(phases, field)
            if field.endswith("_us") and us is not None:
                _pick(self._phase, prefix + field[:-3], "phase").observe(us / 1e6)
        if isinstance(phases, (PrefillPhases, ColocatedPhases)):  # (vLLM's: the wait for, and the prompt's pass)
            self.vllm.observe_prefill(phases.queue_us / 1e6, phases.compute_us / 1e6)

    def observe_step(self, kind: str, seconds: float, batch: int) -> None:
        _pick(self._step, kind, "step kind").observe(seconds)
        self._batch[kind].observe(batch)

    def transfer_done(self, direction: str, nbytes: int, seconds: float, ok: bool) -> None:
        """One transfer ended; bytes and duration count only if it completed (``ok``)."""
        _pick(self._xfer_bytes, direction, "direction")
        self._transfers[(direction, "ok" if ok else "failed")].inc()
        if ok:
            self._xfer_bytes[direction].inc(nbytes)
            self._xfer_seconds[direction].observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type, for ``GET /metrics``."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
