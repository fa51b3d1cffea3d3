"""vLLM's metric names on a worker's ``/metrics``, next to xpyd's own, so vLLM's Grafana dashboards and the
autoscalers keyed on ``vllm:*`` work unchanged.

Same names, types, labels (``model_name``, ``engine``) and histogram buckets as vLLM's Prometheus stat logger
(``vllm/v1/metrics/loggers.py`` and ``buckets.py``). A request's work is split between two workers in P/D,
so each counts what it does itself, and the sums over the cluster are what one vLLM server would count:

=========================================  ==========================================================
name                                       prefill | decode | colocated
=========================================  ==========================================================
vllm:num_requests_running                  its scheduler's running requests (all roles)
vllm:num_requests_waiting                  waiting; decode: + those waiting for their KV (as vLLM's
                                           WAITING_FOR_REMOTE_KVS requests)
vllm:kv_cache_usage_perc                   blocks held by requests / all blocks (cached free ones: free)
vllm:prefix_cache_queries_total, _hits     prompt tokens looked up in / found in this worker's cache
vllm:prompt_tokens_total                   the prompt's tokens | 0 (its KV comes from prefill) | prompt
vllm:generation_tokens_total               1 (the first token) | tokens 2..n | all
vllm:request_success_total                 requests whose first token ended them | those ended by a later
  {finished_reason}                        token, an error or an abort | all
vllm:time_to_first_token_seconds           arrival at the worker -> first token | none | the same
vllm:inter_token_latency_seconds (and the  none | between two tokens it generated | every gap
  older vllm:time_per_output_token_seconds)
vllm:e2e_request_latency_seconds           none | arrival at the worker -> last token (every request that
                                           reaches its end there, those ended by token 1 too) | the same
vllm:request_prompt_tokens,                one per request counted in request_success (the prompt's
  vllm:request_generation_tokens           length; all its generated tokens, token 1 included)
vllm:request_queue_time_seconds            handed to the engine -> its first forward pass | none | the same
vllm:request_prefill_time_seconds          that pass started -> first token sampled | none | the same
vllm:num_preemptions_total                 none (prefill never preempts) | requests preempted | the same
=========================================  ==========================================================

Tokens and request ends are read from the events an engine puts on a request's ``OutputSink`` (``MeteredSink``,
on the engine thread); latencies, queue and cache from ``WorkerMetrics``' hooks, which forward them here.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from xpyd.worker.work_item import ErrorEvent, Event, EventDispatch, OutputSink

# vllm/v1/metrics/buckets.py
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FINISH_REASON_STRINGS
ROLES = ("prefill", "decode", "colocated")
ENGINE = "0"  # vLLM's engine label (its data-parallel rank): one engine per xpyd worker


def request_token_buckets(max_model_len: int) -> list[int]:
    """vLLM's 1-2-5 series up to ``max_model_len`` (``build_1_2_5_buckets``)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


class VLLMMetrics:
    """The ``vllm:*`` series of one worker (``role``) serving ``model_name``, in ``registry``."""

    def __init__(self, registry: CollectorRegistry, role: str, model_name: str, max_model_len: int) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if not isinstance(model_name, str):
            raise ValueError(f"model_name must be a string, got {model_name!r}")
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        self.role = role
        labels = ("model_name", "engine")
        values = (model_name, ENGINE)
        r = registry

        def gauge(name: str, doc: str):
            return Gauge(name, doc, labels, registry=r).labels(*values)

        def counter(name: str, doc: str):
            return Counter(name, doc, labels, registry=r).labels(*values)

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
                               "tokens.")
        self.hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          labels + ("finished_reason",), registry=r)
        self.success = {reason: success.labels(*values, reason) for reason in FINISHED_REASONS}
        token_buckets = request_token_buckets(max_model_len)
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                        token_buckets)
        self.request_generation = histogram("vllm:request_generation_tokens", "Number of generation tokens "
                                            "processed.", token_buckets)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TIME_TO_FIRST_TOKEN_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             INTER_TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in "
                              "seconds. DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
                              INTER_TOKEN_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING "
                                    "phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL "
                                      "phase for request.", REQUEST_LATENCY_BUCKETS)
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)

    # --- from WorkerMetrics' hooks -------------------------------------------------------------------
    def set_queue(self, waiting: int, running: int, transferring: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting + transferring if self.role == "decode" else waiting)

    def set_kv_cache(self, stats: dict, new_queries: int, new_hits: int) -> None:
        used, free = stats["blocks_used"], stats["blocks_free"]
        self.kv_usage.set(used / (used + free) if used + free else 0.0)
        self.queries.inc(new_queries)
        self.hits.inc(new_hits)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.tpot.observe(seconds)

    def observe_prefill(self, queue_seconds: float, prefill_seconds: float) -> None:
        """A prefilled request's wait for its first forward pass, and its prompt's computing to token 1."""
        self.queue_time.observe(queue_seconds)
        self.prefill_time.observe(prefill_seconds)

    def aborted(self) -> None:
        """A request dropped (the client went away): prefill's part of a request is not its end."""
        if self.role != "prefill":
            self.success["abort"].inc()

    # --- from the requests' sinks ----------------------------------------------------------------------
    def event(self, ev: Event, counted: int) -> int:
        """One event of a request of which ``counted`` generated tokens were counted so far; returns the
        count now. Prefill's only token is the first; decode's events count from the first (prefill's)."""
        if isinstance(ev, ErrorEvent):
            if self.role != "prefill":
                self.success["error"].inc()
            return counted
        if self.role == "decode":
            counted = max(counted, 1)  # token 1 is prefill's
        elif counted == 0 and ev.completion_tokens > 0:
            self.prompt_tokens.inc(ev.prompt_tokens)
        new = ev.completion_tokens - counted
        if new > 0:
            self.generation_tokens.inc(new)
            counted = ev.completion_tokens
        if ev.finish_reason is not None and (self.role != "decode" or ev.completion_tokens > 1):
            self.success[ev.finish_reason if ev.finish_reason in self.success else "stop"].inc()
            self.request_prompt.observe(ev.prompt_tokens)
            self.request_generation.observe(ev.completion_tokens)
        return counted


class MeteredSink(OutputSink):
    """An ``OutputSink`` whose events are counted in ``VLLMMetrics`` as the engine puts them."""

    def __init__(self, dispatch: EventDispatch, metrics: VLLMMetrics) -> None:
        super().__init__(dispatch)
        self._metrics = metrics
        self._counted = 0

    def put(self, event: Event) -> None:
        self._counted = self._metrics.event(event, self._counted)
        super().put(event)
