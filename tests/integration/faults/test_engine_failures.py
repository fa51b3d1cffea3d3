"""Exceptions inside a worker's engine loop, injected into real worker processes with ``XPYD_TEST_FAULT``.

- One request's work raises (``add:MARKER``): that request fails at once with a 500 (JSON, or an error
  event coded 500 in a stream), the others on the same worker complete with the reference output.
- A step raises as a whole (``step:MARKER``): every request the worker holds ends with an error at once,
  the worker deregisters from etcd and exits with ``ENGINE_FAILED_EXIT``.

Every test ends with a leak check on the workers that stay up.
"""

from __future__ import annotations

import copy

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port
from tests.integration.faults.fault_helpers import BODY, info, post, stats, wait_idle
from tests.waiting import wait_until
from xpyd.discovery.status import fetch_workers
from xpyd.signal.request_id import RequestId
from xpyd.worker.faults import FAULT_ENV
from xpyd.worker.main import ENGINE_FAILED_EXIT

PREFILL_MARK, DECODE_MARK, FATAL_MARK = "prefill-fault", "decode-fault", "fatal-fault"
PROMPT = BODY["prompt"]
MAX_TOKENS = 6
FAIL_WITHIN = 1.0  # one request's failure reaches its client within this
FATAL_WITHIN = 2.0  # every held request's error, after a fatal fault
EXIT_WITHIN = 10.0  # the failed worker is gone (bounds a hang; it takes about FAILED_FLUSH plus teardown)


def _common(model: Path) -> list[str]:
    return ["--model", str(model), "--dtype", "float32", "--threads", "1", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def faulty(tmp_path_factory, tiny_model_dir: Path):
    """A prefill and a decode worker, each failing the requests with its marker (a stop string) when added."""
    c = Cluster(tmp_path_factory.mktemp("engine-faults"))
    pp, ps, dp = free_port(), free_port(), free_port()
    urls = {"prefill": f"http://127.0.0.1:{pp}", "prefill_signal": f"127.0.0.1:{ps}",
            "decode": f"http://127.0.0.1:{dp}"}
    common = [*_common(tiny_model_dir), "--batch-size", "4"]
    c.start("prefill", ["prefill", *common, "--kv-ttl", "5", "--port", str(pp), "--signal-port", str(ps)],
            urls["prefill"], env={FAULT_ENV: f"add:{PREFILL_MARK}"})
    c.start("decode", ["decode", *common, "--prefill-wait-timeout", "30", "--port", str(dp), "--kv-port",
                       str(free_port())], urls["decode"], env={FAULT_ENV: f"add:{DECODE_MARK}"})
    try:
        c.wait_healthy()
        urls["decode_id"] = info(urls["decode"])["signal_addr"]
    except BaseException:
        c.stop()
        raise
    yield c, urls
    c.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> str:
    """Greedy transformers generate() of PROMPT on the same model: the text of MAX_TOKENS tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.numerics import decided_greedy

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    model64 = copy.deepcopy(model).double()  # every reference token is decided beyond float32 error
    return tok.decode(decided_greedy(model, model64, tok(PROMPT).input_ids, MAX_TOKENS), skip_special_tokens=True)


def _body(role: str, mark: str | None = None, stream: bool = False) -> dict:
    """A request for ``role``; ``mark``: the fault marker, among its stop strings (what the hook looks at)."""
    stop = {"stop": [mark]} if mark else {}
    if role == "prefill":
        return {**BODY, **stop, "prompt": PROMPT, "stream": stream, "ignore_eos": False, "max_tokens": 1,
                "kv_transfer_params": {"role": "prefill", "max_tokens": MAX_TOKENS}}
    return {**BODY, **stop, "prompt": PROMPT, "stream": stream, "ignore_eos": False, "max_tokens": MAX_TOKENS,
            "kv_transfer_params": {"role": "decode"}}


def _stream(url: str, body: dict, rid: str, timeout: float = 60) -> list[dict]:
    """A streamed completion's data events, parsed (the last one is ``[DONE]``, kept as the string)."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", "X-Request-Id": rid})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200
        lines = [line.removeprefix(b"data: ") for line in r.read().splitlines() if line.startswith(b"data: ")]
    return [json.loads(line) if line != b"[DONE]" else "[DONE]" for line in lines]


def _stream_error(events: list) -> dict:
    """The error event a stream ended with (before ``[DONE]``)."""
    assert events[-1] == "[DONE]" and "error" in events[-2], events
    return events[-2]["error"]


def _text(events: list) -> str:
    return "".join(e["choices"][0]["text"] for e in events[:-1])


def _timed(results: dict, key: str, fn, *args) -> threading.Thread:
    """Run ``fn(*args)`` in a thread; ``results[key]`` = (seconds it took, its result or exception)."""
    def run() -> None:
        t0 = time.monotonic()
        try:
            out = fn(*args)
        except Exception as e:  # noqa: BLE001 - reported by the assertions
            out = e
        results[key] = (time.monotonic() - t0, out)

    t = threading.Thread(target=run)
    t.start()
    return t


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(60)
        assert not t.is_alive()


def _pair_text(results: dict, key: str) -> str:
    """The text of a request served by the pair (keys ``key``/p and ``key``/d; the decode side streamed)."""
    (_, (pstatus, pbody)), (_, events) = results[key + "/p"], results[key + "/d"]
    assert pstatus == 200, pbody
    return pbody["choices"][0]["text"] + _text(events)


def _assert_internal_error(status: int, body: dict, elapsed: float) -> None:
    assert status == 500 and body["error"]["type"] == "server_error", body
    assert "InjectedFault" in body["error"]["message"], body
    assert elapsed < FAIL_WITHIN, elapsed


def test_a_request_that_raises_on_the_prefill_worker_fails_alone(faulty, reference):
    _, urls = faulty
    rid = {k: str(RequestId.new(urls["prefill_signal"], urls["decode_id"])) for k in ("a", "b", "bad", "bad_s")}
    bad = PREFILL_MARK
    results: dict = {}
    threads = []
    for k in ("a", "b"):  # two requests served by the pair meanwhile
        threads.append(_timed(results, k + "/d", _stream, urls["decode"], _body("decode"), rid[k]))
        threads.append(_timed(results, k + "/p", post, urls["prefill"], _body("prefill"), rid[k]))
    threads.append(_timed(results, "bad", post, urls["prefill"], _body("prefill", bad), rid["bad"]))
    threads.append(_timed(results, "bad/d", post, urls["decode"], _body("decode", bad), rid["bad"]))
    threads.append(_timed(results, "bad_s", _stream, urls["prefill"], _body("prefill", bad), rid["bad_s"]))
    _join(threads)

    elapsed, (status, body) = results["bad"]
    _assert_internal_error(status, body, elapsed)
    elapsed, events = results["bad_s"]
    error = _stream_error(events)
    assert error["code"] == 500 and "InjectedFault" in error["message"] and elapsed < FAIL_WITHIN, (error, elapsed)
    _, (status, body) = results["bad/d"]  # its decode side is told by the prefill worker (not timed out)
    assert status == 502 and "InjectedFault" in body["error"]["message"], body
    for k in ("a", "b"):
        assert _pair_text(results, k) == reference
    assert stats(urls["prefill"])["waiting"] == 0
    wait_idle(urls["decode"])
    wait_idle(urls["prefill"])


def test_a_request_that_raises_on_the_decode_worker_fails_alone(faulty, reference):
    _, urls = faulty
    rid = {k: str(RequestId.new(urls["prefill_signal"], urls["decode_id"])) for k in ("a", "b", "bad", "bad_s")}
    bad = DECODE_MARK
    results: dict = {}
    threads = []
    for k in ("a", "b"):
        threads.append(_timed(results, k + "/d", _stream, urls["decode"], _body("decode"), rid[k]))
        threads.append(_timed(results, k + "/p", post, urls["prefill"], _body("prefill"), rid[k]))
    threads.append(_timed(results, "bad", post, urls["decode"], _body("decode", bad), rid["bad"]))
    threads.append(_timed(results, "bad_s", _stream, urls["decode"], _body("decode", bad), rid["bad_s"]))
    _join(threads)

    elapsed, (status, body) = results["bad"]
    _assert_internal_error(status, body, elapsed)
    elapsed, events = results["bad_s"]
    error = _stream_error(events)
    assert error["code"] == 500 and "InjectedFault" in error["message"] and elapsed < FAIL_WITHIN, (error, elapsed)
    for k in ("a", "b"):
        assert _pair_text(results, k) == reference
    s = wait_idle(urls["decode"])
    assert s["failures"].get("internal", 0) >= 2
    wait_idle(urls["prefill"])


def _registered(endpoint: str) -> set[str]:
    import asyncio

    return {w.http_url for w in asyncio.run(fetch_workers(endpoint))}


def _start_failing(tmp_path: Path, etcd, role: str, args: list[str]) -> tuple[Cluster, str]:
    """A worker of ``role`` registered in ``etcd`` (lease long enough that only deregistering removes it
    in time), whose first step that adds a request with FATAL_MARK raises."""
    c = Cluster(tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    c.start(role, [role, *args, "--port", str(port), "--etcd", etcd.endpoint, "--lease-ttl", "60"], url,
            env={FAULT_ENV: f"step:{FATAL_MARK}"})
    try:
        c.wait_healthy()
        wait_until(lambda: url in _registered(etcd.endpoint), f"{role} registered in etcd", timeout=30)
    except BaseException:
        c.stop()
        raise
    return c, url


def _assert_failed_and_gone(c: Cluster, url: str, etcd, results: dict, t_fatal: float) -> None:
    proc = c.procs[0].popen
    proc.wait(EXIT_WITHIN)
    exited = time.monotonic() - t_fatal
    assert proc.returncode == ENGINE_FAILED_EXIT, c.procs[0].tail()
    assert url not in _registered(etcd.endpoint)  # deregistered (its lease would last another minute)
    for key, (elapsed, out) in results.items():
        assert not isinstance(out, Exception), (key, out)
        if isinstance(out, tuple):  # (status, JSON body)
            status, body = out
            assert status >= 500 and "engine failed" in body["error"]["message"], (key, body)
        else:
            error = _stream_error(out)
            assert error["code"] >= 500 and "engine failed" in error["message"], (key, error)
        assert elapsed < FATAL_WITHIN, (key, elapsed)
    assert exited < EXIT_WITHIN
    assert "its engine failed; deregistering and exiting" in c.procs[0].tail(200)


def test_a_fatal_fault_on_a_decode_worker_fails_every_request_deregisters_and_exits(
        faulty, etcd, tmp_path, tiny_model_dir):
    _, urls = faulty
    c, url = _start_failing(tmp_path, etcd, "decode", [*_common(tiny_model_dir), "--batch-size", "4",
                                                       "--prefill-wait-timeout", "60", "--kv-port", str(free_port()),
                                                       # (the prefill worker is not in etcd: listed instead)
                                                       "--prefill-peers", urls["prefill_signal"]])
    try:
        decode_id = info(url)["signal_addr"]
        rid = {k: str(RequestId.new(urls["prefill_signal"], decode_id)) for k in ("w1", "w2", "fatal")}
        results: dict = {}
        # Two requests held, waiting for a prefill that never comes (claimed at the prefill worker).
        threads = [_timed(results, k, _stream, url, _body("decode"), rid[k]) for k in ("w1", "w2")]
        wait_until(lambda: stats(url)["waiting"] == 2, "2 requests waiting on the decode worker")
        t_fatal = time.monotonic()
        threads.append(_timed(results, "fatal", post, url, _body("decode", FATAL_MARK),
                              rid["fatal"]))
        _join(threads)
        _assert_failed_and_gone(c, url, etcd, results, t_fatal)
    finally:
        c.stop()
    wait_idle(urls["prefill"])


def test_a_fatal_fault_on_a_prefill_worker_fails_every_request_deregisters_and_exits(
        etcd, tmp_path, tiny_model_dir):
    c, url = _start_failing(tmp_path, etcd, "prefill", [*_common(tiny_model_dir), "--batch-size", "1",
                                                        "--kv-ttl", "60", "--signal-port", str(free_port())])
    try:
        signal_addr = info(url)["signal_addr"]
        rid = {k: str(RequestId.new(signal_addr, "127.0.0.1:1")) for k in ("held", "queued", "fatal")}
        status, body = post(url, _body("prefill"), rid["held"])  # its KV takes the only slot (nobody pulls it)
        assert status == 200, body
        results: dict = {}
        threads = [_timed(results, "queued", _stream, url, _body("prefill"), rid["queued"])]
        wait_until(lambda: stats(url)["waiting"] == 1, "a request queued on the prefill worker")
        t_fatal = time.monotonic()
        threads.append(_timed(results, "fatal", post, url, _body("prefill", FATAL_MARK),
                              rid["fatal"]))
        _join(threads)
        _assert_failed_and_gone(c, url, etcd, results, t_fatal)
    finally:
        c.stop()
