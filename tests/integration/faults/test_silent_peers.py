"""What the README promises of silent peers, with real worker processes (tiny random Llama):

- a prefill worker whose signal plane answers nothing (stopped: its connection stays open) fails the decode
  requests that wait on it after ``--signal-timeout``, not after ``--prefill-wait-timeout``;
- requests queued on a full decode worker keep their claimed KV on prefill for longer than prefill's
  ``--peer-timeout``: the decode worker's heartbeats keep them, and they all complete.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port
from tests.integration.faults.fault_helpers import decode_body, info, pair, post, prefill_body, rid_for, stats, wait_idle
from tests.waiting import wait_until

SIGNAL_TIMEOUT = 1.5  # decode's --signal-timeout
PEER_TIMEOUT = 3.0  # prefill's --peer-timeout (its minimum)
HEARTBEAT = 1.0  # a decode worker sends each prefill peer something at least this often
SLACK = 1.5  # engine steps, HTTP, a loaded 2-core machine


@pytest.fixture(scope="module")
def workers(tmp_path_factory, tiny_model_dir: Path):
    c = Cluster(tmp_path_factory.mktemp("silent-peers"))
    common = ["--model", str(tiny_model_dir), "--dtype", "float32", "--threads", "1", "--max-model-len", "512"]
    pp, ps, dp = free_port(), free_port(), free_port()
    urls = {"prefill": f"http://127.0.0.1:{pp}", "prefill_signal": f"127.0.0.1:{ps}",
            "decode": f"http://127.0.0.1:{dp}"}
    c.start("prefill", ["prefill", *common, "--batch-size", "8", "--kv-ttl", "0.5",
                        "--peer-timeout", str(PEER_TIMEOUT), "--port", str(pp), "--signal-port", str(ps)],
            urls["prefill"])
    c.start("decode", ["decode", *common, "--batch-size", "1", "--signal-timeout", str(SIGNAL_TIMEOUT),
                       "--prefill-wait-timeout", "60", "--port", str(dp), "--kv-port", str(free_port())],
            urls["decode"])
    try:
        c.wait_healthy()
        urls["decode_id"] = info(urls["decode"])["signal_addr"]
    except BaseException:
        c.stop()
        raise
    yield c, urls
    c.stop()


def test_queued_requests_outlive_the_prefill_workers_peer_timeout(workers):
    """One decode slot, sixteen long generations: the last ones wait (claimed, KV held on prefill) longer than
    --peer-timeout and --kv-ttl; their open session keeps the claims and every request completes. (Eight
    were too few once a decode step of the tiny model took under a millisecond: the queue lasted 3.2 s.)"""
    _, urls = workers
    rids = [rid_for(urls) for _ in range(16)]
    results: dict[str, tuple[float, tuple[int, dict]]] = {}
    started = time.monotonic()

    def decode_call(rid: str) -> None:
        out = post(urls["decode"], decode_body(480), rid, timeout=180)
        results[rid] = (time.monotonic() - started, out)

    threads = [threading.Thread(target=decode_call, args=(rid,)) for rid in rids]
    for t in threads:
        t.start()
    for rid in rids:
        status, body = post(urls["prefill"], prefill_body(480), rid)
        assert status == 200, body
    for t in threads:
        t.join(180)
    for rid in rids:
        _, (status, body) = results[rid]
        assert status == 200 and body["usage"]["completion_tokens"] == 480, body
    last = max(t for t, _ in results.values())
    assert last > PEER_TIMEOUT + HEARTBEAT, last  # (else the test showed nothing: the queue was too short)
    s = wait_idle(urls["prefill"])
    assert s["expired"] == 0, s
    wait_idle(urls["decode"])


def test_a_stopped_prefill_worker_fails_waiting_requests_after_the_signal_timeout(workers):
    c, urls = workers
    victim = next(p for p in c.procs if p.name == "prefill")
    before = stats(urls["decode"])["failures"].get("peer", 0)
    os.kill(victim.popen.pid, signal.SIGSTOP)  # its TCP connections stay open: only silence tells
    try:
        results: dict[str, tuple[float, tuple[int, dict]]] = {}

        def call(rid: str) -> None:
            t0 = time.monotonic()
            out = post(urls["decode"], decode_body(), rid, timeout=60)
            results[rid] = (time.monotonic() - t0, out)

        threads = [threading.Thread(target=call, args=(rid_for(urls),)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for took, (status, body) in results.values():
            assert status == 502, body
            assert "did not answer" in body["error"]["message"] and f"within {SIGNAL_TIMEOUT:.1f}s" in \
                body["error"]["message"], body
            # after the signal timeout (a claim sent now, or a heartbeat at most 1 s older), long before
            # the 60 s prefill-wait timeout
            assert SIGNAL_TIMEOUT - HEARTBEAT - 0.1 <= took <= SIGNAL_TIMEOUT + SLACK, took
        assert stats(urls["decode"])["failures"].get("peer", 0) == before + 2
    finally:
        os.kill(victim.popen.pid, signal.SIGCONT)
    wait_idle(urls["decode"])
    # The prefill worker is back: the decode worker reconnects on demand and serves.
    (ps, pbody), (ds, dbody) = pair(urls, rid_for(urls))
    assert ps == 200 and ds == 200, (pbody, dbody)
    wait_until(lambda: stats(urls["prefill"])["blocks_used"] == 0, "prefill holds no KV")
    wait_idle(urls["decode"])
