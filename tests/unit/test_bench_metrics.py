"""xpyd bench metric math on synthetic timelines with known answers, prefix-cache hit rates, SLO parsing,
SSE chunk reading."""

from __future__ import annotations

import random

import pytest

from xpyd.bench.client import DONE, Endpoint, RequestResult, _StreamFailure, chunk_text, parse_event, read_usage
from xpyd.bench.metrics import SLO, CacheHits, Distribution, RequestLatency, percentile, summarize, summarize_turns
from xpyd.bench.report import build_report, format_table


def ok(send: float, chunks: list[float], end: float, tokens: int | None = None, label: str = "all") -> RequestResult:
    return RequestResult(label=label, send_time=send, chunk_times=list(chunks), end_time=end,
                         output_tokens=len(chunks) if tokens is None else tokens, prompt_tokens=10)


def failed(kind: str, send: float = 0.0, end: float = 0.5, chunks: list[float] | None = None) -> RequestResult:
    return RequestResult(label="all", send_time=send, chunk_times=chunks or [], end_time=end,
                         error=kind, error_detail="boom")


# ---- percentiles ---------------------------------------------------------------------------------

def test_percentile_linear_interpolation_known_values():
    xs = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)  # rank 1.5
    assert percentile(xs, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0


def test_percentile_is_the_documented_linear_interpolation():
    """The module's formula (vLLM's: numpy's default method), written out here without numpy."""
    rng = random.Random(1)
    xs = [rng.expovariate(3.0) for _ in range(101)]
    s = sorted(xs)
    for p in (0, 1, 10, 50, 90, 99, 99.9, 100):
        rank = p / 100 * (len(s) - 1)
        k = int(rank)
        expected = s[k] + (s[min(k + 1, len(s) - 1)] - s[k]) * (rank - k)
        assert percentile(xs, p) == pytest.approx(expected)


def test_percentile_rejects_empty_and_out_of_range():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_is_in_ms_and_empty_is_none():
    d = Distribution.of_seconds([0.010, 0.020, 0.030])
    assert (d.count, d.mean, d.p50, d.max) == (3, pytest.approx(20.0), pytest.approx(20.0), pytest.approx(30.0))
    assert (d.p90, d.p99) == (pytest.approx(28.0), pytest.approx(29.8))  # ranks 1.8 and 1.98
    assert all(type(v) is float for v in (d.mean, d.p50, d.p90, d.p99, d.max))  # plain floats for the JSON
    e = Distribution.of_seconds([])
    assert (e.count, e.mean, e.p50, e.p90, e.p99) == (0, None, None, None, None)


# ---- one request ---------------------------------------------------------------------------------

def test_request_latency_known_timeline():
    lat = RequestLatency.of(ok(10.0, [10.1, 10.12, 10.15, 10.2], 10.21, tokens=4))
    assert lat.ttft_s == pytest.approx(0.1)
    assert lat.itls_s == pytest.approx((0.02, 0.03, 0.05))
    assert lat.e2e_s == pytest.approx(0.21)
    assert lat.tpot_s == pytest.approx((0.21 - 0.1) / 3)  # (e2e - ttft) / (tokens - 1)
    assert not lat.usage_missing


def test_tpot_counts_tokens_from_usage_not_chunks():
    # 4 chunks of 2 tokens each: ITL is per chunk, TPOT per token.
    lat = RequestLatency.of(ok(0.0, [0.1, 0.14, 0.18, 0.22], 0.22, tokens=8))
    assert lat.itls_s == pytest.approx((0.04, 0.04, 0.04))
    assert lat.tpot_s == pytest.approx(0.12 / 7)
    assert lat.output_tokens == 8


def test_usage_missing_falls_back_to_chunk_count_and_single_token_has_no_tpot():
    r = ok(0.0, [0.1, 0.2, 0.3], 0.3)
    r.output_tokens = None
    lat = RequestLatency.of(r)
    assert (lat.output_tokens, lat.usage_missing) == (3, True)
    one = RequestLatency.of(ok(0.0, [0.1], 0.1, tokens=1))
    assert one.tpot_s is None and one.itls_s == ()


def test_latency_of_failed_request_is_an_error():
    with pytest.raises(ValueError):
        RequestLatency.of(failed("timeout"))


# ---- a run ---------------------------------------------------------------------------------------

def test_summarize_excludes_failed_from_latency_but_counts_them():
    results = [
        ok(0.0, [0.1, 0.2, 0.3], 0.3),  # ttft 100, itl 100 100, e2e 300, tpot 100
        ok(0.5, [0.7, 0.75, 0.8], 0.8),  # ttft 200, itl 50 50, e2e 300, tpot 50
        ok(1.0, [1.3, 1.4, 1.5], 1.6),  # ttft 300, itl 100 100, e2e 600, tpot 150
        failed("http_500", chunks=[0.01]),  # would pull TTFT down if it were counted
        failed("timeout"),
        failed("http_500"),
    ]
    s = summarize(results, duration_s=2.0)
    assert (s.completed, s.failed) == (3, 3)
    assert s.errors == {"http_500": 2, "timeout": 1}
    assert s.requests_per_s == pytest.approx(1.5)
    assert s.output_tokens_per_s == pytest.approx(9 / 2.0)
    assert s.total_output_tokens == 9 and s.total_prompt_tokens == 30
    assert s.ttft.mean == pytest.approx(200.0) and s.ttft.p50 == pytest.approx(200.0)
    assert s.ttft.p90 == pytest.approx(280.0)  # rank 1.8 of [100, 200, 300]
    assert s.itl.count == 6 and s.itl.mean == pytest.approx(500 / 6)
    assert s.itl.p50 == pytest.approx(100.0)  # [50, 50, 100, 100, 100, 100]
    assert s.itl.p90 == pytest.approx(100.0)
    assert s.tpot.mean == pytest.approx(100.0)
    assert s.e2e.p50 == pytest.approx(300.0) and s.e2e.max == pytest.approx(600.0)
    assert s.goodput_requests_per_s == s.requests_per_s  # no SLO: every completed request is good
    assert s.error_samples == ["http_500: boom", "timeout: boom"]


def test_goodput_counts_requests_meeting_every_slo():
    slo = SLO.parse("ttft=0.5s,itl=100ms")
    results = [
        ok(0.0, [0.5, 0.55, 0.6], 0.6),  # ttft exactly 500 ms: met (inclusive); gaps 50: met -> good
        ok(0.0, [0.6, 0.62], 0.62),  # ttft 600: missed
        ok(0.0, [0.1, 0.15, 0.4, 0.45], 0.45),  # one gap of 250 ms: itl missed (p99 alone would hide it)
        ok(0.0, [0.7, 0.9, 1.2], 1.2),  # both missed
        failed("connection"),  # never good
    ]
    s = summarize(results, duration_s=4.0, slo=slo)
    assert s.good == 1
    assert s.goodput_requests_per_s == pytest.approx(0.25)
    assert s.slo_misses == {"ttft": 2, "itl": 2}


def test_goodput_tpot_and_e2e_and_single_token_meets_tpot():
    slo = SLO.parse("tpot=20ms,e2e=1s")
    results = [
        ok(0.0, [0.1, 0.11, 0.12], 0.12),  # tpot 10 ms, e2e 120: good
        ok(0.0, [0.1, 0.2, 0.3], 0.3),  # tpot 100 ms: missed
        ok(0.0, [0.9], 1.5, tokens=1),  # no tpot (met, as vLLM counts it 0); e2e 1.5 s: missed
        ok(0.0, [0.3], 0.3, tokens=1),  # good
    ]
    s = summarize(results, duration_s=1.0, slo=slo)
    assert s.good == 2 and s.slo_misses == {"tpot": 1, "e2e": 1}


def test_summarize_all_failed():
    s = summarize([failed("connection"), failed("connection")], duration_s=1.0, slo=SLO.parse("ttft=1s"))
    assert (s.completed, s.failed, s.good, s.goodput_requests_per_s) == (0, 2, 0, 0.0)
    assert s.ttft.mean is None and s.itl.p99 is None


# ---- prefix-cache hit rate -----------------------------------------------------------------------

def cached(prompt: int, hits: int | None, turn: int | None = None, ttft: float = 0.1) -> RequestResult:
    r = ok(0.0, [ttft, ttft + 0.01], ttft + 0.01)
    r.prompt_tokens, r.cached_tokens, r.turn = prompt, hits, turn
    return r


def test_hit_rate_is_cached_over_prompt_tokens_of_the_reporting_requests():
    results = [cached(100, 0), cached(100, 64), cached(200, 192), cached(50, None),  # None: not reported
               failed("http_500")]
    s = summarize(results, duration_s=1.0)
    assert s.cache == CacheHits(requests=3, prompt_tokens=400, cached_tokens=256)
    assert s.cache.hit_rate == pytest.approx(0.64)
    assert s.total_prompt_tokens == 450  # the token totals still count every completed request
    bad = failed("timeout")
    bad.prompt_tokens, bad.cached_tokens = 100, 100  # a failed request does not count
    assert CacheHits.of([cached(100, 0), bad]).hit_rate == 0.0


def test_hit_rate_is_none_without_cached_tokens_and_the_report_says_n_a():
    s = summarize([cached(100, None), cached(80, None)], duration_s=1.0)
    assert s.cache == CacheHits(0, 0, 0) and s.cache.hit_rate is None
    config = {"url": "http://x", "endpoint": "completions", "workload": "fixed", "concurrency": 1}
    report = build_report(s, {}, config, "m")
    assert report["prefix_cache"] == {"hit_rate": None, "cached_tokens": 0, "prompt_tokens": 0, "requests": 0}
    text = format_table(s, {}, config, "m")
    assert "prefix cache hit rate       n/a" in text and "--enable-prompt-tokens-details" in text
    hit = summarize([cached(100, 25), cached(100, 50)], duration_s=1.0)
    assert "prefix cache hit rate       37.5% (75 of 200 prompt tokens)" in format_table(hit, {}, config, "m")
    assert build_report(hit, {}, config, "m")["prefix_cache"]["hit_rate"] == pytest.approx(0.375)


def test_per_turn_ttft_and_hit_rates():
    results = [cached(100, 0, turn=1, ttft=0.30), cached(100, 0, turn=1, ttft=0.50),
               cached(180, 96, turn=2, ttft=0.10), cached(180, 160, turn=2, ttft=0.20),
               cached(260, 240, turn=3, ttft=0.05), failed("http_500")]
    results[-1].turn = 3
    t = summarize_turns(results, expected=7)
    assert [(s.turn, s.completed, s.failed) for s in t.turns] == [(1, 2, 0), (2, 2, 0), (3, 1, 1)]
    assert [s.ttft.p50 for s in t.turns] == [pytest.approx(400), pytest.approx(150), pytest.approx(50)]
    assert [s.cache.hit_rate for s in t.turns] == [0.0, pytest.approx(256 / 360), pytest.approx(240 / 260)]
    assert t.first.hit_rate == 0.0 and t.later == CacheHits(3, 620, 496)
    assert t.not_sent == 1  # 7 planned, 6 sent
    config = {"url": "http://x", "endpoint": "chat", "workload": "multi-turn", "concurrency": 2}
    report = build_report(summarize(results, 1.0), {}, config, "m", turns=t)["multi_turn"]
    assert [x["ttft_ms"]["p50"] for x in report["turns"]] == [pytest.approx(400), pytest.approx(150),
                                                              pytest.approx(50)]
    assert report["later_turns"]["prefix_cache"]["hit_rate"] == pytest.approx(0.8)
    assert report["turns_not_sent"] == 1
    text = format_table(summarize(results, 1.0), {}, config, "m", turns=t)
    assert "turns 2+                    80.0% (496 of 620 prompt tokens)" in text
    assert "turn 1                      0.0% (0 of 200 prompt tokens)" in text


def test_usage_cached_tokens_parsing():
    def parse(usage: dict) -> RequestResult:
        r = RequestResult(label="all", send_time=0.0)
        read_usage(usage, r)
        return r

    r = parse({"prompt_tokens": 90, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 64}})
    assert (r.prompt_tokens, r.output_tokens, r.cached_tokens) == (90, 4, 64)
    assert parse({"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 0}}).cached_tokens == 0
    for details in (None, {}, {"cached_tokens": None}, {"cached_tokens": "5"}, {"cached_tokens": True}):
        assert parse({"prompt_tokens": 9, "prompt_tokens_details": details}).cached_tokens is None  # vLLM: null


# ---- SLO parsing ---------------------------------------------------------------------------------

def test_slo_parse_units():
    slo = SLO.parse("ttft=500ms,itl=50ms,e2e=2s")
    assert (slo.ttft_s, slo.itl_s, slo.e2e_s, slo.tpot_s) == (pytest.approx(0.5), pytest.approx(0.05), 2.0, None)
    assert slo.as_ms() == {"ttft": pytest.approx(500), "itl": pytest.approx(50), "e2e": pytest.approx(2000)}
    other = SLO.parse(" tpot = 20 , e2el=1.5s, itl=250us ")  # bare number = ms (vLLM); e2el alias
    assert other.tpot_s == pytest.approx(0.02) and other.e2e_s == 1.5 and other.itl_s == pytest.approx(250e-6)
    assert SLO.parse("").empty and not slo.empty


@pytest.mark.parametrize("text, match", [
    ("latency=5ms", "ttft, tpot, itl, e2e"),
    ("ttft", "KEY=VALUE"),
    ("ttft=fast", "unit us, ms or s"),
    ("ttft=5min", "unit us, ms or s"),
    ("ttft=0ms", "> 0"),
    ("ttft=1ms,ttft=2ms", "twice"),
])
def test_slo_parse_errors(text, match):
    with pytest.raises(ValueError, match=match):
        SLO.parse(text)


# ---- what counts as a chunk -----------------------------------------------------------------------

def test_sse_event_data():  # the events themselves are split by xpyd.api.sse (tests/unit/test_sse.py)
    assert parse_event(b"[DONE]") is DONE
    assert parse_event(b'{"a": 1}') == {"a": 1}
    for bad in (b"{not json", b"[1, 2]", b"\xff"):
        with pytest.raises(_StreamFailure) as e:
            parse_event(bad)
        assert e.value.kind == "bad_response"


def test_chunk_text_ignores_role_empty_and_usage_chunks():
    chat, comp = Endpoint.CHAT, Endpoint.COMPLETIONS
    assert chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, chat) == ""
    assert chunk_text({"choices": [{"delta": {"content": "Hi"}}]}, chat) == "Hi"
    assert chunk_text({"choices": [{"delta": {}, "finish_reason": "length"}]}, chat) == ""
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}, comp) == ""
    assert chunk_text({"choices": [{"text": " the"}]}, comp) == " the"
    assert chunk_text({"choices": [{"text": ""}]}, comp) == ""
