"""Worker-side faults with real processes: KV lease, prefill-wait timeout, dead prefill, aborts, cluster token.

Every test ends by checking that the workers it used hold nothing (requests, KV slots, transfers).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.request

from tests.integration.faults.fault_helpers import KV_TTL, PREFILL_WAIT, post, stats, wait_idle
from tests.integration.faults.fault_helpers import decode_body as _decode_body
from tests.integration.faults.fault_helpers import headers as _headers
from tests.integration.faults.fault_helpers import pair as _pair
from tests.integration.faults.fault_helpers import prefill_body as _prefill_body
from tests.integration.faults.fault_helpers import rid_for as _rid
from tests.waiting import wait_until
from xpyd.signal.request_id import parse_request_id

# A worker checks its timers every engine step or idle wake-up (<= 0.1 s); HTTP and stats polls add well
# under a second even on a loaded 2-core machine. A timer that fired at twice its value fails.
SWEEP_SLACK = 1.5


def test_right_token_serves_and_both_sides_end_idle(fault_workers):
    _, urls = fault_workers
    rid = _rid(urls)
    (ps, pbody), (ds, dbody) = _pair(urls, rid)
    assert ps == 200 and ds == 200, (pbody, dbody)
    assert dbody["usage"]["completion_tokens"] == 6 and dbody["id"] == "cmpl-" + parse_request_id(rid).uid
    wait_idle(urls["prefill"])
    wait_idle(urls["decode"])


def test_wrong_or_missing_cluster_token_is_refused_with_no_state(fault_workers):
    _, urls = fault_workers
    before = stats(urls["prefill"])
    for name, needle in (("decode_wrong", "cluster token mismatch"), ("decode_none", "cluster token required")):
        rid = _rid(urls, decode=name)
        t0 = time.monotonic()
        status, body = post(urls[name], _decode_body(), rid)
        assert status == 502, body
        msg = body["error"]["message"]
        assert "handshake" in msg and needle in msg, msg
        assert time.monotonic() - t0 < PREFILL_WAIT  # refused at once, not timed out
        wait_idle(urls[name])
    after = stats(urls["prefill"])
    assert after["handshaken"] == before["handshaken"] and after["peers"] == before["peers"]
    wait_idle(urls["prefill"])


def test_unpulled_kv_is_freed_after_kv_ttl_and_a_later_pull_is_told_expired(fault_workers):
    _, urls = fault_workers
    rid = _rid(urls)
    expired_before = stats(urls["prefill"])["expired"]
    t_sent = time.monotonic()  # its lease starts after this (when prefill has run), so it ends after +KV_TTL
    status, body = post(urls["prefill"], _prefill_body(), rid)
    assert status == 200 and body["usage"]["completion_tokens"] == 1, body
    held = stats(urls["prefill"])
    assert held["blocks_used"] >= 1 and held["transferring"] == 1 and held["kv_used_bytes"] > 0, held
    s = wait_idle(urls["prefill"], timeout=KV_TTL + 10)
    freed_after = time.monotonic() - t_sent
    # Freed by its lease: not before kv_ttl, and well before any other path would free it (the decode
    # worker never claimed it; the next bound is the 10 s --peer-timeout, which does not apply either).
    assert KV_TTL * 0.9 <= freed_after <= KV_TTL + SWEEP_SLACK, freed_after
    assert s["expired"] == expired_before + 1
    t0 = time.monotonic()
    status, body = post(urls["decode"], _decode_body(), rid)
    assert status == 502, body
    assert "expired" in body["error"]["message"] and f"kv_ttl={KV_TTL:g}s" in body["error"]["message"]
    assert time.monotonic() - t0 < PREFILL_WAIT  # answered at once, not after the wait timeout
    wait_idle(urls["decode"])
    wait_idle(urls["prefill"])


def test_prefill_never_ready_times_out_then_the_late_prefill_is_dropped(fault_workers):
    _, urls = fault_workers
    rid = _rid(urls)
    early_before = stats(urls["prefill"])["released_early"]
    t0 = time.monotonic()
    status, body = post(urls["decode"], _decode_body(), rid)
    elapsed = time.monotonic() - t0
    assert status == 504, body
    assert f"within {PREFILL_WAIT:g}s" in body["error"]["message"]
    assert PREFILL_WAIT * 0.9 <= elapsed <= PREFILL_WAIT + SWEEP_SLACK, elapsed  # (the wait starts after t0)
    s = wait_idle(urls["decode"])
    assert s["failures"].get("timeout", 0) >= 1
    # The decode worker released it (over the signal plane: wait until prefill heard it): the prefill request
    # arriving now is refused, no KV is held for it.
    _wait_for(urls["prefill"], "released_early", early_before + 1)
    released_before = stats(urls["prefill"])["released_on_arrival"]
    status, body = post(urls["prefill"], _prefill_body(), rid)
    assert status == 409 and "already released" in body["error"]["message"], body
    s = wait_idle(urls["prefill"])
    assert s["released_on_arrival"] == released_before + 1


def test_an_abort_that_overtakes_its_request_drops_the_request_on_arrival(fault_workers):
    """The proxy's /xpyd/abort and the prefill call race: an abort for a request the prefill worker has not
    seen yet is remembered, and the request is refused when it arrives (no KV held until kv_ttl)."""
    _, urls = fault_workers
    rid = _rid(urls)
    released_before = stats(urls["prefill"])["released_on_arrival"]
    req = urllib.request.Request(urls["prefill"] + "/xpyd/abort", data=b"", headers=_headers(urls["prefill"], rid))
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200 and json.loads(r.read()) == {"aborted": rid}
    t0 = time.monotonic()  # its decode side, asking for it meanwhile, is told at once (not at its timeout)
    status, body = post(urls["decode"], _decode_body(), rid)
    assert status == 502 and "released before it reached the prefill worker" in body["error"]["message"], body
    assert time.monotonic() - t0 < PREFILL_WAIT
    status, body = post(urls["prefill"], _prefill_body(), rid)
    assert status == 409 and "already released" in body["error"]["message"], body
    s = wait_idle(urls["prefill"])
    assert s["released_on_arrival"] == released_before + 1
    t0 = time.monotonic()  # and after it was refused too (the entry is not forgotten on arrival)
    status, body = post(urls["decode"], _decode_body(), rid)
    assert status == 502 and "released before it reached the prefill worker" in body["error"]["message"], body
    assert time.monotonic() - t0 < PREFILL_WAIT
    other = _rid(urls)  # an abort remembers only its own id: the next request runs as usual
    status, body = post(urls["prefill"], _prefill_body(), other)
    assert status == 200 and body["usage"]["completion_tokens"] == 1, body
    status, body = post(urls["decode"], _decode_body(), other)
    assert status == 200 and body["usage"]["completion_tokens"] == 6, body
    wait_idle(urls["prefill"])
    wait_idle(urls["decode"])


def test_a_streamed_prefill_wait_timeout_ends_with_an_error_event_coded_504(fault_workers):
    """How the proxy hears it (it always streams from decode): the event's integer code is the status."""
    _, urls = fault_workers
    req = urllib.request.Request(urls["decode"] + "/v1/completions", headers={
        "Content-Type": "application/json", **_headers(urls["decode"], _rid(urls))},
        data=json.dumps({**_decode_body(), "stream": True}).encode())
    with urllib.request.urlopen(req, timeout=PREFILL_WAIT + 10) as r:
        events = [line.removeprefix(b"data: ") for line in r.read().splitlines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", events
    error = json.loads(events[-2])["error"]
    assert error["code"] == 504 and error["type"] == "server_error", error
    assert f"within {PREFILL_WAIT:g}s" in error["message"]
    wait_idle(urls["decode"])


def _open_decode_stream(urls: dict, rid: str) -> socket.socket:
    """Start a streaming decode request on a raw socket (closing it is a client disconnect)."""
    host, port = urls["decode"].removeprefix("http://").split(":")
    body = ('{"prompt": "hello world", "max_tokens": 6, "stream": true, '
            '"kv_transfer_params": {"role": "decode"}}').encode()
    fields = "".join(f"{k}: {v}\r\n" for k, v in _headers(urls["decode"], rid).items())
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"{fields}Content-Length: {len(body)}\r\n\r\n").encode()
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(head + body)
    return sock


def _wait_for(url: str, key: str, value: int) -> None:
    wait_until(lambda: stats(url)[key] == value, f"{key} == {value} on {url}")


def test_client_gone_while_decode_waits_releases_on_prefill(fault_workers):
    """A decode request aborted by its client (here: while waiting for prefill) tells prefill to release it."""
    _, urls = fault_workers
    rid = _rid(urls)
    with _open_decode_stream(urls, rid):
        _wait_for(urls["decode"], "waiting", 1)
    timeouts = stats(urls["decode"])["failures"].get("timeout", 0)
    wait_idle(urls["decode"], timeout=PREFILL_WAIT - 1)  # gone before its wait timeout
    assert stats(urls["decode"])["failures"].get("timeout", 0) == timeouts  # aborted, not timed out
    status, resp = post(urls["prefill"], _prefill_body(), rid)
    assert status == 409 and "already released" in resp["error"]["message"], resp
    wait_idle(urls["prefill"])


def test_release_of_a_queued_prefill_answers_its_http_call(fault_workers):
    """The decode side gives up while the request is still queued on prefill: prefill drops it and its
    HTTP call gets an answer at once (not when a slot frees up)."""
    _, urls = fault_workers
    held = [_rid(urls) for _ in range(4)]  # the prefill worker's 4 slots, held for KV_TTL
    results: dict[str, tuple[int, dict]] = {}
    threads = [threading.Thread(target=lambda r=r: results.setdefault(r, post(urls["prefill"], _prefill_body(), r)))
               for r in held]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(status == 200 for status, _ in results.values()), results
    queued = _rid(urls)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("p", post(urls["prefill"], _prefill_body(), queued)))
    t.start()
    _wait_for(urls["prefill"], "waiting", 1)
    with _open_decode_stream(urls, queued):
        _wait_for(urls["decode"], "waiting", 1)
    t.join(KV_TTL + 10)
    status, body = out["p"]
    assert status == 409 and "released before its prefill ran" in body["error"]["message"], body
    wait_idle(urls["decode"])
    wait_idle(urls["prefill"], timeout=KV_TTL + 5)  # the 4 held ones expire


def test_sigkilled_prefill_fails_waiting_decode_requests_fast(fault_workers):
    cluster, urls = fault_workers
    victim = next(p for p in cluster.procs if p.name == "prefill_victim")
    rids = [_rid(urls, prefill="prefill_victim") for _ in range(4)]
    results: dict[str, tuple[float, int, dict]] = {}
    before = stats(urls["decode"])

    def call(rid: str) -> None:
        status, body = post(urls["decode"], _decode_body(), rid)
        results[rid] = (time.monotonic(), status, body)

    threads = [threading.Thread(target=call, args=(r,)) for r in rids]
    for t in threads:
        t.start()
    # all four wait, and the decode worker is connected to the victim and asking it about each of them
    wait_until(lambda: stats(urls["decode"])["waiting"] == 4, "4 requests waiting on decode")
    wait_until(lambda: stats(urls["decode"])["claims"] >= before["claims"] + 4,
               "decode claiming all 4 requests at the victim")
    killed_at = time.monotonic()
    os.kill(victim.popen.pid, signal.SIGKILL)
    victim.popen.wait(10)
    for t in threads:
        t.join(PREFILL_WAIT + 10)
    assert set(results) == set(rids)
    for ended, status, body in results.values():
        assert status == 502, body
        assert "closed the connection" in body["error"]["message"], body  # not the prefill-wait timeout
        assert ended - killed_at < PREFILL_WAIT
    s = wait_idle(urls["decode"])
    assert s["failures"].get("peer", 0) == before["failures"].get("peer", 0) + 4
    assert s["failures"].get("timeout", 0) == before["failures"].get("timeout", 0)
    # New requests for the dead worker fail fast too (connection refused), and the others still work.
    t0 = time.monotonic()
    status, body = post(urls["decode"], _decode_body(), _rid(urls, prefill="prefill_victim"))
    assert status == 502 and "refused the connection" in body["error"]["message"], body
    assert time.monotonic() - t0 < PREFILL_WAIT  # not the prefill-wait timeout
    (ps, _), (ds, dbody) = _pair(urls, _rid(urls))
    assert ps == 200 and ds == 200, dbody
    wait_idle(urls["decode"])
    wait_idle(urls["prefill"])
