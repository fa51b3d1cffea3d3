"""WorkerMetrics and ProxyMetrics: the exposition text parses back with the right names, types, labels, values."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families
from werkzeug.exceptions import RequestEntityTooLarge

from xpyd.api.openai import APIError
from xpyd.histograms import LATENCY_BUCKETS
from xpyd.worker.metrics import WorkerMetrics
from xpyd.proxy.client import Fault, UpstreamError
from xpyd.proxy.metrics import Outcome, ProxyMetrics, outcome_of


def parse(rendered: tuple[bytes, str]) -> tuple[dict[str, str], dict[tuple, float]]:
    """(family name -> type, (sample name, sorted labels) -> value); the content type is Prometheus text."""
    body, content_type = rendered
    assert content_type.startswith("text/plain; version=")
    types, values = {}, {}
    for family in text_string_to_metric_families(body.decode()):
        types[family.name] = family.type
        for s in family.samples:
            values[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, values


def value(values: dict, name: str, **labels: str) -> float:
    return values[(name, tuple(sorted(labels.items())))]


def test_worker_metrics_render_names_types_and_values():
    m = WorkerMetrics("decode")
    m.set_queue(waiting=3, running=2, transferring=1)
    m.set_kv(used_bytes=4096, capacity_bytes=1 << 20)
    for outcome in ("finished", "finished", "failed", "aborted", "rejected"):
        m.request_done(outcome)
    m.observe_ttft(0.2)
    m.observe_itl(0.01)
    m.observe_itl(0.03)
    m.observe_e2e(1.5)
    m.observe_step("decode", 0.004, batch=5)
    m.observe_step("prefill", 0.3, batch=1)
    m.transfer_done("recv", 1000, 0.02, ok=True)
    m.transfer_done("recv", 500, 0.01, ok=True)
    m.transfer_done("recv", 700, 0.05, ok=False)  # failed: counted, but no bytes and no duration
    # 25 blocks: 5 held by requests (2 of them cached), 7 cached and held by none, 13 empty
    stats = {"blocks_used": 5, "blocks_cached": 9, "blocks_free": 20, "blocks_evictable": 7, "prefix_query_tokens": 100,
             "prefix_hit_tokens": 64}
    m.set_kv_cache(stats)
    m.set_kv_cache(stats | {"prefix_query_tokens": 150, "prefix_hit_tokens": 80})  # counters grow by the difference
    m.kv_reused(4096)
    m.preempted()
    m.preempted()

    types, v = parse(m.render())
    types = {name: t for name, t in types.items() if not name.startswith("vllm:")}  # (tests/unit/test_vllm_metrics.py)
    assert types == {
        "xpyd_requests_in_flight": "gauge", "xpyd_kv_pool_used_bytes": "gauge",
        "xpyd_kv_pool_capacity_bytes": "gauge", "xpyd_requests": "counter",
        "xpyd_time_to_first_token_seconds": "histogram", "xpyd_inter_token_latency_seconds": "histogram",
        "xpyd_e2e_request_latency_seconds": "histogram", "xpyd_engine_step_seconds": "histogram",
        "xpyd_engine_batch_size": "histogram", "xpyd_kv_transfer_bytes": "counter",
        "xpyd_kv_transfer_seconds": "histogram", "xpyd_kv_transfers": "counter",
        "xpyd_kv_blocks": "gauge", "xpyd_prefix_cache_queries": "counter", "xpyd_prefix_cache_hits": "counter",
        "xpyd_kv_reuse_saved_bytes": "counter", "xpyd_signal_messages": "counter",
        "xpyd_etcd_operations": "counter", "xpyd_http_requests": "counter",
        "xpyd_request_phase_seconds": "histogram", "xpyd_local_prefills": "counter",
        "xpyd_preemptions": "counter",
    } | {name: "gauge" for name in types if name.endswith("_created")}
    assert all(name.startswith("xpyd_") for name in types)
    assert all(dict(labels).get("role") == "decode" for name, labels in v if not name.startswith("vllm:")), \
        "every xpyd series carries the role"

    r = {"role": "decode"}
    assert [value(v, "xpyd_requests_in_flight", **r, state=s) for s in ("waiting", "running", "transferring")] \
        == [3, 2, 1]
    assert value(v, "xpyd_kv_pool_used_bytes", **r) == 4096
    assert value(v, "xpyd_kv_pool_capacity_bytes", **r) == 1 << 20
    assert {o: value(v, "xpyd_requests_total", **r, outcome=o)
            for o in ("finished", "failed", "aborted", "rejected")} == \
        {"finished": 2, "failed": 1, "aborted": 1, "rejected": 1}

    assert value(v, "xpyd_time_to_first_token_seconds_count", **r) == 1
    assert value(v, "xpyd_time_to_first_token_seconds_sum", **r) == pytest.approx(0.2)
    assert value(v, "xpyd_time_to_first_token_seconds_bucket", **r, le="0.25") == 1
    assert value(v, "xpyd_time_to_first_token_seconds_bucket", **r, le="0.15") == 0
    assert value(v, "xpyd_inter_token_latency_seconds_count", **r) == 2
    assert value(v, "xpyd_inter_token_latency_seconds_sum", **r) == pytest.approx(0.04)
    assert value(v, "xpyd_e2e_request_latency_seconds_count", **r) == 1
    assert value(v, "xpyd_engine_step_seconds_count", **r, kind="decode") == 1
    assert value(v, "xpyd_engine_step_seconds_sum", **r, kind="prefill") == pytest.approx(0.3)
    assert value(v, "xpyd_engine_batch_size_sum", **r, kind="decode") == 5
    assert value(v, "xpyd_engine_batch_size_bucket", **r, kind="decode", le="4.0") == 0
    assert value(v, "xpyd_engine_batch_size_bucket", **r, kind="decode", le="8.0") == 1

    d = {**r, "direction": "recv"}
    assert value(v, "xpyd_kv_transfer_bytes_total", **d) == 1500
    assert value(v, "xpyd_kv_transfer_bytes_total", **r, direction="send") == 0
    assert value(v, "xpyd_kv_transfer_seconds_count", **d) == 2
    assert value(v, "xpyd_kv_transfer_seconds_sum", **d) == pytest.approx(0.03)
    assert value(v, "xpyd_kv_transfers_total", **d, outcome="ok") == 2
    assert value(v, "xpyd_kv_transfers_total", **d, outcome="failed") == 1
    assert {s: value(v, "xpyd_kv_blocks", **r, state=s) for s in ("used", "cached", "free")} == \
        {"used": 5, "cached": 7, "free": 13}  # a partition of the pool
    assert value(v, "xpyd_prefix_cache_queries_total", **r) == 150
    assert value(v, "xpyd_prefix_cache_hits_total", **r) == 80
    assert value(v, "xpyd_kv_reuse_saved_bytes_total", **r) == 4096
    assert value(v, "xpyd_preemptions_total", **r) == 2


def test_worker_latency_buckets_span_milliseconds_to_tens_of_seconds():
    assert LATENCY_BUCKETS[0] <= 0.001 and LATENCY_BUCKETS[-1] >= 30
    _, v = parse(WorkerMetrics("prefill").render())
    les = [dict(labels)["le"] for name, labels in v if name == "xpyd_time_to_first_token_seconds_bucket"]
    assert les[-1] == "+Inf" and len(les) == len(LATENCY_BUCKETS) + 1


def test_every_series_exists_at_zero_before_any_request():
    _, v = parse(WorkerMetrics("prefill").render())
    r = {"role": "prefill"}
    assert value(v, "xpyd_kv_pool_used_bytes", **r) == 0
    for state in ("waiting", "running", "transferring"):
        assert value(v, "xpyd_requests_in_flight", **r, state=state) == 0
    for outcome in ("finished", "failed", "aborted", "rejected"):
        assert value(v, "xpyd_requests_total", **r, outcome=outcome) == 0
    assert value(v, "xpyd_kv_transfers_total", **r, direction="send", outcome="failed") == 0


def test_each_instance_has_its_own_registry():
    a, b = WorkerMetrics("prefill"), WorkerMetrics("prefill")  # no "Duplicated timeseries" error
    a.request_done("finished")
    assert value(parse(a.render())[1], "xpyd_requests_total", role="prefill", outcome="finished") == 1
    assert value(parse(b.render())[1], "xpyd_requests_total", role="prefill", outcome="finished") == 0


def test_unknown_label_values_are_refused():
    m = WorkerMetrics("decode")
    with pytest.raises(ValueError, match="outcome"):
        m.request_done("success")
    with pytest.raises(ValueError, match="step kind"):
        m.observe_step("verify", 0.1, 1)
    with pytest.raises(ValueError, match="direction"):
        m.transfer_done("sideways", 1, 0.1, ok=True)
    with pytest.raises(ValueError, match="role"):
        WorkerMetrics("")


# ---------------------------------------------------------------- proxy


def test_proxy_metrics_follow_requests():
    m = ProxyMetrics()
    ok = m.request("/v1/chat/completions")
    failed = m.request("/v1/completions")
    _, v = parse(m.render())
    assert value(v, "xpyd_requests_in_flight", role="proxy") == 2

    ok.first_token()
    ok.token()
    ok.token()
    ok.end(Outcome.OK)
    ok.end(Outcome.ABORTED)  # later ends are ignored (e.g. the stream's finally)
    failed.end(Outcome.UPSTREAM_ERROR)
    m.set_workers("prefill", up=2, down=1)
    m.set_workers("decode", up=1, down=0)

    types, v = parse(m.render())
    assert types["xpyd_proxy_requests"] == "counter"
    for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        assert types[f"xpyd_proxy_{name}_seconds"] == "histogram"
    assert types["xpyd_requests_in_flight"] == types["xpyd_proxy_workers"] == "gauge"
    assert value(v, "xpyd_requests_in_flight", role="proxy") == 0
    assert value(v, "xpyd_proxy_requests_total", endpoint="/v1/chat/completions", outcome="ok") == 1
    assert value(v, "xpyd_proxy_requests_total", endpoint="/v1/chat/completions", outcome="aborted") == 0
    assert value(v, "xpyd_proxy_requests_total", endpoint="/v1/completions", outcome="upstream_error") == 1
    assert value(v, "xpyd_proxy_time_to_first_token_seconds_count") == 1
    assert value(v, "xpyd_proxy_inter_token_latency_seconds_count") == 2
    assert value(v, "xpyd_proxy_e2e_request_latency_seconds_count") == 1  # successful requests only
    assert value(v, "xpyd_proxy_workers", role="prefill", health="up") == 2
    assert value(v, "xpyd_proxy_workers", role="prefill", health="down") == 1
    assert value(v, "xpyd_proxy_workers", role="decode", health="down") == 0
    with pytest.raises(ValueError, match="endpoint"):
        m.request("/v1/embeddings")


@pytest.mark.parametrize("exc, outcome", [
    (APIError(400, "bad"), Outcome.CLIENT_ERROR),
    (UpstreamError(400, "worker refused"), Outcome.CLIENT_ERROR),
    (UpstreamError(502, "worker died", fault=Fault.UNREACHABLE), Outcome.UPSTREAM_ERROR),
    (UpstreamError(503, "worker starting", fault=Fault.UNHEALTHY), Outcome.UPSTREAM_ERROR),
    (APIError(503, "no workers available"), Outcome.UNAVAILABLE),
    (RequestEntityTooLarge(), Outcome.CLIENT_ERROR),
    (asyncio.CancelledError(), Outcome.ABORTED),
    (RuntimeError("bug"), Outcome.INTERNAL_ERROR),
])
def test_outcome_of(exc, outcome):
    assert outcome_of(exc) is outcome
