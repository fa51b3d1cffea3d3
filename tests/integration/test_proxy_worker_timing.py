"""The workers' own timing through the real proxy (``--expose-worker-timing``), against real processes: sim
workers (``--engine sim``, no simulated time), a P/D proxy and a colocated proxy with the flag, and a P/D proxy
and a colocated proxy without it.

With the flag, xpyd bench gets the workers' timing for every request: a TTFT no larger than the client's, and
as many gaps as the worker that wrote them could have (P/D: one fewer than the client saw, colocated: all);
the official OpenAI client streams through it as through a proxy without the flag (the comment is skipped).
Without the flag, no ``xpyd-timing`` line reaches the client (the workers are not asked).
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port
from xpyd.api.timing import ASK, TIMING_HEADER, timing_of_comment
from xpyd.bench import main as bench_main
from xpyd.signal.request_id import RequestId

pytestmark = pytest.mark.timeout(600)

PROFILE = {
    "format": "xpyd-sim-profile/1", "model": "test", "machine": "test", "dtype": "float32", "threads": 1,
    "created": "2026-01-01T00:00:00Z",
    "prefill": {"new_tokens": [1, 1024], "cached_tokens": [0, 1024], "seconds": [[0.001, 0.001], [0.01, 0.01]]},
    "decode": {"batch": [1, 8], "context_tokens": [1, 4096], "seconds": [[0.001, 0.002], [0.002, 0.003]]},
}
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smollm_dir: Path):
    """1 prefill + 1 decode sim worker behind a proxy with the flag ("timed") and one without ("plain"); a
    colocated sim worker behind a proxy with it ("colocated-timed") and one without ("colocated-plain")."""
    work = tmp_path_factory.mktemp("worker-timing")
    profile = work / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    options = ["--model", str(smollm_dir), "--engine", "sim", "--sim-profile", str(profile), "--sim-speedup", "inf",
               "--threads", "1", "--batch-size", "4", "--max-model-len", "512", "--block-size", "16"]
    c = Cluster(work)
    urls: dict[str, str] = {}
    try:
        port, signal = free_port(), free_port()
        urls["prefill"] = f"http://127.0.0.1:{port}"
        c.start("prefill", ["prefill", *options, "--port", str(port), "--signal-port", str(signal)], urls["prefill"])
        port, kv = free_port(), free_port()
        urls["decode"] = f"http://127.0.0.1:{port}"
        c.start("decode", ["decode", *options, "--port", str(port), "--kv-port", str(kv)], urls["decode"])
        port = free_port()
        urls["colocated"] = f"http://127.0.0.1:{port}"
        c.start("colocated", ["colocated", *options, "--port", str(port)], urls["colocated"])
        c.wait_healthy()
        pd = ["--prefill", urls["prefill"], "--decode", urls["decode"]]
        for name, extra in (("timed", ["--expose-worker-timing", *pd]), ("plain", pd),
                            ("colocated-timed", ["--expose-worker-timing", "--colocated", urls["colocated"]]),
                            ("colocated-plain", ["--colocated", urls["colocated"]])):
            urls[name] = f"http://127.0.0.1:{free_port()}"
            c.start(name, ["proxy", "--port", urls[name].rsplit(":", 1)[1], *extra], urls[name])
        c.wait_healthy()
        yield urls
    finally:
        c.stop()


def bench(url: str, out: Path, requests: int = 8) -> dict:
    parser = argparse.ArgumentParser(prog="xpyd bench")
    bench_main.add_arguments(parser)
    argv = ["--url", url, "--num-requests", str(requests), "--concurrency", "4", "--input-len", "24",
            "--output-len", "6", "--json", str(out), "--no-progress", "--include-requests"]
    assert bench_main.run(parser.parse_args(argv)) == 0
    return json.loads(out.read_text())


def raw_stream(url: str, path: str = "/v1/completions", headers: dict | None = None) -> bytes:
    body = json.dumps({"model": None, "prompt": PROMPT, "max_tokens": 5, "stream": True, "ignore_eos": True,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json",
                                                                 **(headers or {})})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        return r.read()


@pytest.mark.parametrize("proxy, own_first_gap", [("timed", False), ("colocated-timed", True)])
def test_with_the_flag_every_request_carries_its_workers_timing(cluster, tmp_path, capsys, proxy, own_first_gap):
    report = bench(cluster[proxy], tmp_path / "out.json")
    assert (report["completed"], report["failed"]) == (8, 0), report["errors"]
    po = report["proxy_overhead"]
    assert (po["requests"], po["missing"], po["misaligned"]) == (8, 0, 0)
    for r in report["requests"]:
        t, chunks = r["worker_timing"], r["chunks_s"]
        client_ttft_ms = (chunks[0] - r["send_s"]) * 1000
        assert 0 < t["worker_ttft_ms"] <= client_ttft_ms
        assert t["proxy_ttft_ms"] == pytest.approx(client_ttft_ms - t["worker_ttft_ms"])
        assert t["proxy_ttft_ms"] >= 0
        # P/D: decode wrote chunks 2..n (its gaps: one fewer than the client's), or all of them when prefill's
        # token had no text of its own yet (the requests sample, unseeded); colocated: all of them
        gaps = len(t["worker_itl_ms"])
        assert gaps == len(t["client_itl_ms"]) > 0
        assert gaps == len(chunks) - 1 if own_first_gap else gaps in (len(chunks) - 2, len(chunks) - 1)
        assert all(g >= 0 for g in t["worker_itl_ms"])
    for key in ("worker_ttft_ms", "proxy_ttft_ms", "worker_itl_ms", "client_itl_ms"):
        assert po[key]["p50"] is not None and po[key]["p99"] is not None
    assert po["itl_p99_ratio"] is not None and po["itl_p99_ratio"] > 0
    assert "what the proxy adds" in capsys.readouterr().out


@pytest.mark.parametrize("proxy", ["timed", "colocated-timed"])
def test_the_timing_comment_is_the_last_thing_before_done(cluster, proxy):
    body = raw_stream(cluster[proxy])
    head, sep, tail = body.rpartition(b"\n\ndata: [DONE]")
    assert sep and tail.strip() == b""
    comments = [line for line in body.splitlines() if line.startswith(b": xpyd-timing")]
    assert len(comments) == 1 and head.endswith(comments[0])
    t = timing_of_comment(comments[0])
    assert t.ttft_us is not None and t.ttft_us > 0 and t.gaps == len(t.gaps_us)


@pytest.mark.parametrize("proxy", ["plain", "colocated-plain"])
def test_without_the_flag_no_timing_reaches_the_client(cluster, tmp_path, proxy):
    assert b"xpyd-timing" not in raw_stream(cluster[proxy])
    assert b"xpyd-timing" not in raw_stream(cluster[proxy], headers={TIMING_HEADER: ASK})  # a client's ask: not passed
    report = bench(cluster[proxy], tmp_path / "out.json", requests=4)
    assert report["completed"] == 4 and "proxy_overhead" not in report
    assert all(r["worker_timing"] is None for r in report["requests"])


def test_a_worker_times_only_what_it_is_asked_to(cluster):
    url = cluster["colocated"]
    with urllib.request.urlopen(url + "/xpyd/info", timeout=10) as r:
        signal = json.loads(r.read())["signal_addr"]

    def rid() -> dict:
        return {"X-Request-Id": str(RequestId.new(signal, signal))}

    assert b"xpyd-timing" not in raw_stream(url, headers=rid())
    asked = raw_stream(url, headers={**rid(), TIMING_HEADER: ASK})
    assert asked.count(b": xpyd-timing ") == 1


def test_the_openai_client_streams_through_the_flag_as_without_it(cluster):
    openai = pytest.importorskip("openai")
    texts = {}
    for proxy in ("timed", "plain", "colocated-timed"):
        client = openai.OpenAI(base_url=cluster[proxy] + "/v1", api_key="unused", timeout=60, max_retries=0)
        try:
            stream = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=5,
                                               stream=True, temperature=0, extra_body={"ignore_eos": True})
            texts[proxy] = "".join(c.choices[0].text for c in stream if c.choices)
            chat = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=5, stream=True,
                                                  temperature=0, messages=[{"role": "user", "content": PROMPT}])
            assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
        finally:
            client.close()
    assert texts["timed"] and texts["timed"] == texts["plain"] == texts["colocated-timed"]


def _phase_counts(url: str, name: str) -> dict[str, float]:
    """``name``'s histogram counts by phase, from ``url``'s /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.labels["phase"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name + "_count"}


def test_every_ttft_is_split_into_phases_that_add_up(cluster, tmp_path, capsys):
    """Through the P/D proxy each answer says where its TTFT went: the proxy's, prefill's and decode's phases,
    each side's on its own clock. Their sum is the proxy's TTFT exactly, the client's TTFT is that sum and
    what no server measured (the client <-> proxy hop, never negative: the proxy's interval lies inside the
    client's), and each side's histograms count every request."""
    before = {"proxy": _phase_counts(cluster["timed"], "xpyd_proxy_phase_seconds"),
              "prefill": _phase_counts(cluster["prefill"], "xpyd_request_phase_seconds"),
              "decode": _phase_counts(cluster["decode"], "xpyd_request_phase_seconds")}
    report = bench(cluster["timed"], tmp_path / "out.json")
    assert (report["completed"], report["failed"]) == (8, 0), report["errors"]
    split = [r for r in report["requests"] if r["phases"] is not None]
    # (prefill's token may have no text of its own yet: then decode wrote the client's first chunk, no split)
    assert len(split) == report["phases"]["requests"] and len(split) >= 4
    for r in report["requests"]:
        if r["phases"] is None:
            assert len(r["worker_timing"]["worker_itl_ms"]) == len(r["chunks_s"]) - 1  # decode wrote them all
            continue
        p = r["phases"]
        client_ttft_ms = (r["chunks_s"][0] - r["send_s"]) * 1000
        assert list(p["ttft_ms"]) == ["proxy.ingress", "prefill.parse", "prefill.queue", "prefill.compute",
                                      "prefill.respond", "proxy.network", "proxy.egress"]
        assert all(v >= 0 for v in p["ttft_ms"].values()), p
        assert p["ttft_ms"]["prefill.compute"] > 0
        assert p["sum_ms"] == pytest.approx(sum(p["ttft_ms"].values()))
        assert p["client_ttft_ms"] == pytest.approx(client_ttft_ms)
        assert p["sum_ms"] + p["client_other_ms"] == pytest.approx(client_ttft_ms)
        assert 0 <= p["client_other_ms"] < client_ttft_ms
        assert p["ttft_ms"]["prefill.parse"] + p["ttft_ms"]["prefill.queue"] + p["ttft_ms"]["prefill.compute"] \
            + p["ttft_ms"]["prefill.respond"] == pytest.approx(r["worker_timing"]["worker_ttft_ms"])
        d = p["decode_ms"]
        assert d is not None and set(d) == {"parse", "wait", "transfer", "queue", "step", "respond"}
        assert all(v >= 0 for v in d.values()) and d["step"] > 0
    ph = report["phases"]
    assert ph["sum_over_client_ttft_p50"] is not None and 0 < ph["sum_over_client_ttft_p50"] <= 1
    assert "where the time went" in capsys.readouterr().out
    after = {"proxy": _phase_counts(cluster["timed"], "xpyd_proxy_phase_seconds"),
             "prefill": _phase_counts(cluster["prefill"], "xpyd_request_phase_seconds"),
             "decode": _phase_counts(cluster["decode"], "xpyd_request_phase_seconds")}
    expected = {"proxy": ("ingress", "prefill_call", "network", "egress"),
                "prefill": ("parse", "queue", "compute", "respond"),
                "decode": ("parse", "wait", "transfer", "queue", "step", "respond")}
    for side, phases in expected.items():
        for phase in phases:
            grew = after[side][phase] - before[side].get(phase, 0)
            # the proxy: the answers whose first token was prefill's; the workers: every request (and the
            # bench's warm-up, if any)
            assert grew >= (len(split) if side == "proxy" else 8), (side, phase, grew)


def test_the_timing_comment_carries_each_sides_phases(cluster):
    body = raw_stream(cluster["timed"])
    t = timing_of_comment(next(line for line in body.splitlines() if line.startswith(b": xpyd-timing")))
    assert t.prefill is not None and t.decode is not None and t.proxy is not None
    assert t.prefill.total_us == t.ttft_us
    assert t.proxy.network_us == t.proxy.prefill_call_us - t.prefill.total_us >= 0
