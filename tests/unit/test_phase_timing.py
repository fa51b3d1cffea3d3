"""Where an answer's time went (xpyd.api.phases): the arithmetic (each side's phases add up exactly to what it
measured), the wire form, a worker's stamps and clock, the proxy's part and the join, the histograms, and what
xpyd bench makes of them against the client's TTFT."""

from __future__ import annotations

import json

import pytest

from tests.unit.test_metrics import parse, value
from xpyd.api.phases import (
    DecodePhases, PrefillPhases, ProxyPhases, TTFT_PHASES, offsets_us, spans_us, ttft_split,
)
from xpyd.api.timing import COMMENT_PREFIX, WorkerTiming, decode_timing, timing_of_comment
from xpyd.bench.client import RequestResult
from xpyd.bench.metrics import summarize
from xpyd.bench.phases import TTFT_KEYS, RequestPhases, summarize_phases
from xpyd.bench.report import build_report, format_table, request_records
from xpyd.proxy.metrics import ProxyMetrics
from xpyd.proxy.phases import proxy_phases
from xpyd.proxy.relay import answer_timing
from xpyd.proxy.worker_api import FirstToken, Usage
from xpyd.worker.metrics import WorkerMetrics
from xpyd.worker.phases import PhaseStamps
from xpyd.worker.timing import AnswerClock

PREFILL = PrefillPhases(parse_us=300, queue_us=2_000, compute_us=40_000, respond_us=200)  # 42.5 ms
DECODE = DecodePhases(parse_us=250, wait_us=41_000, transfer_us=3_000, queue_us=500, step_us=9_000, respond_us=100)


# --- the arithmetic ------------------------------------------------------------------------------------------

def test_spans_add_up_exactly_to_the_last_stamp():
    stamps = (10.0000004, 10.0123456, 10.0123457, 10.5)
    spans = spans_us(10.0, *stamps)
    assert sum(spans) == offsets_us(10.0, *stamps)[-1] == 500_000
    assert spans == [0, 12_346, 0, 487_654]  # (12,345.6 us rounds up; the last takes up the rest)


def test_a_stamp_before_the_previous_one_is_a_zero_phase_not_a_negative_one():
    assert spans_us(0.0, 0.002, 0.001, 0.003) == [2_000, 0, 1_000]


def test_the_proxy_splits_its_ttft_and_names_the_rest_network():
    first = FirstToken("a", None, Usage(3, 1), WorkerTiming(ttft_us=42_500, prefill=PREFILL), span=(1.001, 1.0455))
    p = proxy_phases(1.0, first, 1.046)
    assert (p.ingress_us, p.prefill_call_us, p.egress_us) == (1_000, 44_500, 500)
    assert p.ttft_us == 46_000
    assert p.network_us == 44_500 - PREFILL.total_us == 2_000
    split = ttft_split(PREFILL, p)
    assert list(split) == [f"{side}.{phase}" for side, phase in TTFT_PHASES]
    assert sum(split.values()) == p.ttft_us  # exactly: network is the remainder of the call


def test_without_prefills_own_time_the_network_is_unknown_and_there_is_no_split():
    p = proxy_phases(1.0, FirstToken("a", None, Usage(3, 1), span=(1.001, 1.0455)), 1.046)
    assert p.network_us is None and ttft_split(PREFILL, p) is None
    assert proxy_phases(1.0, FirstToken("a", None, Usage(3, 1)), 1.046) is None  # the call was not timed


# --- the wire form -------------------------------------------------------------------------------------------

def test_phases_travel_in_the_timing_and_absent_ones_are_left_out():
    proxy = ProxyPhases(ingress_us=1, prefill_call_us=2, egress_us=3, network_us=-1)  # (a clock rate: shown)
    t = WorkerTiming(ttft_us=5, prefill=PREFILL, decode=DECODE, proxy=proxy)
    assert timing_of_comment(t.comment()) == t
    plain = json.loads(WorkerTiming(ttft_us=5).to_json())
    assert plain == {"v": 3, "ttft_us": 5, "gaps_us": [], "gaps": 0}
    assert decode_timing('{"v":1,"ttft_us":5}') == WorkerTiming(v=1, ttft_us=5)  # a version 1 line still reads


@pytest.mark.parametrize("doc", [
    {"prefill": {"parse_us": -1, "queue_us": 0, "compute_us": 0, "respond_us": 0}},
    {"decode": {"parse_us": 1}},  # phases missing
    {"proxy": {"ingress_us": 0, "prefill_call_us": 0, "egress_us": 0, "network_us": -(1 << 41)}},
])
def test_a_malformed_phase_is_a_value_error(doc):
    with pytest.raises(ValueError):
        timing_of_comment(COMMENT_PREFIX + json.dumps({"ttft_us": 1, **doc}).encode())


# --- a worker's stamps and clock -----------------------------------------------------------------------------

def test_a_prefill_workers_phases_add_up_to_its_ttft():
    stamps = PhaseStamps()
    stamps.mark("scheduled", 10.004)
    stamps.mark("scheduled", 10.009)  # (a later chunk: the first one counts)
    stamps.mark("sampled", 10.050)
    recorded = []
    clock = AnswerClock(arrived=10.0, wanted=True)
    clock.follow("prefill", stamps, 10.001, recorded.append)
    clock.chunk(10.0512)
    t = clock.timing()
    assert t.prefill == PrefillPhases(parse_us=1_000, queue_us=3_000, compute_us=46_000, respond_us=1_200)
    assert t.prefill.total_us == t.ttft_us == 51_200
    assert recorded == [t.prefill] and t.decode is None
    clock.chunk(10.06)
    assert recorded == [t.prefill]  # recorded once


def test_a_decode_workers_phases_add_up_to_its_first_chunk():
    stamps = PhaseStamps()
    for name, at in (("pull_started", 0.041), ("landed", 0.044), ("step_started", 0.0445), ("step_ended", 0.0535)):
        stamps.mark(name, at)
    clock = AnswerClock(arrived=0.0, wanted=False)
    recorded = []
    clock.follow("decode", stamps, 0.00025, recorded.append)
    clock.chunk(0.0536)
    assert recorded == [DecodePhases(parse_us=250, wait_us=40_750, transfer_us=3_000, queue_us=500, step_us=9_000,
                                     respond_us=100)]
    assert recorded[0].total_us == 53_600


def test_a_request_that_never_reached_a_point_has_no_phases():
    stamps = PhaseStamps()
    stamps.mark("pull_started", 1.0)  # (ended by prefill's token: never decoded)
    assert stamps.decode(0.0, 0.1, 2.0) is None and stamps.prefill(0.0, 0.1, 2.0) is None
    recorded = []
    clock = AnswerClock(arrived=0.0)
    clock.follow("decode", stamps, 0.1, recorded.append)
    clock.chunk(2.0)
    assert recorded == [] and clock.timing().decode is None


# --- the join and the histograms -----------------------------------------------------------------------------

def test_the_proxy_joins_the_three_sides():
    proxy = ProxyPhases(ingress_us=1_000, prefill_call_us=44_500, egress_us=500, network_us=2_000)
    first = FirstToken("a", None, Usage(3, 1), WorkerTiming(ttft_us=42_500, prefill=PREFILL))
    decoded = WorkerTiming(ttft_us=53_950, gaps_us=(7,), gaps=1, decode=DECODE)
    assert answer_timing(first, decoded, proxy) == WorkerTiming(ttft_us=42_500, gaps_us=(7,), gaps=1,
                                                                prefill=PREFILL, decode=DECODE, proxy=proxy)
    assert answer_timing(first, None, None) == WorkerTiming(ttft_us=42_500, prefill=PREFILL)


def test_the_proxy_records_its_phases_once_per_answer():
    m = ProxyMetrics()
    timer = m.request("/v1/completions")
    first = FirstToken("a", None, Usage(3, 1), WorkerTiming(prefill=PREFILL),
                       span=(timer._start + 0.001, timer._start + 0.050))
    timer.written(first)
    timer.written(first)
    _, v = parse(m.render())
    for phase in ("ingress", "prefill_call", "network", "egress"):
        assert value(v, "xpyd_proxy_phase_seconds_count", phase=phase) == 1
    assert value(v, "xpyd_proxy_phase_seconds_sum", phase="prefill_call") == pytest.approx(0.049)
    assert value(v, "xpyd_proxy_phase_seconds_sum", phase="network") == pytest.approx(0.049 - 0.0425)
    timer.end("ok")


@pytest.mark.parametrize("role, phases", [("prefill", PREFILL), ("decode", DECODE)])
def test_a_worker_records_its_roles_phases(role, phases):
    m = WorkerMetrics(role)
    m.observe_phases(phases)
    _, v = parse(m.render())
    for name in phases.__struct_fields__:
        assert value(v, "xpyd_request_phase_seconds_sum", role=role, phase=name[:-3]) == \
            pytest.approx(getattr(phases, name) / 1e6)
    queued = v.get(("vllm:request_queue_time_seconds_count", (("engine", "0"), ("model_name", ""))))
    assert queued == (1 if role == "prefill" else 0)


# --- xpyd bench ----------------------------------------------------------------------------------------------

def _result(client_ttft_s: float, proxy: ProxyPhases | None, send: float = 100.0) -> RequestResult:
    chunks = [send + client_ttft_s, send + client_ttft_s + 0.010]
    return RequestResult(label="fixed", send_time=send, chunk_times=chunks, end_time=chunks[-1] + 0.001,
                         output_tokens=2, worker_timing=WorkerTiming(ttft_us=PREFILL.total_us, gaps=0,
                                                                     prefill=PREFILL, decode=DECODE, proxy=proxy))


PROXY = ProxyPhases(ingress_us=1_000, prefill_call_us=44_500, egress_us=500, network_us=2_000)  # 46 ms


def test_bench_splits_each_requests_ttft_and_names_what_is_left():
    p = RequestPhases.of(_result(0.0465, PROXY))
    assert list(p.ttft_s) == list(TTFT_KEYS)
    assert p.sum_s == pytest.approx(0.046) and p.other_s == pytest.approx(0.0005)
    assert p.sum_s + p.other_s == pytest.approx(p.client_ttft_s)
    assert p.decode_s["step"] == pytest.approx(0.009) and p.client_first_gap_s == pytest.approx(0.010)
    assert RequestPhases.of(_result(0.0465, None)) is None


def test_bench_summarizes_and_reports_the_phases():
    results = [_result(0.0465, PROXY), _result(0.0470, PROXY), _result(0.05, None)]
    s = summarize_phases(results)
    assert (s.requests, s.missing) == (2, 1)
    assert s.ttft["prefill.compute"].p50 == pytest.approx(40.0)
    assert s.sum.p50 == pytest.approx(46.0) and s.client_ttft.p50 == pytest.approx(46.75)
    assert s.sum_over_client_p50 == pytest.approx(46.0 / 46.75)
    assert s.decode["transfer"].p50 == pytest.approx(3.0)
    config = {"url": "http://x", "endpoint": "completions", "workload": "fixed", "concurrency": 2}
    summary = summarize(results, 1.0)
    report = build_report(summary, {}, config, "m", phases=s)
    assert report["phases"]["sum_over_client_ttft_p50"] == pytest.approx(46.0 / 46.75)
    assert report["phases"]["ttft_ms"]["proxy.network"]["p50"] == pytest.approx(2.0)
    assert "phases" not in build_report(summary, {}, config, "m")
    table = format_table(summary, {}, config, "m", phases=s)
    assert "where the time went" in table and "prefill.queue" in table and "decode.transfer" in table
    records = request_records(results, 100.0)
    assert records[0]["phases"]["sum_ms"] == pytest.approx(46.0) and records[2]["phases"] is None
    assert summarize_phases([_result(0.05, None)]) is None
