"""One interval from two scrapes of the proxy's (and the workers') Prometheus text."""

from __future__ import annotations

import pytest

from xpyd.planner.observe import Interval, Lengths, Scrape, histogram_quantile, observe
from xpyd.proxy.metrics import Outcome, ProxyMetrics

PROXY_BEFORE = """\
# TYPE xpyd_proxy_requests counter
xpyd_proxy_requests_total{endpoint="/v1/completions",outcome="ok"} 100.0
xpyd_proxy_requests_total{endpoint="/v1/completions",outcome="upstream_error"} 2.0
# TYPE xpyd_requests_in_flight gauge
xpyd_requests_in_flight{role="proxy"} 4.0
# TYPE xpyd_proxy_queue_waiting gauge
xpyd_proxy_queue_waiting 0.0
# TYPE xpyd_proxy_time_to_first_token_seconds histogram
xpyd_proxy_time_to_first_token_seconds_bucket{le="0.1"} 50.0
xpyd_proxy_time_to_first_token_seconds_bucket{le="1.0"} 100.0
xpyd_proxy_time_to_first_token_seconds_bucket{le="+Inf"} 102.0
xpyd_proxy_time_to_first_token_seconds_count 102.0
xpyd_proxy_time_to_first_token_seconds_sum 20.0
"""

PROXY_AFTER = """\
# TYPE xpyd_proxy_requests counter
xpyd_proxy_requests_total{endpoint="/v1/completions",outcome="ok"} 130.0
xpyd_proxy_requests_total{endpoint="/v1/chat/completions",outcome="ok"} 8.0
xpyd_proxy_requests_total{endpoint="/v1/completions",outcome="upstream_error"} 2.0
# TYPE xpyd_requests_in_flight gauge
xpyd_requests_in_flight{role="proxy"} 6.0
# TYPE xpyd_proxy_queue_waiting gauge
xpyd_proxy_queue_waiting 3.0
# TYPE xpyd_proxy_time_to_first_token_seconds histogram
xpyd_proxy_time_to_first_token_seconds_bucket{le="0.1"} 50.0
xpyd_proxy_time_to_first_token_seconds_bucket{le="1.0"} 120.0
xpyd_proxy_time_to_first_token_seconds_bucket{le="+Inf"} 142.0
xpyd_proxy_time_to_first_token_seconds_count 142.0
xpyd_proxy_time_to_first_token_seconds_sum 60.0
"""


def _worker(prompts: float, prompt_sum: float, outputs: float, output_sum: float) -> str:
    return ("# TYPE vllm:request_prompt_tokens histogram\n"
            f'vllm:request_prompt_tokens_bucket{{le="+Inf",model_name="m"}} {prompts}\n'
            f'vllm:request_prompt_tokens_count{{model_name="m"}} {prompts}\n'
            f'vllm:request_prompt_tokens_sum{{model_name="m"}} {prompt_sum}\n'
            "# TYPE vllm:request_generation_tokens histogram\n"
            f'vllm:request_generation_tokens_bucket{{le="+Inf",model_name="m"}} {outputs}\n'
            f'vllm:request_generation_tokens_count{{model_name="m"}} {outputs}\n'
            f'vllm:request_generation_tokens_sum{{model_name="m"}} {output_sum}\n')


def test_arrivals_are_the_ended_plus_the_change_in_flight_per_second():
    iv = observe(Scrape.parse(10.0, {"proxy": PROXY_BEFORE}), Scrape.parse(20.0, {"proxy": PROXY_AFTER}))
    assert iv.ended == 38 and iv.ended_ok == 38  # 30 + 8 new ok, no new errors
    assert iv.arrivals_per_s == pytest.approx((38 + 2) / 10.0)
    assert (iv.start_s, iv.duration_s, iv.in_flight, iv.queue_waiting) == (10.0, 10.0, 6, 3)


def test_ttft_quantiles_come_from_the_bucket_deltas_of_the_interval():
    iv = observe(Scrape.parse(0.0, {"proxy": PROXY_BEFORE}), Scrape.parse(1.0, {"proxy": PROXY_AFTER}))
    # in the interval: 0 under 0.1 s, 20 in (0.1, 1], 20 over 1 s
    assert iv.ttft_p50_s == pytest.approx(1.0)  # rank 20 of 40: the top of the second bucket
    assert iv.ttft_p90_s == pytest.approx(1.0)  # in +Inf: the last finite bound
    assert iv.itl_p50_s is None  # no ITL histogram in the text


def test_lengths_are_the_workers_means_else_the_defaults():
    before = Scrape.parse(0.0, {"proxy": PROXY_BEFORE, "prefill 0": _worker(10, 10_000, 10, 10),
                                "decode 0": _worker(0, 0, 0, 0)})
    after = Scrape.parse(5.0, {"proxy": PROXY_AFTER, "prefill 0": _worker(30, 50_000, 30, 30),
                               "decode 0": _worker(20, 20_000, 20, 2_020)})
    iv = observe(before, after)
    assert iv.lengths_measured
    assert iv.mean_input_tokens == pytest.approx((40_000 + 20_000) / 40)
    assert iv.mean_output_tokens == pytest.approx((20 + 2_020) / 40)
    proxy_only = observe(Scrape.parse(0.0, {"proxy": PROXY_BEFORE}), Scrape.parse(5.0, {"proxy": PROXY_AFTER}),
                         Lengths(512, 64))
    assert not proxy_only.lengths_measured
    assert (proxy_only.mean_input_tokens, proxy_only.mean_output_tokens) == (512, 64)


def test_a_worker_that_restarted_or_left_does_not_count_negative():
    before = Scrape.parse(0.0, {"proxy": PROXY_BEFORE, "decode 0": _worker(100, 100_000, 100, 10_000),
                                "decode 1": _worker(50, 1, 50, 1)})
    after = Scrape.parse(5.0, {"proxy": PROXY_AFTER, "decode 0": _worker(4, 4_000, 4, 400)})  # restarted; 1 left
    iv = observe(before, after)
    assert (iv.mean_input_tokens, iv.mean_output_tokens) == (1000, 100)


def test_the_real_proxy_metrics_parse_with_phases():
    m = ProxyMetrics()
    before = Scrape.parse(0.0, {"proxy": m.render()[0].decode()})
    for _ in range(4):
        t = m.request("/v1/completions")
        t.first_token()
        t.token()
        t.end(Outcome.OK)
    m.request("/v1/chat/completions")  # still in flight
    m.set_queue(2)
    iv = observe(before, Scrape.parse(2.0, {"proxy": m.render()[0].decode()}))
    assert (iv.ended_ok, iv.in_flight, iv.queue_waiting) == (4, 1, 2)
    assert iv.arrivals_per_s == pytest.approx(5 / 2.0)
    assert iv.ttft_p50_s is not None and iv.ttft_p50_s < 0.01
    assert iv.itl_p90_s is not None and iv.itl_p90_s < 0.01
    assert iv.phase_p90_s == ()  # no phases were observed


def test_histogram_quantile_interpolates_within_a_bucket():
    buckets = {0.1: 10.0, 0.2: 30.0, float("inf"): 40.0}
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)  # rank 10: the top of the first bucket
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.15)  # rank 20: half way through (0.1, 0.2]
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.2)
    assert histogram_quantile(0.5, {float("inf"): 0.0}) is None
    with pytest.raises(ValueError):
        histogram_quantile(1.5, buckets)


def test_bad_input_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="metrics of proxy"):
        Scrape.parse(0.0, {"proxy": "this is { not prometheus"})
    s = Scrape.parse(1.0, {"proxy": PROXY_BEFORE})
    with pytest.raises(ValueError, match="later"):
        observe(s, s)
    with pytest.raises(ValueError):
        Lengths(0, 10)
    with pytest.raises(ValueError):
        Interval(0.0, 0.0, 1.0, 0, 0, 10, 10, False, None, None, None, None, None, 0, 0)
