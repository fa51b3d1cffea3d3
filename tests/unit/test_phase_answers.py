"""Where the time went beyond a streamed P/D answer (xpyd.api.phases): a JSON answer (the proxy's ``rest``),
several choices (``choices``), a colocated worker (its parse, queue, compute, [rest], respond and first decode
step), their histograms, the joined timing the client gets, and xpyd bench's reading of them."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.unit.test_choices import _req, _stream
from tests.unit.test_metrics import parse, value
from xpyd.api.choices import join_streams, split
from xpyd.api.openai import RequestKind
from xpyd.api.phases import ColocatedPhases, DecodePhases, PrefillPhases, ProxyPhases, StepPhases, ttft_split
from xpyd.api.responses import SSE_DONE, has_text, sse, stream_chunk
from xpyd.api.timing import WorkerTiming, decode_timing, timing_of_comment
from xpyd.bench.client import Endpoint, RequestResult, StreamingClient, answer_text
from xpyd.bench.metrics import RequestLatency
from xpyd.bench.phases import RequestPhases, summarize_phases
from xpyd.bench.workload import RequestSpec
from xpyd.proxy.metrics import ProxyMetrics
from xpyd.proxy.phases import colocated_own_us, joined, proxy_phases, split as proxy_split
from xpyd.proxy.worker_api import FirstToken, Usage
from xpyd.worker.metrics import WorkerMetrics
from xpyd.worker.phases import PhaseStamps
from xpyd.worker.timing import AnswerClock

PREFILL = PrefillPhases(parse_us=300, queue_us=2_000, compute_us=40_000, respond_us=200)  # 42.5 ms
DECODE = DecodePhases(parse_us=250, wait_us=41_000, transfer_us=3_000, queue_us=500, step_us=9_000, respond_us=100)


def _first(span=(1.001, 1.0455)) -> FirstToken:
    return FirstToken("a", None, Usage(3, 1), WorkerTiming(ttft_us=42_500, prefill=PREFILL), span=span)


# --- the proxy's split ---------------------------------------------------------------------------------------

def test_a_json_answer_splits_its_time_to_the_answer_with_the_wait_for_its_last_token():
    p = proxy_phases(1.0, _first(), 1.2003, rest=1.2)
    assert (p.ingress_us, p.prefill_call_us, p.rest_us, p.egress_us, p.choices_us) == (1_000, 44_500, 154_500, 300,
                                                                                       None)
    assert p.ttft_us == 200_300 and p.network_us == 2_000
    split = ttft_split(PREFILL, p)
    assert list(split) == ["proxy.ingress", "prefill.parse", "prefill.queue", "prefill.compute", "prefill.respond",
                           "proxy.network", "proxy.rest", "proxy.egress"]
    assert sum(split.values()) == p.ttft_us


def test_several_choices_name_the_wait_for_the_others_first_tokens():
    p = proxy_phases(1.0, _first(), 1.08, choices=1.07)
    assert (p.choices_us, p.egress_us, p.ttft_us) == (24_500, 10_000, 80_000)
    split = ttft_split(PREFILL, p)
    assert list(split)[-3:] == ["proxy.network", "proxy.choices", "proxy.egress"]
    assert sum(split.values()) == p.ttft_us
    # another prompt's first choice may answer before choice 0: its wait is none, never negative
    early = proxy_phases(1.0, _first(), 1.05, choices=1.02)
    assert early.choices_us == 0 and early.ttft_us == 50_000


def test_a_colocated_call_splits_as_a_prefill_call():
    own = ColocatedPhases(parse_us=500, queue_us=1_000, compute_us=30_000, respond_us=500)
    p = proxy_split(2.0, (2.0005, 2.0345), 2.035, colocated_own_us(WorkerTiming(colocated=own)))
    assert (p.ingress_us, p.prefill_call_us, p.network_us, p.egress_us) == (500, 34_000, 2_000, 500)
    split = ttft_split(own, p)
    assert list(split) == ["proxy.ingress", "colocated.parse", "colocated.queue", "colocated.compute",
                           "colocated.respond", "proxy.network", "proxy.egress"]
    assert sum(split.values()) == p.ttft_us == 35_000
    assert colocated_own_us(None) is None and colocated_own_us(WorkerTiming()) is None


def test_the_timer_records_a_json_answers_phases_once():
    m = ProxyMetrics()
    timer = m.request("/v1/completions")
    first = _first(span=(timer.received + 0.001, timer.received + 0.050))
    timer.decoded()
    timer.answered(first)
    timer.answered(first)
    assert timer.phases.rest_us is not None and timer.phases.ttft_us >= 50_000
    _, v = parse(m.render())
    for phase in ("ingress", "prefill_call", "network", "rest", "egress"):
        assert value(v, "xpyd_proxy_phase_seconds_count", phase=phase) == 1
    assert value(v, "xpyd_proxy_phase_seconds_count", phase="choices") == 0
    timer.end("ok")


def test_the_client_gets_each_sides_phases_without_gaps():
    proxy = ProxyPhases(ingress_us=1, prefill_call_us=2, egress_us=3, network_us=1, rest_us=4)
    t = joined(_first(), WorkerTiming(ttft_us=9, gaps_us=(5, 6), gaps=2, decode=DECODE), proxy)
    assert t == WorkerTiming(prefill=PREFILL, decode=DECODE, proxy=proxy)
    assert decode_timing(t.header()) == t and "\n" not in t.header()
    assert joined(FirstToken("a", None, Usage(3, 1)), None, None) == WorkerTiming()


# --- a colocated worker --------------------------------------------------------------------------------------

def _colocated_stamps() -> PhaseStamps:
    stamps = PhaseStamps()
    for name, at in (("scheduled", 10.004), ("sampled", 10.034), ("step_started", 10.036), ("step_ended", 10.046),
                     ("finished", 10.1)):
        stamps.mark(name, at)
    return stamps


def test_a_colocated_stream_splits_its_ttft_and_then_its_first_decode_step():
    recorded = []
    clock = AnswerClock(arrived=10.0, wanted=True)
    clock.follow("colocated", _colocated_stamps(), 10.001, recorded.append)
    clock.chunk(10.0345)
    ttft = ColocatedPhases(parse_us=1_000, queue_us=3_000, compute_us=30_000, respond_us=500)
    assert recorded == [ttft] and ttft.total_us == clock.timing().ttft_us == 34_500
    clock.chunk(10.0462)
    clock.chunk(10.06)
    step = StepPhases(queue_us=2_000, step_us=10_000, respond_us=200)
    assert recorded == [ttft, step]  # the first decode step once, at the second chunk
    t = clock.timing()
    assert t.colocated.step == step and t.colocated.total_us == t.ttft_us and t.prefill is None


def test_a_colocated_json_answer_has_the_rest_of_its_tokens_before_respond():
    recorded = []
    clock = AnswerClock(arrived=10.0, wanted=True)
    clock.follow("colocated", _colocated_stamps(), 10.001, recorded.append)
    clock.answered()  # (now: later than every stamp)
    t = decode_timing(clock.header())
    c = t.colocated
    assert c.rest_us == 66_000 and c.step is None and c.total_us == t.ttft_us
    assert recorded == [c]


def test_a_colocated_worker_records_its_phases_and_vllms_queue_and_prefill_times():
    m = WorkerMetrics("colocated")
    m.observe_phases(ColocatedPhases(parse_us=1, queue_us=2, compute_us=3, respond_us=4))
    m.observe_phases(StepPhases(queue_us=5, step_us=6, respond_us=7))
    _, v = parse(m.render())
    for phase, us in (("parse", 1), ("queue", 2), ("compute", 3), ("respond", 4), ("decode_queue", 5),
                      ("decode_step", 6), ("decode_respond", 7)):
        assert value(v, "xpyd_request_phase_seconds_sum", role="colocated", phase=phase) == pytest.approx(us / 1e6)
    assert value(v, "xpyd_request_phase_seconds_count", role="colocated", phase="rest") == 0  # (streamed: none)
    assert value(v, "vllm:request_queue_time_seconds_count", engine="0", model_name="") == 1


def test_colocated_phases_travel_without_the_ones_that_did_not_apply():
    c = ColocatedPhases(parse_us=1, queue_us=2, compute_us=3, respond_us=4)
    t = WorkerTiming(ttft_us=10, colocated=c)
    assert json.loads(t.to_json())["colocated"] == {"parse_us": 1, "queue_us": 2, "compute_us": 3, "respond_us": 4}
    assert timing_of_comment(t.comment()) == t


# --- several choices' stream ---------------------------------------------------------------------------------

def test_a_joined_stream_says_when_its_first_text_went_and_ends_with_its_trailer():
    req = _req(n=2, stream=True, kind=RequestKind.CHAT)
    kids = split(req)
    chat = RequestKind.CHAT

    def child(text: str) -> list[bytes]:
        return [sse(stream_chunk("x", 1, "m", chat, None, None, role=True)), sse(stream_chunk("x", 1, "m", chat, text,
                None)), sse(stream_chunk("x", 1, "m", chat, None, "length")), SSE_DONE]

    said = []

    async def run() -> list[bytes]:
        out = []
        async for block in join_streams(req, [(kids[0], _stream(child("A"))), (kids[1], _stream(child("B")))],
                                        ("x", 1, "m"), first_text=lambda: said.append(len(out)),
                                        trailer=lambda: b": trailer\n\n"):
            out.append(block)
        return out

    out = asyncio.run(run())
    assert out[-2:] == [b": trailer\n\n", SSE_DONE]
    assert len(said) == 1 and has_text(json.loads(out[said[0]][6:]))  # (said just before its block was handed out)
    assert not any(has_text(json.loads(b[6:])) for b in out[:said[0]])


# --- xpyd bench ----------------------------------------------------------------------------------------------

def test_bench_asks_for_json_answers_and_several_choices():
    c = StreamingClient("http://x", Endpoint.COMPLETIONS, "m", timeout_s=1, max_connections=1, stream=False, n=3)
    body = c.body(RequestSpec(prompt="hi", max_tokens=4))
    assert body["stream"] is False and "stream_options" not in body and body["n"] == 3
    assert answer_text({"message": {"content": "hey"}}, Endpoint.CHAT) == "hey"
    json_answer = RequestResult(label="fixed", send_time=1.0, chunk_times=[1.5], end_time=1.5, output_tokens=8,
                                streamed=False)
    lat = RequestLatency.of(json_answer)
    assert lat.ttft_s == lat.e2e_s == 0.5 and lat.tpot_s is None  # (no TPOT: the tokens came at once)
    assert answer_text({"text": "yo"}, Endpoint.COMPLETIONS) == "yo" and answer_text(None, Endpoint.CHAT) == ""


def test_bench_splits_a_json_answer_and_a_colocated_stream():
    proxy = ProxyPhases(ingress_us=1_000, prefill_call_us=44_500, egress_us=500, network_us=2_000, rest_us=150_000)
    answer = RequestResult(label="fixed", send_time=100.0, chunk_times=[100.1965], end_time=100.1965,
                           worker_timing=WorkerTiming(prefill=PREFILL, decode=DECODE, proxy=proxy))
    p = RequestPhases.of(answer)
    assert p.sum_s == pytest.approx(0.196) and p.other_s == pytest.approx(0.0005)
    assert "proxy.rest" in p.ttft_s and p.client_first_gap_s is None and p.decode_s["transfer"] == pytest.approx(0.003)
    own = ColocatedPhases(parse_us=500, queue_us=1_000, compute_us=30_000, respond_us=500,
                          step=StepPhases(queue_us=100, step_us=9_000, respond_us=100))
    cproxy = ProxyPhases(ingress_us=500, prefill_call_us=34_000, egress_us=500, network_us=2_000)
    stream = RequestResult(label="fixed", send_time=100.0, chunk_times=[100.0355, 100.045], end_time=100.05,
                           worker_timing=WorkerTiming(ttft_us=32_000, colocated=own, proxy=cproxy))
    s = summarize_phases([stream, stream])
    assert list(s.ttft)[1] == "colocated.parse" and s.sum.p50 == pytest.approx(35.0)
    assert s.decode["step"].p50 == pytest.approx(9.0) and s.client_first_gap.p50 == pytest.approx(9.5)
