"""The vllm:* series of a worker: vLLM's names, types, labels and buckets; each role counts its own share."""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.test_metrics import parse, value
from xpyd.worker.metrics import WorkerMetrics
from xpyd.worker.vllm_metrics import request_token_buckets
from xpyd.worker.work_item import ErrorEvent, EventDispatch, TokenEvent

L = {"model_name": "m", "engine": "0"}

# vLLM's boundaries (vllm/v1/metrics/buckets.py), written out here so that a change on either side shows
TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
        160.0, 640.0, 2560.0)
ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
       1920.0, 7680.0)


def buckets(v: dict, name: str) -> tuple[float, ...]:
    return tuple(sorted(float(dict(labels)["le"]) for n, labels in v
                        if n == name + "_bucket" and dict(labels)["le"] != "+Inf"))


def test_names_types_labels_and_buckets():
    m = WorkerMetrics("colocated", model_name="m", max_model_len=1000)
    types, v = parse(m.render())
    vllm = {name: t for name, t in types.items() if name.startswith("vllm:") and not name.endswith("_created")}
    assert vllm == {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter", "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter", "vllm:request_prompt_tokens": "histogram",
        "vllm:request_generation_tokens": "histogram", "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram", "vllm:time_per_output_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_prefill_time_seconds": "histogram", "vllm:num_preemptions": "counter",
    }
    for reason in ("stop", "length", "abort", "error", "repetition"):
        assert value(v, "vllm:request_success_total", **L, finished_reason=reason) == 0
    assert value(v, "vllm:prompt_tokens_total", **L) == 0
    assert buckets(v, "vllm:time_to_first_token_seconds") == TTFT
    assert buckets(v, "vllm:inter_token_latency_seconds") == ITL
    assert buckets(v, "vllm:time_per_output_token_seconds") == ITL
    assert buckets(v, "vllm:e2e_request_latency_seconds") == E2E
    assert buckets(v, "vllm:request_queue_time_seconds") == E2E == buckets(v, "vllm:request_prefill_time_seconds")
    assert buckets(v, "vllm:request_prompt_tokens") == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert request_token_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]


def test_hooks_feed_the_vllm_series():
    m = WorkerMetrics("decode", model_name="m")
    m.set_queue(waiting=3, running=2, transferring=4)
    stats = {"blocks_used": 5, "blocks_free": 15, "blocks_evictable": 7, "prefix_query_tokens": 100,
             "prefix_hit_tokens": 64}
    m.set_kv_cache(stats)
    m.set_kv_cache(stats | {"prefix_query_tokens": 150, "prefix_hit_tokens": 80})
    m.observe_ttft(0.2)
    m.observe_itl(0.03)
    m.observe_e2e(1.2)
    m.request_done("aborted")
    m.preempted()
    _, v = parse(m.render())
    assert value(v, "vllm:num_requests_running", **L) == 2
    assert value(v, "vllm:num_requests_waiting", **L) == 7  # decode: + those waiting for their KV
    assert value(v, "vllm:kv_cache_usage_perc", **L) == 0.25
    assert value(v, "vllm:prefix_cache_queries_total", **L) == 150
    assert value(v, "vllm:prefix_cache_hits_total", **L) == 80
    assert value(v, "vllm:time_to_first_token_seconds_count", **L) == 1
    assert value(v, "vllm:time_to_first_token_seconds_bucket", **L, le="0.25") == 1
    assert value(v, "vllm:time_to_first_token_seconds_bucket", **L, le="0.1") == 0
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert value(v, name + "_count", **L) == 1
        assert value(v, name + "_sum", **L) == pytest.approx(0.03)
    assert value(v, "vllm:e2e_request_latency_seconds_bucket", **L, le="1.5") == 1
    assert value(v, "vllm:e2e_request_latency_seconds_bucket", **L, le="1.0") == 0
    assert value(v, "vllm:request_success_total", **L, finished_reason="abort") == 1
    assert value(v, "vllm:num_preemptions_total", **L) == 1

    p = WorkerMetrics("prefill", model_name="m")
    p.set_queue(waiting=3, running=2, transferring=4)
    p.request_done("aborted")  # (prefill's part of a request is not its end)
    _, v = parse(p.render())
    assert value(v, "vllm:num_requests_waiting", **L) == 3
    assert value(v, "vllm:request_success_total", **L, finished_reason="abort") == 0


def _run(role: str, events: list) -> dict:
    """Put ``events`` on one request's sink of a ``role`` worker; the rendered values."""
    m = WorkerMetrics(role, model_name="m")

    async def go() -> None:
        sink = m.sink(EventDispatch(asyncio.get_running_loop()))
        for ev in events:
            sink.put(ev)

    asyncio.run(go())
    return parse(m.render())[1]


def _counts(v: dict) -> tuple:
    return (value(v, "vllm:prompt_tokens_total", **L), value(v, "vllm:generation_tokens_total", **L),
            {r: value(v, "vllm:request_success_total", **L, finished_reason=r)
             for r in ("stop", "length", "error") if value(v, "vllm:request_success_total", **L, finished_reason=r)},
            value(v, "vllm:request_generation_tokens_count", **L))


def test_each_role_counts_its_share_of_a_request():
    # 7 prompt tokens, 5 generated: prefill makes token 1, decode tokens 2..5 (events only when text shows)
    prefill = [TokenEvent("a", None, 7, 1)]
    decode = [TokenEvent("b", None, 7, 2), TokenEvent("cd", None, 7, 4), TokenEvent("e", "length", 7, 5)]
    assert _counts(_run("prefill", prefill)) == (7, 1, {}, 0)
    assert _counts(_run("decode", decode)) == (0, 4, {"length": 1}, 1)
    colocated = [TokenEvent("a", None, 7, 1)] + decode[:2] + [TokenEvent("e", "stop", 7, 5)]
    v = _run("colocated", colocated)
    assert _counts(v) == (7, 5, {"stop": 1}, 1)
    assert value(v, "vllm:request_generation_tokens_sum", **L) == 5
    assert value(v, "vllm:request_prompt_tokens_sum", **L) == 7

    # ended by its first token: prefill counts the end; decode, which ends it too, does not count it again
    assert _counts(_run("prefill", [TokenEvent("a", "stop", 7, 1)])) == (7, 1, {"stop": 1}, 1)
    assert _counts(_run("decode", [TokenEvent("", "stop", 7, 1)])) == (0, 0, {}, 0)
    # an error ends it where the client is answered (decode, colocated), not on prefill
    assert _counts(_run("decode", [TokenEvent("b", None, 7, 2), ErrorEvent(502, "KV")])) == (0, 1, {"error": 1}, 0)
    assert _counts(_run("prefill", [ErrorEvent(500, "x")])) == (0, 0, {}, 0)
