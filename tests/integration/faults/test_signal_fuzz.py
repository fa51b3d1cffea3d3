"""Generated hostile input against a real prefill worker's ROUTER and a real decode worker's KV listener.

Each bad signal frame gets a reply (an ``error``, or a typed refusal) and changes nothing; a frame over
the size limit closes that connection only; each bad transfer header gets a refusal ack or a closed
connection and never a write into the pool. Afterwards both processes are alive, hold nothing, logged
no traceback, and serve a good request.
"""

from __future__ import annotations

import random
import socket
import struct

import msgpack
import pytest
import zmq

from tests.integration.faults.fault_helpers import TOKEN, info, stats, wait_idle
from tests.integration.faults.fault_helpers import pair as _pair
from tests.integration.faults.fault_helpers import rid_for as _rid
from tests.waiting import wait_until
from xpyd import PROTOCOL_VERSION
from xpyd.signal import auth
from xpyd.model.fingerprint import weights_fingerprint
from xpyd.signal import messages as m
from xpyd.signal.request_id import RequestId

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
