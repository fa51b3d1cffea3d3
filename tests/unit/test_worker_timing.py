"""The workers' own timing of an answer: its wire form (xpyd.api.timing), the worker's clock (xpyd.worker.timing),
the SSE parser keeping its comment, how a P/D proxy joins prefill's and decode's (relay.answer_timing), and what
xpyd bench makes of it against the client's times (xpyd.bench.overhead, its report)."""

from __future__ import annotations

import json

import pytest

from xpyd.api.openai import RequestKind
from xpyd.api.sse import SSEParser, sse_data
from xpyd.api.timing import COMMENT_PREFIX, MAX_GAPS, WorkerTiming, decode_timing, timing_of_comment
from xpyd.bench.client import RequestResult
from xpyd.bench.overhead import RequestOverhead, summarize_overhead
from xpyd.bench.metrics import summarize
from xpyd.bench.report import build_report, format_table, request_records
from xpyd.proxy.relay import answer_timing
from xpyd.proxy.worker_api import FirstToken, Usage, parse_first_token
from xpyd.worker.timing import AnswerClock


# --- the wire form -------------------------------------------------------------------------------------------

def test_a_timing_goes_as_one_sse_comment_and_comes_back_equal():
    t = WorkerTiming(ttft_us=1500, gaps_us=(10, 20, 30), gaps=3)
    block = t.comment()
    assert block == b': xpyd-timing {"v":3,"ttft_us":1500,"gaps_us":[10,20,30],"gaps":3}\n\n'
    assert timing_of_comment(block) == t
    assert timing_of_comment(b": keep-alive") is None
    assert decode_timing(t.to_json()) == t


@pytest.mark.parametrize("doc", [
    {"ttft_us": -1},  # negative
    {"gaps_us": [1, 2], "gaps": 1},  # fewer in all than listed
    {"gaps_us": [1] * (MAX_GAPS + 1), "gaps": MAX_GAPS + 1},  # over the cap
    {"gaps_us": "1,2", "gaps": 2},  # not a list
    {"v": 0},
])
def test_a_malformed_timing_is_a_value_error(doc):
    with pytest.raises(ValueError):
        decode_timing(json.dumps(doc))
    with pytest.raises(ValueError):
        timing_of_comment(COMMENT_PREFIX + json.dumps(doc).encode())


# --- the worker's clock --------------------------------------------------------------------------------------

def test_the_clock_is_wanted_only_when_asked():
    assert not AnswerClock.start(None).wanted
    assert not AnswerClock.start("yes").wanted
    assert AnswerClock.start("1").wanted


def test_the_clock_records_the_first_chunk_and_the_gaps_after_it():
    clock = AnswerClock(arrived=10.0)
    for now in (10.25, 10.26, 10.2615, 10.3):
        clock.chunk(now)
    assert clock.timing() == WorkerTiming(ttft_us=250_000, gaps_us=(10_000, 1_500, 38_500), gaps=3)
    assert timing_of_comment(clock.comment()) == clock.timing()


def test_a_long_answer_keeps_its_first_gaps_and_counts_them_all():
    clock = AnswerClock(arrived=0.0)
    n = MAX_GAPS + 10
    for i in range(n + 1):
        clock.chunk(1.0 + i * 0.001)
    t = clock.timing()
    assert (t.gaps, len(t.gaps_us), t.ttft_us) == (n, MAX_GAPS, 1_000_000)
    assert set(t.gaps_us) == {1000}
    assert len(t.comment()) < 40_000
    assert timing_of_comment(t.comment()) == t


def test_a_json_answer_is_timed_when_built():
    clock = AnswerClock(arrived=0.0)
    value = clock.header()
    t = decode_timing(value)
    assert t.ttft_us is not None and t.ttft_us > 0 and (t.gaps, t.gaps_us) == (0, ())
    empty = AnswerClock(arrived=0.0).timing()
    assert empty == WorkerTiming(ttft_us=None)  # nothing written: no TTFT


# --- the SSE parser keeps the comment ------------------------------------------------------------------------

STREAM = (b'data: {"a":1}\n\n: keep-alive\n\n'
          + WorkerTiming(ttft_us=7, gaps_us=(1,), gaps=1).comment()
          + b"data: [DONE]\n\n")


@pytest.mark.parametrize("size", [1, 3, 7, len(STREAM)])
def test_the_parser_keeps_the_last_comment_with_its_prefix_however_split(size):
    parser = SSEParser(keep=COMMENT_PREFIX)
    events = []
    for i in range(0, len(STREAM), size):
        events += parser.feed(STREAM[i:i + size])
    events += parser.close()
    assert events == [b'{"a":1}', b"[DONE]"]  # comments are still no events
    assert timing_of_comment(parser.kept) == WorkerTiming(ttft_us=7, gaps_us=(1,), gaps=1)
    plain = SSEParser()
    plain.feed(STREAM)
    assert plain.kept is None  # kept only when asked


async def test_sse_data_reads_through_the_callers_parser():
    async def chunks():
        yield STREAM

    parser = SSEParser(keep=COMMENT_PREFIX)
    got = [d async for d in sse_data(chunks(), parser=parser)]
    assert got == [b'{"a":1}', b"[DONE]"] and parser.kept is not None


# --- the proxy joins prefill's and decode's -----------------------------------------------------------------

USAGE = Usage(10, 1)
PREFILL = WorkerTiming(ttft_us=900)
DECODE = WorkerTiming(ttft_us=5000, gaps_us=(100, 200), gaps=2)


def test_prefill_wrote_the_first_chunk_decode_the_gaps():
    first = FirstToken("a", None, USAGE, PREFILL)
    assert answer_timing(first, DECODE) == WorkerTiming(ttft_us=900, gaps_us=(100, 200), gaps=2)
    assert answer_timing(first, None) == WorkerTiming(ttft_us=900)  # decode sent none
    assert answer_timing(FirstToken("a", None, USAGE), DECODE) == WorkerTiming(gaps_us=(100, 200), gaps=2)


def test_a_first_token_without_text_leaves_the_first_chunk_to_decode():
    assert answer_timing(FirstToken("", None, USAGE, PREFILL), DECODE) == DECODE
    assert answer_timing(FirstToken("", None, USAGE, PREFILL), None) == WorkerTiming()


def test_an_answer_that_ended_on_prefill_has_its_ttft_only():
    assert answer_timing(FirstToken("a", "length", USAGE, PREFILL), None) == WorkerTiming(ttft_us=900)
    assert answer_timing(FirstToken("", "stop", USAGE, PREFILL), None) == WorkerTiming()


def test_prefills_header_is_read_and_a_broken_one_left_out():
    data = {"choices": [{"text": "a", "finish_reason": None}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    assert parse_first_token(data, RequestKind.COMPLETION, PREFILL.to_json().decode()).timing == PREFILL
    assert parse_first_token(data, RequestKind.COMPLETION, '{"ttft_us": -5}').timing is None
    assert parse_first_token(data, RequestKind.COMPLETION).timing is None


# --- xpyd bench against the client's times ------------------------------------------------------------------

def _result(chunks: list[float], timing: WorkerTiming | None, send: float = 100.0) -> RequestResult:
    return RequestResult(label="fixed", send_time=send, chunk_times=chunks, end_time=chunks[-1] + 0.001,
                         output_tokens=len(chunks), worker_timing=timing)


def test_a_pd_request_matches_decodes_gaps_to_the_clients_last_ones():
    # client: token 1 at +10 ms, then 2..4; decode wrote 2..4 (two gaps of its own)
    r = _result([100.010, 100.030, 100.041, 100.052], WorkerTiming(ttft_us=8_000, gaps_us=(10_000, 10_500), gaps=2))
    o = RequestOverhead.of(r)
    assert o.client_ttft_s == pytest.approx(0.010) and o.worker_ttft_s == pytest.approx(0.008)
    assert o.proxy_ttft_s == pytest.approx(0.002)
    assert o.worker_gaps_s == pytest.approx((0.010, 0.0105))
    assert o.client_gaps_s == pytest.approx((0.011, 0.011))  # not the first gap (0.020: token 1 -> 2)
    assert not o.misaligned


def test_a_capped_list_is_matched_to_the_clients_gaps_from_the_same_offset():
    # 5 gaps at the worker, 2 kept; the client saw one more (P/D): its gaps 1 and 2 are the worker's 0 and 1
    r = _result([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7], WorkerTiming(ttft_us=1, gaps_us=(1, 2), gaps=5), send=0.0)
    o = RequestOverhead.of(r)
    assert len(o.client_gaps_s) == 2 and len(o.worker_gaps_s) == 2


def test_a_request_whose_worker_reports_more_gaps_than_the_client_saw_is_misaligned():
    r = _result([100.01, 100.02], WorkerTiming(ttft_us=1, gaps_us=(1, 2), gaps=2))
    o = RequestOverhead.of(r)
    assert o.misaligned and o.worker_gaps_s == () and o.client_gaps_s == ()
    assert o.proxy_ttft_s is not None  # its TTFT still counts


def test_no_timing_no_overhead():
    assert RequestOverhead.of(_result([100.01], None)) is None
    failed = _result([100.01], WorkerTiming(ttft_us=1))
    failed.error = "timeout"
    assert RequestOverhead.of(failed) is None
    assert summarize_overhead([_result([100.01], None)]) is None


def test_the_run_is_summarized_over_the_requests_with_a_timing():
    results = [
        _result([100.010, 100.020, 100.030], WorkerTiming(ttft_us=9_000, gaps_us=(10_000,), gaps=1)),
        _result([100.004, 100.014, 100.026], WorkerTiming(ttft_us=2_000, gaps_us=(10_000,), gaps=1)),
        _result([100.01, 100.02], None),
    ]
    o = summarize_overhead(results)
    assert (o.requests, o.missing, o.misaligned) == (2, 1, 0)
    assert o.proxy_ttft.count == 2 and o.proxy_ttft.p50 == pytest.approx(1.5) and o.proxy_ttft.max == pytest.approx(2)
    assert o.worker_itl.p99 == pytest.approx(10.0)
    assert o.client_itl.count == 2 and o.client_itl.max == pytest.approx(12.0)
    assert o.itl_p99_ratio == pytest.approx(o.client_itl.p99 / 10.0)

    summary = summarize(results, 1.0)
    config = {"url": "http://x", "endpoint": "completions", "workload": "fixed", "concurrency": 2}
    report = build_report(summary, {}, config, "m", overhead=o)
    po = report["proxy_overhead"]
    assert (po["requests"], po["missing"], po["misaligned"]) == (2, 1, 0)
    assert po["proxy_ttft_ms"]["p50"] == pytest.approx(1.5) and po["itl_p99_ratio"] == pytest.approx(o.itl_p99_ratio)
    assert "proxy_overhead" not in build_report(summary, {}, config, "m")
    table = format_table(summary, {}, config, "m", overhead=o)
    assert "proxy-added TTFT" in table and "ITL client / worker" in table
    assert "proxy-added" not in format_table(summary, {}, config, "m")
    records = request_records(results, 100.0)
    assert records[0]["worker_timing"]["proxy_ttft_ms"] == pytest.approx(1.0)
    assert records[0]["worker_timing"]["client_itl_ms"] == pytest.approx([10.0])
    assert records[2]["worker_timing"] is None


# --- the flag: off by default, from `xpyd proxy` and `xpyd up` ---------------------------------------------

def test_the_proxy_flag_is_off_by_default_and_passed_by_xpyd_up():
    import argparse

    from xpyd.launcher import up as launcher
    from xpyd.proxy.config import ProxyConfig
    from xpyd.proxy.main import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    assert config_from_args(parser.parse_args(base)).expose_worker_timing is False
    assert config_from_args(parser.parse_args([*base, "--expose-worker-timing"])).expose_worker_timing is True
    with pytest.raises(ValueError, match="expose_worker_timing"):
        ProxyConfig(expose_worker_timing="yes")
    up = argparse.ArgumentParser()
    launcher.add_arguments(up)
    assert "--expose-worker-timing" not in launcher._proxy_options(up.parse_args([]))
    assert "--expose-worker-timing" in launcher._proxy_options(up.parse_args(["--expose-worker-timing"]))


# --- the proxy's relay: decode's comment replaced by the joined timing, or dropped without the flag ------------

class _Timer:
    def __init__(self) -> None:
        self.tokens, self.outcomes = 0, []

    phases = None

    def token(self) -> None:
        self.tokens += 1

    def written(self, first) -> None:
        pass

    def end(self, outcome) -> None:
        self.outcomes.append(outcome)


class _Call:
    """What relay._stream uses of a PDCall: decode's blocks as PDCall.relay gives them (comment last)."""

    request_id = "rid"

    def __init__(self, blocks: list[bytes]) -> None:
        from xpyd.api.identity import ResponseIdentity

        self.identity = ResponseIdentity("cmpl-abc", 1700000000, "m")
        self._blocks = blocks
        self.closed = False

    async def relay(self):
        for b in self._blocks:
            yield b

    async def aclose(self) -> None:
        self.closed = True


@pytest.mark.parametrize("timing", [True, False])
async def test_the_relay_ends_with_the_joined_timing_only_under_the_flag(timing):
    from xpyd.api.openai import parse_request
    from xpyd.proxy.relay import _stream

    req = parse_request(b'{"prompt": "x", "stream": true}', RequestKind.COMPLETION)
    token = b'data: {"id":"cmpl-abc","object":"text_completion","created":1700000000,"model":"m",' \
            b'"choices":[{"index":0,"text":"b","logprobs":null,"finish_reason":"length"}]}\n\n'
    call, timer = _Call([token, DECODE.comment()]), _Timer()
    body = b"".join([b async for b in _stream(call, req, FirstToken("a", None, USAGE, PREFILL), lambda e: None,
                                              lambda e: e, timer, timing)])
    assert body.endswith(b"data: [DONE]\n\n") and call.closed and timer.tokens == 1
    comments = [line for line in body.splitlines() if line.startswith(b":")]
    if timing:
        assert [timing_of_comment(c) for c in comments] == [WorkerTiming(ttft_us=900, gaps_us=(100, 200), gaps=2)]
        assert body.endswith(comments[0] + b"\n\ndata: [DONE]\n\n")
    else:
        assert comments == [] and b"xpyd-timing" not in body
