"""xpyd bench's per-worker report against real processes: simulated workers (``--engine sim``, no simulated
time) behind ``xpyd proxy --expose-worker-names``.

A trace replayed through 2P2D (round_robin) is reported per prefill and per decode worker, under the names
the proxy's ``/cluster`` gives them, each worker with exactly the requests the router gave it; a colocated
worker behind its proxy gets one ``colocated`` row; the same P/D workers behind a proxy without the option
give a report without a per-worker section (as any other server).
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port
from xpyd.bench import main as bench_main

pytestmark = pytest.mark.timeout(600)

PROFILE = {
    "format": "xpyd-sim-profile/1", "model": "test", "machine": "test", "dtype": "float32", "threads": 1,
    "created": "2026-01-01T00:00:00Z",
    "prefill": {"new_tokens": [1, 1024], "cached_tokens": [0, 1024], "seconds": [[0.001, 0.001], [0.01, 0.01]]},
    "decode": {"batch": [1, 8], "context_tokens": [1, 4096], "seconds": [[0.001, 0.002], [0.002, 0.003]]},
}
# (outputs of 2 tokens or more: a request of one is answered by a prefill worker alone, with no decode worker)
ROWS = [(0, 40, 3, [0, 1]), (0, 40, 4, [0, 2]), (50, 30, 2, [3]), (50, 60, 3, [0, 1]),
        (100, 20, 2, [6]), (100, 45, 5, [0, 7]), (150, 33, 2, [8, 9]), (150, 25, 3, [11])]
BLOCK = 32  # the trace's block (--trace-block-size); the workers' is 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smollm_dir: Path):
    """2 prefill + 2 decode sim workers with two proxies in front (one naming workers, one not) and a
    colocated sim worker behind a naming proxy; their URLs."""
    work = tmp_path_factory.mktemp("per-worker")
    profile = work / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    options = ["--model", str(smollm_dir), "--engine", "sim", "--sim-profile", str(profile), "--sim-speedup", "inf",
               "--threads", "1", "--batch-size", "4", "--max-model-len", "512", "--block-size", "16"]
    c = Cluster(work)
    urls: dict[str, str] = {}
    try:
        for i in range(2):
            port, signal = free_port(), free_port()
            urls[f"prefill{i}"] = f"http://127.0.0.1:{port}"
            c.start(f"prefill{i}", ["prefill", *options, "--port", str(port), "--signal-port", str(signal)],
                    urls[f"prefill{i}"])
            port, kv = free_port(), free_port()
            urls[f"decode{i}"] = f"http://127.0.0.1:{port}"
            c.start(f"decode{i}", ["decode", *options, "--port", str(port), "--kv-port", str(kv)], urls[f"decode{i}"])
        port = free_port()
        urls["colocated"] = f"http://127.0.0.1:{port}"
        c.start("colocated", ["colocated", *options, "--port", str(port)], urls["colocated"])
        c.wait_healthy()
        workers = [a for i in range(2) for a in ("--prefill", urls[f"prefill{i}"], "--decode", urls[f"decode{i}"])]
        for name, extra in (("named", ["--expose-worker-names", *workers]), ("plain", workers),
                            ("colocated-proxy", ["--expose-worker-names", "--colocated", urls["colocated"]])):
            urls[name] = f"http://127.0.0.1:{free_port()}"
            c.start(name, ["proxy", "--port", urls[name].rsplit(":", 1)[1], "--policy", "round_robin", *extra],
                    urls[name])
        c.wait_healthy()
        yield urls
    finally:
        c.stop()


def bench(argv: list[str], out: Path) -> dict:
    parser = argparse.ArgumentParser(prog="xpyd bench")
    bench_main.add_arguments(parser)
    assert bench_main.run(parser.parse_args([*argv, "--json", str(out), "--no-progress", "--include-requests"])) == 0
    return json.loads(out.read_text())


def trace_args(url: str, tmp_path: Path) -> list[str]:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h}) + "\n"
                             for t, i, o, h in ROWS))
    return ["--url", url, "--trace", str(trace), "--trace-block-size", str(BLOCK), "--time-scale", "10",
            "--slo", "ttft=60s,tpot=60s"]


def test_trace_replay_through_the_proxy_is_reported_per_worker(cluster, tmp_path, capsys):
    report = bench(trace_args(cluster["named"], tmp_path), tmp_path / "out.json")
    assert (report["completed"], report["failed"]) == (len(ROWS), 0), report["errors"]
    with urllib.request.urlopen(cluster["named"] + "/cluster", timeout=10) as r:
        names = {w["http_url"]: w["name"] for w in json.loads(r.read())["workers"]}
    workers = report["workers"]
    assert workers["unattributed"] == 0
    for role in ("prefill", "decode"):
        rows = workers[role]
        assert sorted(rows) == sorted(names[cluster[f"{role}{i}"]] for i in range(2))
        # round_robin over two workers: every other request each; the run's SLO is met by all
        assert [(row["requests"], row["completed"], row["failed"], row["good"], row["slo_attainment"])
                for row in rows.values()] == [(4, 4, 0, 4, 1.0)] * 2
        assert sum(row["goodput_output_tokens_per_s"] for row in rows.values()) == pytest.approx(
            report["goodput_output_tokens_per_s"])  # the same tokens split by worker (float sums: rel 1e-6)
        assert all(row["ttft_ms"]["p50"] is not None and row["tpot_ms"]["p99"] is not None for row in rows.values())
    # every request's record names its pair; together they are the rows
    pairs = [r["workers"] for r in report["requests"]]
    assert all(set(p) == {"prefill", "decode"} for p in pairs)
    assert sorted(p["decode"] for p in pairs) == sorted(n for n, row in workers["decode"].items()
                                                        for _ in range(row["requests"]))
    text = capsys.readouterr().out
    assert "--- per worker (x-xpyd-workers)" in text and "prefill:" in text and "decode:" in text
    for url in (cluster[f"{role}{i}"] for role in ("prefill", "decode") for i in range(2)):
        assert url.rsplit(":", 1)[1] not in json.dumps(workers)  # no port of a worker in the names


def test_a_colocated_worker_gets_one_row(cluster, tmp_path):
    report = bench(["--url", cluster["colocated-proxy"], "--num-requests", "6", "--concurrency", "2",
                    "--input-len", "24", "--output-len", "3"], tmp_path / "out.json")
    assert (report["completed"], report["failed"]) == (6, 0), report["errors"]
    rows = report["workers"]["colocated"]
    assert len(rows) == 1 and set(report["workers"]) == {"colocated", "unattributed"}
    (name, row), = rows.items()
    assert name.startswith("c") and len(name) == 9 and (row["requests"], row["completed"]) == (6, 6)


def test_a_proxy_without_the_option_gives_no_per_worker_section(cluster, tmp_path, capsys):
    report = bench(trace_args(cluster["plain"], tmp_path), tmp_path / "out.json")
    assert report["completed"] == len(ROWS)
    assert "workers" not in report and all(r["workers"] is None for r in report["requests"])
    assert "per worker" not in capsys.readouterr().out
