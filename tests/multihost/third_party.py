"""Someone else on the bed's network: a script the tests run as a process on a bed host.

``sniff DEV PORT``: an on-path observer. A raw packet socket on ``DEV`` (the host's link) prints, as one
JSON line each, every KV transfer header (the frame that opens a tcp transfer: ``tcp_wire.pack_header``)
that leaves the host for port ``PORT``: ``{"dst": ip, "frame": hex}``. A sender writes each header at
the start of a ``sendmsg`` after the previous transfer's ack (TCP_NODELAY), so a header opens a segment's
payload; nothing is reassembled.

``knock``: a third party. Reads JSON lines ``{"address": "ip:port", "frame": hex, "payload": n}`` on
stdin, opens a connection to that transfer listener, sends the frame and ``n`` bytes of 0xEE behind it
(``tests/door.py``), and prints the listener's answer as a JSON line ``{"replies": [...], "hung_up": b}``.

``mallory``: a hostile host (tests/multihost/test_hostile_host.py). Reads JSON lines ``{"op": ..., ...}`` on
stdin and answers each with one JSON line: ``trap PORT`` (a TCP listener on every address of the host,
recording who connects), ``caught`` (who did so far), ``post`` (an HTTP call), ``signal`` (a ZMQ DEALER at a
prefill worker's signal plane: a hello, a proof it cannot make, then the frames given; every frame it gets
back, decoded), ``flood`` (idle connections held at a transfer listener, the closed ones reopened; how long
each lived) and ``replay`` (bytes recorded elsewhere sent verbatim on a fresh connection, in steps; what came back).

``tcp_streams`` and ``zmtp_messages`` read what a ``tcpdump -w`` capture recorded: each TCP direction's
bytes in order, and the messages of a ZMTP 3 stream.

Run as ``python tests/multihost/third_party.py sniff eth0 8201`` (from the repository's root).
"""

from __future__ import annotations

import http.client
import json
import secrets
import select
import socket
import struct
import sys
import threading
import time
from pathlib import Path

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4


def sniff(dev: str, port: int) -> None:
    import msgpack

    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))  # (a tap on one protocol
    sock.bind((dev, 0))  # sees only what the host receives, not what it sends)
    print(json.dumps({"listening": dev}), flush=True)
    while True:
        frame, addr = sock.recvfrom(1 << 18)
        if addr[2] != PACKET_OUTGOING or len(frame) < 14 + 20 or frame[12:14] != b"\x08\x00":  # IPv4 only
            continue
        ip = frame[14:]
        ihl = (ip[0] & 0x0F) * 4
        if ip[9] != socket.IPPROTO_TCP:
            continue
        total = struct.unpack(">H", ip[2:4])[0] or len(ip)  # (0 in a GSO super-packet on some kernels)
        tcp = ip[ihl:total]
        if len(tcp) < 20 or struct.unpack(">H", tcp[2:4])[0] != port:
            continue
        payload = tcp[(tcp[12] >> 4) * 4:]
        if len(payload) < 5 or not 0x80 <= payload[4] <= 0x8F:  # u32 length, then a msgpack fixmap
            continue
        length = struct.unpack(">I", payload[:4])[0]
        if len(payload) < 4 + length:
            continue
        try:
            header = msgpack.unpackb(payload[4:4 + length], raw=False)
        except Exception:  # noqa: BLE001 - KV bytes that happen to look like a frame start
            continue
        if isinstance(header, dict) and {"id", "dst", "mac"} <= header.keys():
            print(json.dumps({"dst": socket.inet_ntoa(ip[16:20]), "frame": payload[:4 + length].hex()}), flush=True)


def knock() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests import door

    for line in sys.stdin:
        ask = json.loads(line)
        try:
            answer = door.knock_tcp(ask["address"], bytes.fromhex(ask["frame"]), b"\xee" * ask["payload"])
            out = {"replies": answer.replies, "hung_up": answer.hung_up}
        except OSError as e:
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)


# -- mallory -----------------------------------------------------------------------------------------


class Trap:
    """A TCP listener on every address of the host: who connected, and how many bytes they sent."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_server(("0.0.0.0", port), reuse_port=False)
        self.peers: list[str] = []
        self.bytes = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            conn, addr = self.sock.accept()
            self.peers.append(addr[0])
            conn.settimeout(2)
            try:
                while chunk := conn.recv(1 << 16):
                    self.bytes += len(chunk)
            except OSError:
                pass
            conn.close()


def post(url: str, headers: dict, body: dict) -> dict:
    host, port = url.removeprefix("http://").split("/", 1)[0].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("POST", "/" + url.removeprefix("http://").split("/", 1)[1], json.dumps(body),
                     {"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        return {"status": resp.status, "body": resp.read()[:400].decode(errors="replace")}
    finally:
        conn.close()


def signal(address: str, routing_id: str | None, claim_token: bool, sender: str, frames: list[str],
           wait: float) -> dict:
    """A DEALER at ``address`` (routing id ``routing_id``, hex, if given): a hello as ``sender`` saying it
    proves a token (``claim_token``) or not, a random proof if challenged, then ``frames`` (hex); every frame
    that comes back within ``wait`` seconds of the last, decoded."""
    import zmq

    from xpyd.signal import auth
    from xpyd.signal import messages as m

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, bytes.fromhex(routing_id))
    sock.connect(f"tcp://{address}")
    got: list[dict] = []

    def receive(until: float, one: bool) -> None:
        while (left := until - time.monotonic()) > 0 and sock.poll(int(left * 1000)):
            frame = sock.recv()
            try:
                env = m.decode(frame)
                msg = env.msg
                got.append({"type": msg.TYPE, "seq": env.seq, "ok": getattr(msg, "ok", None),
                            "error": getattr(msg, "error", None)})
            except m.MessageError as e:
                got.append({"type": "undecodable", "error": str(e)[:200]})
            if one:
                return

    try:
        sock.send(m.encode(1, m.Hello(sender, auth.new_instance(), auth.new_nonce(), claim_token)))
        receive(time.monotonic() + 5, one=True)
        if got and got[-1]["type"] == "challenge":
            sock.send(m.encode(2, m.Proof(secrets.token_bytes(auth.PROOF_BYTES))))
            receive(time.monotonic() + 5, one=True)
        for f in frames:
            sock.send(bytes.fromhex(f))
        receive(time.monotonic() + wait, one=False)
    finally:
        sock.close(0)
        ctx.term()
    return {"received": got}


def flood(address: str, hold: int, seconds: float, openings: list[str], pace: float, bound: float) -> dict:
    """Hold ``hold`` connections to ``address`` for ``seconds``, connection n first sending
    ``openings[n % len]`` (hex) and then nothing; one the listener closes is reopened. Then wait up to
    ``bound`` seconds for the listener to close the rest. Each connection's life (connect to the EOF it got)."""
    host, port = address.rsplit(":", 1)
    held: list[tuple[socket.socket, float]] = []
    lives: list[float] = []
    opened = refused = received = 0

    def reap() -> None:
        nonlocal received
        for pair in list(held):
            sock, t0 = pair
            closed = False
            while select.select([sock], [], [], 0)[0]:
                try:
                    chunk = sock.recv(4096)
                except OSError:
                    closed = True
                    break
                if not chunk:
                    closed = True
                    break
                received += len(chunk)
            if closed:
                lives.append(time.monotonic() - t0)
                sock.close()
                held.remove(pair)

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        reap()
        if len(held) < hold:
            try:
                sock = socket.create_connection((host, int(port)), timeout=2)
                sock.sendall(bytes.fromhex(openings[opened % len(openings)]))
                held.append((sock, time.monotonic()))
                opened += 1
            except OSError:
                refused += 1
        time.sleep(pace)
    deadline = time.monotonic() + bound
    while held and time.monotonic() < deadline:
        reap()
        time.sleep(0.01)
    still_open = len(held)
    for sock, _ in held:
        sock.close()
    return {"opened": opened, "refused": refused, "lives": lives, "still_open": still_open, "received": received}


def replay(address: str, chunks: list[str], wait: float) -> dict:
    """``chunks`` (hex) sent verbatim on a new connection to ``address``, each once the answer to the one before
    went quiet for ``wait`` seconds (a ZMTP peer takes the rest of a stream only after its greeting); all that
    came back."""
    host, port = address.rsplit(":", 1)
    out = b""
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        for chunk in chunks:
            sock.sendall(bytes.fromhex(chunk))
            while select.select([sock], [], [], wait)[0]:
                try:
                    data = sock.recv(1 << 16)
                except OSError:
                    return {"received": out.hex(), "closed": True}
                if not data:
                    return {"received": out.hex(), "closed": True}
                out += data
    return {"received": out.hex(), "closed": False}


def mallory() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    traps: list[Trap] = []
    for line in sys.stdin:
        ask = json.loads(line)
        op = ask.pop("op")
        try:
            if op == "trap":
                traps.append(Trap(ask["port"]))
                out = {"trapping": ask["port"]}
            elif op == "caught":
                out = {"peers": [p for t in traps for p in t.peers], "bytes": sum(t.bytes for t in traps)}
            else:
                out = {"post": post, "signal": signal, "flood": flood, "replay": replay}[op](**ask)
        except Exception as e:  # noqa: BLE001 - said back to the test
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)


# -- reading a capture ------------------------------------------------------------------------------


def tcp_streams(pcap: bytes) -> dict[tuple[str, int, str, int], bytes]:
    """Each TCP direction's payload, in sequence order, from a libpcap file of Ethernet frames (``tcpdump
    -w``): ``(src, sport, dst, dport) -> bytes``. Retransmitted bytes count once."""
    order = {b"\xd4\xc3\xb2\xa1": "<", b"\x4d\x3c\xb2\xa1": "<",  # (microsecond, nanosecond timestamps)
             b"\xa1\xb2\xc3\xd4": ">", b"\xa1\xb2\x3c\x4d": ">"}[pcap[:4]]
    if struct.unpack(order + "I", pcap[20:24])[0] != 1:
        raise ValueError("not an Ethernet capture")
    segments: dict[tuple, dict[int, bytes]] = {}
    base: dict[tuple, int] = {}
    i = 24
    while i + 16 <= len(pcap):
        incl = struct.unpack(order + "I", pcap[i + 8:i + 12])[0]
        frame = pcap[i + 16:i + 16 + incl]
        i += 16 + incl
        if len(frame) < 34 or frame[12:14] != b"\x08\x00":
            continue
        ip = frame[14:]
        ihl = (ip[0] & 0x0F) * 4
        if ip[9] != socket.IPPROTO_TCP:
            continue
        total = struct.unpack(">H", ip[2:4])[0] or len(ip)
        tcp = ip[ihl:total]
        sport, dport, seq = struct.unpack(">HHI", tcp[:8])
        flow = (socket.inet_ntoa(ip[12:16]), sport, socket.inet_ntoa(ip[16:20]), dport)
        payload = tcp[(tcp[12] >> 4) * 4:]
        if tcp[13] & 0x02:  # SYN: the stream's bytes start at seq + 1
            base[flow] = (seq + 1) & 0xFFFFFFFF
            continue
        if payload:
            start = (seq - base.setdefault(flow, seq)) & 0xFFFFFFFF
            segments.setdefault(flow, {})[start] = max(payload, segments.get(flow, {}).get(start, b""), key=len)
    streams = {}
    for flow, parts in segments.items():
        data = b""
        for start in sorted(parts):
            if start + len(parts[start]) > len(data) >= start:
                data += parts[start][len(data) - start:]
        streams[flow] = data
    return streams


def zmtp_messages(data: bytes) -> list[bytes]:
    """The message frames in one direction of a ZMTP 3 connection (greeting and commands skipped; a
    truncated last frame too)."""
    if len(data) < 64 or data[0] != 0xFF or data[9] != 0x7F:
        raise ValueError("not a ZMTP 3 stream")
    i, out = 64, []
    while i < len(data):
        flags = data[i]
        if flags & 0x02:
            if i + 9 > len(data):
                break
            size, i = struct.unpack(">Q", data[i + 1:i + 9])[0], i + 9
        else:
            if i + 2 > len(data):
                break
            size, i = data[i + 1], i + 2
        body, i = data[i:i + size], i + size
        if len(body) < size:
            break
        if not flags & 0x04:
            out.append(body)
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["sniff"]:
        sniff(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1:2] == ["knock"]:
        knock()
    elif sys.argv[1:2] == ["mallory"]:
        mallory()
    else:
        raise SystemExit(__doc__)
