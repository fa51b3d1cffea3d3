"""xpyd bench's per-worker report from canned request records: the x-xpyd-workers header parsed, each
worker's requests, goodput, SLO attainment and TTFT/TPOT with known answers, per prefill and per decode
worker; no per-worker section when the server named no worker."""

from __future__ import annotations

import pytest

from xpyd.bench.client import RequestResult, parse_workers
from xpyd.bench.metrics import SLO, summarize, summarize_workers
from xpyd.bench.report import build_report, format_table, request_records

DURATION = 2.0
SLO_ = SLO.parse("ttft=200ms,tpot=200ms")
CONFIG = {"url": "http://x", "endpoint": "completions", "workload": "random", "concurrency": 4,
          "slo_ms": SLO_.as_ms()}


def ok(send: float, chunks: list[float], workers: dict | None) -> RequestResult:
    return RequestResult(label="all", send_time=send, chunk_times=chunks, end_time=chunks[-1],
                         output_tokens=len(chunks), prompt_tokens=10, workers=workers)


def records() -> list[RequestResult]:
    return [
        ok(0.0, [0.1, 0.2, 0.3], {"prefill": "pA", "decode": "dA"}),  # ttft 100, tpot 100: good, 3 tokens
        ok(0.0, [0.5, 0.6], {"prefill": "pA", "decode": "dB"}),  # ttft 500: misses ttft
        RequestResult(label="all", send_time=0.2, end_time=0.4, error="http_500", error_detail="boom",
                      workers={"prefill": "pB", "decode": "dB"}),  # failed after dispatch
        RequestResult(label="all", send_time=0.2, end_time=0.3, error="connection", error_detail="refused"),
        ok(1.0, [1.05, 1.35], {"prefill": "pB", "decode": "dA"}),  # ttft 50, tpot 300: misses tpot
    ]


def test_parse_workers():
    assert parse_workers("prefill=p1a2b3c4d, decode=d0f0f0f0f") == {"prefill": "p1a2b3c4d", "decode": "d0f0f0f0f"}
    assert parse_workers("colocated=c12345678") == {"colocated": "c12345678"}
    assert parse_workers(None) is None and parse_workers("") is None
    assert parse_workers("nonsense, router=r1, decode=") is None  # nothing a role xpyd names
    assert parse_workers("decode=d1, junk") == {"decode": "d1"}
    assert parse_workers("decode=" + "x" * 65) is None  # not a name: too long


def test_per_worker_summaries_with_known_answers():
    w = summarize_workers(records(), DURATION, SLO_)
    assert w is not None and w.unattributed == 1
    assert list(w.roles) == ["prefill", "decode"] and list(w.roles["prefill"]) == ["pA", "pB"]
    pa, pb = w.roles["prefill"]["pA"], w.roles["prefill"]["pB"]
    da, db = w.roles["decode"]["dA"], w.roles["decode"]["dB"]
    assert (pa.completed, pa.failed, pa.good, pa.slo_attainment) == (2, 0, 1, 0.5)
    assert (pa.goodput_requests_per_s, pa.goodput_output_tokens_per_s) == (0.5, 1.5)
    assert (pa.ttft.p50, pa.ttft.p99) == (pytest.approx(300.0), pytest.approx(496.0))  # 100 and 500, linear
    assert (pa.tpot.p50, pa.tpot.p99) == (pytest.approx(100.0), pytest.approx(100.0))
    assert (pb.completed, pb.failed, pb.good, pb.slo_attainment, pb.errors) == (1, 1, 0, 0.0, {"http_500": 1})
    assert (pb.ttft.p50, pb.tpot.p50, pb.goodput_requests_per_s) == (pytest.approx(50.0), pytest.approx(300.0), 0.0)
    assert (da.completed, da.failed, da.good, da.slo_attainment) == (2, 0, 1, 0.5)
    assert (da.goodput_requests_per_s, da.goodput_output_tokens_per_s) == (0.5, 1.5)
    assert (da.ttft.p50, da.ttft.p99) == (pytest.approx(75.0), pytest.approx(99.5))
    assert (db.completed, db.failed, db.good, db.slo_attainment) == (1, 1, 0, 0.0)
    # The run's own numbers are unchanged: 5 sent, 1 good.
    assert summarize(records(), DURATION, SLO_).slo_attainment == 0.2


def test_report_json_and_table_have_a_row_per_worker():
    results = records()
    overall = summarize(results, DURATION, SLO_)
    w = summarize_workers(results, DURATION, SLO_)
    report = build_report(overall, {}, CONFIG, "m", workers=w)
    assert report["workers"]["unattributed"] == 1
    assert set(report["workers"]) == {"prefill", "decode", "unattributed"}
    row = report["workers"]["decode"]["dA"]
    assert {k: row[k] for k in ("requests", "completed", "failed", "good", "slo_attainment",
                                "goodput_requests_per_s", "goodput_output_tokens_per_s", "output_tokens_per_s")} == {
        "requests": 2, "completed": 2, "failed": 0, "good": 1, "slo_attainment": 0.5,
        "goodput_requests_per_s": 0.5, "goodput_output_tokens_per_s": 1.5, "output_tokens_per_s": 2.5}
    assert row["ttft_ms"]["p50"] == pytest.approx(75.0) and row["tpot_ms"]["p99"] == pytest.approx(298.0)  # 100 + 0.99 * 200
    assert report["workers"]["prefill"]["pB"]["errors"] == {"http_500": 1}
    table = format_table(overall, {}, CONFIG, "m", workers=w)
    section = table[table.index("--- per worker"):].splitlines()
    assert section[2] == "prefill:" and section[5] == "decode:"
    assert section[3].split() == ["pA", "2", "2/0", "0.500", "1.50", "50.0%", "300.00", "496.00", "100.00", "100.00"]
    assert section[4].split() == ["pB", "2", "1/1", "0.000", "0.00", "0.0%", "50.00", "50.00", "300.00", "300.00"]
    assert section[7].split()[:6] == ["dB", "2", "1/1", "0.000", "0.00", "0.0%"]
    assert "requests no worker was named for: 1" in table
    assert [r["workers"] for r in request_records(results, 0.0)][2:4] == [{"prefill": "pB", "decode": "dB"}, None]


def test_colocated_workers_have_their_own_role():
    results = [ok(0.0, [0.1, 0.2], {"colocated": "c1"}), ok(0.0, [0.1, 0.2], {"colocated": "c2"})]
    w = summarize_workers(results, DURATION, SLO())
    assert list(w.roles) == ["colocated"] and [s.completed for s in w.roles["colocated"].values()] == [1, 1]
    assert w.unattributed == 0
    assert "colocated:" in format_table(summarize(results, DURATION), {}, CONFIG, "m", workers=w)


def test_no_per_worker_section_when_the_server_names_no_worker():
    results = [ok(0.0, [0.1, 0.2], None), RequestResult(label="all", send_time=0.0, end_time=0.1, error="timeout")]
    assert summarize_workers(results, DURATION, SLO_) is None
    overall = summarize(results, DURATION, SLO_)
    assert "workers" not in build_report(overall, {}, CONFIG, "m", workers=None)
    assert "per worker" not in format_table(overall, {}, CONFIG, "m", workers=None)
