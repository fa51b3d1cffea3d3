"""Where the time went for every kind of answer, against real processes: sim workers (``--engine sim``, no
simulated time) behind a P/D proxy and a colocated proxy with ``--expose-worker-timing`` (and one of each
without it).

For a JSON answer through the P/D proxy (its ``X-Xpyd-Timing`` header), several choices (streamed and JSON),
a colocated worker (streamed and JSON) and a prompt its decode worker prefilled itself (streamed and JSON), the phases each side measured add up exactly to the time the proxy
measured (its TTFT; a JSON answer: its time to the answer), the worker's own part adds up to the worker's, the
client's time is that sum and a remainder that is never negative, the histograms count every request, and
``xpyd bench`` (streamed, ``--no-stream``, ``--n``) splits every request it sent.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port, start_pd_and_colocated
from tests.integration.test_proxy_worker_timing import PROFILE, _phase_counts
from xpyd.api.phases import ttft_split
from xpyd.api.timing import TIMING_HEADER, WorkerTiming, decode_timing, timing_of_comment
from xpyd.bench import main as bench_main

pytestmark = pytest.mark.timeout(600)

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smollm_dir: Path):
    work = tmp_path_factory.mktemp("phases-answers")
    profile = work / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    options = ["--model", str(smollm_dir), "--engine", "sim", "--sim-profile", str(profile), "--sim-speedup", "inf",
               "--threads", "1", "--batch-size", "8", "--max-model-len", "512", "--block-size", "16"]
    c = Cluster(work)
    try:
        urls = start_pd_and_colocated(c, options, pd_proxy=["--expose-worker-timing"],
                                      co_proxy=["--expose-worker-timing"])
        pair = ["--prefill", urls["prefill"], "--decode", urls["decode"]]
        for name, extra in (("pd-plain", pair), ("co-plain", ["--colocated", urls["colocated"]]),
                            ("pd-local", [*pair, "--local-prefill-max-tokens", "256", "--expose-worker-timing"])):
            urls[name] = f"http://127.0.0.1:{free_port()}"
            c.start(name, ["proxy", "--port", urls[name].rsplit(":", 1)[1], *extra], urls[name])
        c.wait_healthy()
        yield urls
    finally:
        c.stop()


def post(url: str, body: dict, path: str = "/v1/completions") -> tuple[dict, bytes, float]:
    """(the answer's headers, its body, the client's time to the whole answer in microseconds)."""
    req = urllib.request.Request(url + path, data=json.dumps({"max_tokens": 6, "ignore_eos": True, **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    began = time.perf_counter()
    with urllib.request.urlopen(req, timeout=60) as r:
        raw = r.read()
        assert r.status == 200, raw[:300]
        return dict(r.headers), raw, (time.perf_counter() - began) * 1e6


def text_chunks(raw: bytes) -> int:
    """The stream's content chunks with text (a token may have none: its bytes wait for the next token's)."""
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith(b"data: {")]
    return sum(1 for e in events for c in e.get("choices", ()) if c.get("text"))


def streamed_timing(raw: bytes) -> WorkerTiming:
    comments = [line for line in raw.splitlines() if line.startswith(b": xpyd-timing ")]
    assert len(comments) == 1, raw[-500:]
    return timing_of_comment(comments[0])


def check_split(t: WorkerTiming, client_us: float | None = None) -> dict[str, int]:
    """Each side's phases add up: the split to the proxy's time, the worker's part to the worker's own."""
    worker = t.prefill if t.prefill is not None else t.colocated
    split = ttft_split(worker, t.proxy)
    assert split is not None, t
    assert sum(split.values()) == t.proxy.ttft_us  # exactly
    assert all(v >= 0 for k, v in split.items() if k != "proxy.network"), split
    assert t.proxy.network_us == t.proxy.prefill_call_us - worker.total_us >= 0
    assert split[next(k for k in split if k.endswith(".compute"))] > 0
    if client_us is not None:
        assert t.proxy.ttft_us <= client_us  # (the proxy's interval lies inside the client's)
    return split


def bench(url: str, out: Path, *extra: str, requests: int = 8) -> dict:
    parser = argparse.ArgumentParser(prog="xpyd bench")
    bench_main.add_arguments(parser)
    argv = ["--url", url, "--num-requests", str(requests), "--concurrency", "4", "--input-len", "24",
            "--output-len", "6", "--json", str(out), "--no-progress", "--include-requests", *extra]
    assert bench_main.run(parser.parse_args(argv)) == 0
    report = json.loads(out.read_text())
    assert (report["completed"], report["failed"]) == (requests, 0), report["errors"]
    return report


def check_bench(report: dict, keys: set[str], every: bool = True) -> None:
    """Every request (or at least half: a streamed P/D answer whose first token had no text has none) is split,
    its sum and the client's remainder make up the client's TTFT, and the run's ratio is at most 1."""
    split = [r for r in report["requests"] if r["phases"] is not None]
    assert len(split) == report["phases"]["requests"]
    assert len(split) == len(report["requests"]) if every else len(split) >= len(report["requests"]) // 2
    for r in split:
        p = r["phases"]
        client_ttft_ms = (r["chunks_s"][0] - r["send_s"]) * 1000
        assert keys <= set(p["ttft_ms"]), p["ttft_ms"]
        assert p["sum_ms"] == pytest.approx(sum(p["ttft_ms"].values()))
        assert p["sum_ms"] + p["client_other_ms"] == pytest.approx(client_ttft_ms)
        assert 0 <= p["client_other_ms"] < client_ttft_ms
    assert 0 < report["phases"]["sum_over_client_ttft_p50"] <= 1


# --- a JSON answer through the P/D proxy ---------------------------------------------------------------------

def test_a_json_answer_says_where_its_time_to_the_answer_went(cluster):
    before = {"proxy": _phase_counts(cluster["pd"], "xpyd_proxy_phase_seconds"),
              "prefill": _phase_counts(cluster["prefill"], "xpyd_request_phase_seconds"),
              "decode": _phase_counts(cluster["decode"], "xpyd_request_phase_seconds")}
    headers, raw, client_us = post(cluster["pd"], {"prompt": PROMPT})
    assert json.loads(raw)["usage"]["completion_tokens"] == 6
    t = decode_timing(headers[TIMING_HEADER])
    split = check_split(t, client_us)
    assert list(split)[-2:] == ["proxy.rest", "proxy.egress"] and split["proxy.rest"] > 0
    assert t.decode is not None and t.decode.step_us > 0 and (t.ttft_us, t.gaps_us) == (None, ())
    after = {"proxy": _phase_counts(cluster["pd"], "xpyd_proxy_phase_seconds"),
             "prefill": _phase_counts(cluster["prefill"], "xpyd_request_phase_seconds"),
             "decode": _phase_counts(cluster["decode"], "xpyd_request_phase_seconds")}
    for side, phases in (("proxy", ("ingress", "prefill_call", "network", "rest", "egress")),
                         ("prefill", ("parse", "queue", "compute", "respond")),
                         ("decode", ("parse", "wait", "transfer", "queue", "step", "respond"))):
        for phase in phases:
            assert after[side][phase] - before[side].get(phase, 0) == 1, (side, phase)
    assert after["proxy"]["choices"] == before["proxy"].get("choices", 0)


@pytest.mark.parametrize("proxy", ["pd-plain", "co-plain"])
def test_without_the_flag_a_json_answer_has_no_timing(cluster, proxy):
    headers, _, _ = post(cluster[proxy], {"prompt": PROMPT})
    assert TIMING_HEADER.lower() not in {k.lower() for k in headers}


def test_bench_splits_every_json_answer(cluster, tmp_path):
    report = bench(cluster["pd"], tmp_path / "out.json", "--no-stream")
    check_bench(report, {"proxy.ingress", "prefill.compute", "proxy.network", "proxy.rest", "proxy.egress"})
    assert all(len(r["chunks_s"]) == 1 for r in report["requests"]) and report["tpot_ms"]["p50"] is None
    assert report["phases"]["decode_ms"]["step"]["count"] == 8


# --- several choices through the P/D proxy -------------------------------------------------------------------

@pytest.mark.parametrize("stream", [True, False])
def test_several_choices_split_along_choice_zero(cluster, stream):
    body = {"prompt": [PROMPT, "Once upon a time in a land far away"], "n": 2, "temperature": 0.9, "seed": 3,
            "stream": stream}
    headers, raw, client_us = post(cluster["pd"], body)
    t = streamed_timing(raw) if stream else decode_timing(headers[TIMING_HEADER])
    split = check_split(t, client_us)
    assert "proxy.choices" in split and ("proxy.rest" in split) is not stream
    assert t.decode is not None and t.gaps_us == ()
    if not stream:
        assert len(json.loads(raw)["choices"]) == 4


def test_bench_splits_several_choices_streamed_and_not(cluster, tmp_path):
    check_bench(bench(cluster["pd"], tmp_path / "s.json", "--n", "2"), {"proxy.choices", "proxy.egress"})
    check_bench(bench(cluster["pd"], tmp_path / "j.json", "--n", "2", "--no-stream"), {"proxy.choices", "proxy.rest"})


# --- a colocated worker --------------------------------------------------------------------------------------

def test_a_colocated_answer_says_where_its_time_went(cluster):
    before = {"proxy": _phase_counts(cluster["co"], "xpyd_proxy_phase_seconds"),
              "colocated": _phase_counts(cluster["colocated"], "xpyd_request_phase_seconds")}
    _, raw, client_us = post(cluster["co"], {"prompt": PROMPT, "stream": True, "temperature": 0})
    t = streamed_timing(raw)
    split = check_split(t, client_us)
    assert list(split) == ["proxy.ingress", "colocated.parse", "colocated.queue", "colocated.compute",
                           "colocated.respond", "proxy.network", "proxy.egress"]
    assert t.colocated.total_us == t.ttft_us and t.colocated.step is not None and t.colocated.step.step_us > 0
    assert t.gaps == text_chunks(raw) - 1 == 5  # (the worker's own gaps ride along; greedy: every token has text)
    headers, raw, client_us = post(cluster["co"], {"prompt": PROMPT})
    t = decode_timing(headers[TIMING_HEADER])
    split = check_split(t, client_us)
    assert "colocated.rest" in split and t.colocated.total_us == t.ttft_us and t.colocated.step is None
    after = {"proxy": _phase_counts(cluster["co"], "xpyd_proxy_phase_seconds"),
             "colocated": _phase_counts(cluster["colocated"], "xpyd_request_phase_seconds")}
    for side, phase, grew in (("proxy", "ingress", 2), ("proxy", "network", 2), ("proxy", "egress", 2),
                              ("colocated", "parse", 2), ("colocated", "compute", 2), ("colocated", "respond", 2),
                              ("colocated", "rest", 1), ("colocated", "decode_step", 1)):
        assert after[side][phase] - before[side].get(phase, 0) == grew, (side, phase)


def test_bench_splits_every_colocated_answer(cluster, tmp_path):
    report = bench(cluster["co"], tmp_path / "s.json")
    check_bench(report, {"proxy.ingress", "colocated.compute", "proxy.network", "proxy.egress"})
    assert report["phases"]["decode_ms"]["step"]["count"] == 8
    report = bench(cluster["co"], tmp_path / "j.json", "--no-stream")
    check_bench(report, {"colocated.compute", "colocated.rest", "proxy.egress"})


def test_the_openai_client_reads_a_timed_json_answer(cluster):
    openai = pytest.importorskip("openai")
    for proxy in ("pd", "co"):
        client = openai.OpenAI(base_url=cluster[proxy] + "/v1", api_key="unused", timeout=60, max_retries=0)
        try:
            raw = client.completions.with_raw_response.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                                              max_tokens=4, temperature=0)
            assert raw.parse().choices[0].text and decode_timing(raw.headers[TIMING_HEADER]).proxy is not None
        finally:
            client.close()


# --- a prompt its decode worker prefilled itself (conditional disaggregation) --------------------------------

@pytest.mark.parametrize("stream", [True, False])
def test_a_locally_prefilled_answer_says_where_its_time_went(cluster, stream):
    """The proxy sent the short prompt to its decode worker alone: decode's own split of the first token (parse,
    queue, compute, respond) joins the proxy's, network is the decode call less it, and they add up."""
    before = _phase_counts(cluster["decode"], "xpyd_request_phase_seconds")
    proxy_before = _phase_counts(cluster["pd-local"], "xpyd_proxy_phase_seconds")
    headers, raw, client_us = post(cluster["pd-local"], {"prompt": PROMPT, "stream": stream})
    t = streamed_timing(raw) if stream else decode_timing(headers[TIMING_HEADER])
    assert t.prefill is None and t.colocated is not None, t  # (no prefill worker took part)
    split = check_split(t, client_us)
    assert set(split) == {"proxy.ingress", "colocated.parse", "colocated.queue", "colocated.compute",
                          "colocated.respond", "proxy.network", "proxy.egress"} | ({"proxy.rest"} if not stream else set())
    after = _phase_counts(cluster["decode"], "xpyd_request_phase_seconds")
    assert after["compute"] == before.get("compute", 0) + 1  # (decode's histogram: its local prefill's phases)
    proxy_after = _phase_counts(cluster["pd-local"], "xpyd_proxy_phase_seconds")
    for phase in ("ingress", "prefill_call", "network", "egress"):  # (network: once decode's own time came)
        assert proxy_after[phase] == proxy_before.get(phase, 0) + 1, phase
    with urllib.request.urlopen(cluster["pd-local"] + "/metrics", timeout=10) as r:
        assert 'xpyd_proxy_prefill_path_total{path="local"}' in r.read().decode()
