"""Someone else on the bed's network: a script the tests run as a process on a bed host.

``sniff DEV PORT``: an on-path observer. A raw packet socket on ``DEV`` (the host's link) prints, as one
JSON line each, every KV transfer header (the frame that opens a tcp transfer: ``tcp_wire.pack_header``)
that leaves the host for port ``PORT``: ``{"dst": ip, "frame": hex}``. A sender writes each header at
the start of a ``sendmsg`` after the previous transfer's ack (TCP_NODELAY), so a header opens a segment's
payload; nothing is reassembled.

``knock``: a third party. Reads JSON lines ``{"address": "ip:port", "frame": hex, "payload": n}`` on
stdin, opens a connection to that transfer listener, sends the frame and ``n`` bytes of 0xEE behind it
(``tests/door.py``), and prints the listener's answer as a JSON line ``{"replies": [...], "hung_up": b}``.

Run as ``python tests/multihost/third_party.py sniff eth0 8201`` (from the repository's root).
"""

from __future__ import annotations

import json
import socket
import struct
import sys
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


if __name__ == "__main__":
    if sys.argv[1:2] == ["sniff"]:
        sniff(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1:2] == ["knock"]:
        knock()
    else:
        raise SystemExit(__doc__)
