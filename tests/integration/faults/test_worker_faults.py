"""Worker-side faults with real processes: KV lease, prefill-wait timeout, dead prefill, aborts, cluster token;
and generated hostile input against the workers' signal plane and KV listener.

Every test ends by checking that the workers it used hold nothing (requests, KV slots, transfers).

The fuzz tests (in this file with the fault tests: they share one worker set, faults/conftest.py, and the suite's pytest
processes take whole files): generated hostile input against a real prefill worker's ROUTER and a real decode
worker's KV listener. Each bad signal frame gets a reply (an ``error``, or a typed refusal) and changes
nothing; a frame over the size limit closes that connection only; each bad transfer header gets a refusal ack
or a closed connection and never a write into the pool. Afterwards both processes are alive, hold nothing,
logged no traceback, and serve a good request.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import struct
import threading
import time
import urllib.request

import msgpack
import pytest
import zmq

from tests.integration.faults.fault_helpers import KV_TTL, PREFILL_WAIT, TOKEN, info, post, stats, wait_idle
from tests.integration.faults.fault_helpers import decode_body as _decode_body
from tests.integration.faults.fault_helpers import headers as _headers
from tests.integration.faults.fault_helpers import pair as _pair
from tests.integration.faults.fault_helpers import prefill_body as _prefill_body
from tests.integration.faults.fault_helpers import rid_for as _rid
from tests.waiting import wait_until
from xpyd import PROTOCOL_VERSION
from xpyd.model.fingerprint import weights_fingerprint
from xpyd.signal import auth
from xpyd.signal import messages as m
from xpyd.signal.request_id import RequestId, parse_request_id

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


# -- generated hostile input (before the SIGKILL test below: it kills prefill_victim, and the worker set
# is started afresh for a test that finds a worker dead) ------------------------------

SEED = 6
N_SIGNAL = 2000
N_TRANSFER = 300
IDENTITY = "127.0.0.1:9"  # the fuzzer's DEALER identity (a host:port, so request ids can name it)
REPLY_TYPES = {"error", "handshake_reply", "kv_map_reply", "lookup_reply", "release_reply", "auth_reply"}
COMPAT = {"layout": "block-head-major/1", "block_size": 16, "num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32"}
BLOCK_BYTES = 16 * 2 * 2 * 2 * 16 * 4  # tokens x layers x K/V x kv heads x head_dim x float32


def _junk(rng: random.Random, depth: int = 0):
    """A random msgpack-able value of a random type."""
    kinds = ["none", "bool", "int", "bigint", "neg", "float", "str", "longstr", "bytes", "list", "map"]
    k = rng.choice(kinds if depth < 3 else kinds[:9])
    return {
        "none": lambda: None, "bool": lambda: rng.random() < 0.5, "int": lambda: rng.randint(0, 1000),
        "bigint": lambda: rng.choice([2**63 - 1, 2**64 - 1]), "neg": lambda: -rng.randint(1, 2**31),
        "float": lambda: rng.random() * 1e6, "str": lambda: "".join(rng.choice("ab~:é\x00") for _ in range(8)),
        "longstr": lambda: "x" * rng.choice([601, 5000, 100_000]), "bytes": lambda: rng.randbytes(rng.randint(0, 40)),
        "list": lambda: [_junk(rng, depth + 1) for _ in range(rng.randint(0, 4))],
        "map": lambda: {str(i): _junk(rng, depth + 1) for i in range(rng.randint(0, 4))},
    }[k]()


def _bodies(rng: random.Random, prefill_addr: str) -> list[tuple[str, dict]]:
    rid = str(RequestId.new(prefill_addr, IDENTITY))
    transfer = {"backend": "tcp", "address": "127.0.0.1:9", "buffer_size": 1 << 20}
    return [
        ("handshake", {"sender": IDENTITY, "model_id": "x", "kv_compat": COMPAT}),
        ("hello", {"sender": IDENTITY, "instance": "fuzz", "nonce": rng.randbytes(32), "token": rng.random() < 0.5}),
        ("proof", {"proof": rng.choice([None, rng.randbytes(32)])}),
        ("kv_map_init", {"sender": IDENTITY, "transfer": transfer, "block_bytes": 4096, "num_blocks": 4}),
        ("lookup_all", {"sender": IDENTITY, "entries": [[rid, None], [rid, [0]], ["xpyd-not-an-id", None]]}),
        ("release", {"sender": IDENTITY, "request_ids": [rid, "garbage"]}),
    ]


def _bad_frame(rng: random.Random, prefill_addr: str) -> bytes | list[bytes]:
    t, body = rng.choice(_bodies(rng, prefill_addr))
    msg = {"type": t, **body}
    env = {"version": PROTOCOL_VERSION, "seq": rng.randint(0, 1000), "msg": msg}
    kind = rng.randrange(8)
    if kind == 0:
        return rng.randbytes(rng.randint(0, 300))
    if kind == 1:  # truncated
        frame = msgpack.packb(env)
        return frame[: rng.randint(0, len(frame) - 1)]
    if kind == 2:  # trailing bytes
        return msgpack.packb(env) + rng.randbytes(rng.randint(1, 20))
    if kind == 3:  # an envelope field or the message tag of the wrong type, or missing
        key = rng.choice(["version", "seq", "msg", "type"])
        where = msg if key == "type" else env
        if rng.random() < 0.3:
            del where[key]
        else:
            where[key] = _junk(rng)
    elif kind == 4:  # a message field of the wrong type, or missing
        key = rng.choice(list(body))
        if rng.random() < 0.3:
            del msg[key]
        else:
            msg[key] = _junk(rng)
    elif kind == 5:  # unknown type / wrong protocol version
        where, key = (msg, "type") if rng.random() < 0.5 else (env, "version")
        where[key] = rng.choice(["evil", "handshake_reply", PROTOCOL_VERSION + 1, 0])
    elif kind == 6:  # request ids that do not parse, or too many entries
        if t == "lookup_all":
            msg["entries"] = [[_junk(rng) if rng.random() < 0.5 else "x" * rng.randint(1, 700), None]
                              for _ in range(rng.choice([1, 3, m.MAX_ENTRIES + 1]))]
        else:
            msg["request_ids"] = [rng.choice(["", "~~", "xpyd-" + "0" * 32, "x" * 700])]
            msg["type"] = "release"
    else:  # several frames in one message
        return [msgpack.packb(env), rng.randbytes(8)]
    return msgpack.packb(env)


def _size(frame: bytes | list[bytes]) -> int:
    return sum(map(len, frame)) if isinstance(frame, list) else len(frame)


def _dealer(ctx: zmq.Context, port: int, identity: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity.encode())  # (a name the server ignores: sessions are per connection)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def _no_tracebacks(cluster, *names: str) -> None:
    for p in cluster.procs:
        if p.name in names:
            assert p.popen.poll() is None, f"{p.name} died:\n{p.tail()}"
            assert "Traceback" not in p.log.read_text(errors="replace"), p.tail(80)


def test_fuzz_signal_plane_of_a_real_prefill_worker(fault_workers, tiny_model_dir):
    cluster, urls = fault_workers
    port = int(urls["prefill_signal"].rsplit(":", 1)[1])
    rng = random.Random(SEED)
    ctx = zmq.Context()
    try:
        sock = _dealer(ctx, port, IDENTITY)
        # Shake hands and map properly once, so that fuzzed lookups and releases reach the deep paths too.
        model = info(urls["prefill"])["model_id"]
        hello = m.Hello(IDENTITY, "fuzz", auth.new_nonce(), True)
        frame = m.encode(1, hello)
        sock.send(frame)
        challenge = m.decode(sock.recv()).msg
        assert challenge.proof == auth.prefill_proof(TOKEN, hello.nonce, challenge.nonce, frame)
        sock.send(m.encode(2, m.Proof(auth.decode_proof(TOKEN, challenge.nonce, hello.nonce, frame))))
        assert m.decode(sock.recv()).msg == m.AuthReply(True)
        # (the weights the workers loaded are part of what must match)
        compat = {**COMPAT, "weights": "weights:" + weights_fingerprint(tiny_model_dir)}
        sock.send(m.encode(1, m.Handshake(IDENTITY, model, compat)))
        assert m.decode(sock.recv()).msg == m.HandshakeReply(True, None, model)
        sock.send(m.encode(2, m.KVMapInit(IDENTITY, {"backend": "tcp", "address": "127.0.0.1:9",
                                                     "buffer_size": 1 << 20}, BLOCK_BYTES, 4)))
        assert m.decode(sock.recv()).msg == m.KVMapReply(True)
        before = stats(urls["prefill"])
        kinds: dict[str, int] = {}
        for i in range(N_SIGNAL):
            frame = _bad_frame(rng, urls["prefill_signal"])
            while _size(frame) > m.MAX_FRAME_BYTES:  # those close the connection: tested on their own below
                frame = _bad_frame(rng, urls["prefill_signal"])
            if isinstance(frame, list):
                sock.send_multipart(frame)
            else:
                sock.send(frame)
            try:
                raw = sock.recv()  # every frame must be answered (RCVTIMEO 5 s)
            except zmq.Again:
                pytest.fail(f"no reply to fuzz frame {i} ({_size(frame)} bytes): {str(frame)[:400]}")
            reply = msgpack.unpackb(raw, raw=False)  # read raw: the wire shape itself is checked
            assert reply["version"] == PROTOCOL_VERSION and reply["msg"]["type"] in REPLY_TYPES, reply
            body, t = reply["msg"], reply["msg"]["type"]
            kinds[t] = kinds.get(t, 0) + 1
            if t == "handshake_reply":  # fuzzed handshakes name another model; hellos come on an open session
                assert body["ok"] is False and ("model mismatch" in body["error"]
                                                or "open already" in body["error"]), reply
            if t == "auth_reply":  # a proof with no hello pending
                assert body == {"type": "auth_reply", "ok": False, "error": "hello first"}, reply
            if t == "lookup_reply":  # only ids this identity may ask about, none ready
                assert all(r[1] in ("unknown", "failed") for r in body["results"]), reply
            if t == "release_reply":
                assert body["released"] == 0
        assert kinds.get("error", 0) > N_SIGNAL // 2, kinds
        # A frame over the limit: ZMQ closes that connection; the ROUTER keeps serving the others.
        big = _dealer(ctx, port, "127.0.0.1:10")
        big.send(b"\x00" * (m.MAX_FRAME_BYTES + 1))
        big.close(0)
        sock.send(m.encode(7, m.Release(IDENTITY, ())))
        assert m.decode(sock.recv()).msg == m.ReleaseReply(0)
        stranger = _dealer(ctx, port, "127.0.0.1:11")  # never proved the token: nothing but a hello is served,
        # even in the name of a worker that has a session
        for seq, msg in enumerate([m.Release(IDENTITY, ()), m.LookupAll(IDENTITY, ()), m.Handshake(IDENTITY, "x", COMPAT),
                                   m.KVMapInit(IDENTITY, {"backend": "tcp", "address": "127.0.0.1:9",
                                                          "buffer_size": 1 << 20}, 4096, 4)]):
            stranger.send(m.encode(seq, msg))
            assert m.decode(stranger.recv()).msg == m.ErrorReply("handshake first")
        stranger.close(0)
        sock.close(0)
    finally:
        ctx.destroy(linger=0)
    after = wait_until(lambda: (s := stats(urls["prefill"]))["handshaken"] < before["handshaken"] and s,
                       "the fuzzer's session to end with its connection")  # (wait_until from tests.waiting)
    after = wait_idle(urls["prefill"])
    assert after["handshaken"] == before["handshaken"] - 1 and after["peers"] == before["peers"] - 1
    for key in ("sends", "expired"):
        assert after[key] == before[key], (key, before, after)
    (ps, _), (ds, dbody) = _pair(urls, _rid(urls))
    assert ps == 200 and ds == 200, dbody
    wait_idle(urls["prefill"])
    wait_idle(urls["decode"])
    _no_tracebacks(cluster, "prefill", "decode")


def _frame(obj) -> bytes:
    body = msgpack.packb(obj)
    return struct.pack(">I", len(body)) + body


def _bad_transfer_bytes(rng: random.Random) -> bytes:
    header = {"v": PROTOCOL_VERSION, "id": "xpyd-" + rng.randbytes(16).hex(), "dst": [[0, 64]], "total": 64}
    kind = rng.randrange(6)
    if kind == 0:  # garbage / wrong magic
        return rng.randbytes(rng.randint(1, 200))
    if kind == 1:  # length prefix out of range, or lying
        n = rng.choice([0, (1 << 20) + 1, 0xFFFFFFFF, rng.randint(1, 50)])
        return struct.pack(">I", n) + rng.randbytes(rng.randint(0, 60))
    if kind == 2:  # a field of the wrong type or missing
        key = rng.choice(list(header))
        if rng.random() < 0.3:
            del header[key]
        else:
            header[key] = _junk(rng)
        return _frame(header)
    if kind == 3:  # regions out of range, negative, not adding up
        header["dst"] = rng.choice([[[-1, 64]], [[0, 0]], [[2**62, 64]], [[0, 32]], [[0, 64]] * 3, [], [[0]]])
        header["total"] = rng.choice([64, 0, -5, 2**40])
        return _frame(header) + rng.randbytes(64)
    if kind == 4:  # wrong protocol version, with its payload
        header["v"] = rng.choice([0, PROTOCOL_VERSION + 1, 99])
        return _frame(header) + rng.randbytes(64)
    # a well-formed header for a transfer nobody expects, with its payload (drained, refused)
    return _frame(header) + rng.randbytes(64)


def _exchange(addr: tuple[str, int], payload: bytes) -> bytes:
    with socket.create_connection(addr, timeout=5) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the listener already closed it (broken pipe, reset, not connected)
            return b""
        out = bytearray()
        try:
            while chunk := sock.recv(65536):  # the listener closes the connection (timeout: it hangs)
                out += chunk
        except ConnectionResetError:
            pass
        return bytes(out)


def _acks(data: bytes) -> list[dict]:
    acks = []
    while len(data) >= 4:
        (n,) = struct.unpack(">I", data[:4])
        acks.append(msgpack.unpackb(data[4 : 4 + n], raw=False))
        data = data[4 + n :]
    return acks


def test_fuzz_transfer_listener_of_a_real_decode_worker(fault_workers):
    cluster, urls = fault_workers
    host, port = urls["decode_id"].rsplit(":", 1)
    rng = random.Random(SEED)
    before = wait_idle(urls["decode"])
    refused = 0
    for _ in range(N_TRANSFER):
        for ack in _acks(_exchange((host, int(port)), _bad_transfer_bytes(rng))):
            assert ack["ok"] is False and ack["error"], ack
            refused += 1
    assert refused > 0  # well-formed headers for unknown ids / other versions are answered
    after = wait_idle(urls["decode"])
    assert after["pulls"] == before["pulls"]
    (ps, _), (ds, dbody) = _pair(urls, _rid(urls))
    assert ps == 200 and ds == 200, dbody
    wait_idle(urls["decode"])
    wait_idle(urls["prefill"])
    _no_tracebacks(cluster, "prefill", "decode")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_workers_bind_the_configured_host_only(fault_workers, role):
    """HTTP, signal plane and KV listener of each worker are bound to 127.0.0.1 (the default), not 0.0.0.0."""
    import psutil

    cluster, _ = fault_workers
    proc = next(p for p in cluster.procs if p.name == role)
    listening = [c.laddr for c in psutil.Process(proc.popen.pid).net_connections("inet")
                 if c.status == psutil.CONN_LISTEN]
    assert len(listening) >= (3 if role == "prefill" else 2), listening
    assert all(addr.ip == "127.0.0.1" for addr in listening), listening


# -- a dead prefill worker (last: it kills prefill_victim) ------------------------------


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
