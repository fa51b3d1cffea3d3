"""Small transfers behind a large one to the same peer: how long each takes, with 1 lane and with more.

One sender and one receiver backend (tcp or shm, real sockets / shared memory, in this process). For each
``--lanes`` value: start one large transfer, and once it moves, send ``--smalls`` small ones to the same
peer one after another (each waited for); report each small's latency (p50, p99, max), how many finished
while the large one was still in flight, and the large one's own time. With 1 lane (one sender per peer,
stop-and-wait) the first small waits for the whole large transfer; with lanes they overtake it.

    .venv/bin/python scripts/transfer_overtake.py --backend tcp --large-mib 256 --smalls 50 --lanes 1 4 \\
        [--json OUT.json]

Smoke run: ``--large-mib 16 --smalls 5``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from xpyd.transfer import make_backend
from xpyd.transfer.auth import new_secret
from xpyd.transfer.base import Region, TransferState

TIMEOUT = 600.0


def _side(backend: str, lanes: int, size: int, data: bytes | None):
    b = make_backend(backend, host="127.0.0.1", io_timeout=120.0, lanes=lanes)
    mem = b.allocate(size) if backend == "shm" else None
    buf = mem if mem is not None else memoryview(bytearray(size))
    if data is not None:
        buf[:] = data
    return b, buf, b.register(buf)


def run(backend: str, lanes: int, large: int, small: int, smalls: int) -> dict:
    size = large + smalls * small
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    sender, _, _ = _side(backend, lanes, size, data)
    receiver, rbuf, rdesc = _side(backend, lanes, size, None)
    secret = new_secret()
    try:
        def start(tid: str, offset: int, length: int):
            region = [Region(offset, length)]
            rtok = receiver.expect(tid, region, secret=secret)
            return sender.send(tid, region, rdesc, region, secret=secret), rtok

        t0 = time.perf_counter()
        big, _ = start("large", 0, large)
        while big.state() is TransferState.PENDING:
            time.sleep(0.0005)
        latencies, overtook = [], 0
        for i in range(smalls):
            t = time.perf_counter()
            tok, _ = start(f"small{i}", large + i * small, small)
            if not tok.wait(TIMEOUT) or not tok.done():
                raise RuntimeError(f"small transfer {i} failed: {tok.error}")
            latencies.append(time.perf_counter() - t)
            overtook += not big.finished()
        if not big.wait(TIMEOUT) or not big.done():
            raise RuntimeError(f"large transfer failed: {big.error}")
        large_s = time.perf_counter() - t0
        if bytes(rbuf) != data:
            raise RuntimeError("the bytes that landed differ from the ones sent")
    finally:
        sender.close()
        receiver.close()
    ms = sorted(x * 1e3 for x in latencies)
    return {"backend": backend, "lanes": lanes, "large_bytes": large, "small_bytes": small, "smalls": smalls,
            "small_ms_p50": statistics.median(ms), "small_ms_p99": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
            "small_ms_max": ms[-1], "smalls_done_while_large_in_flight": overtook, "large_s": large_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("tcp", "shm"), default="tcp")
    ap.add_argument("--large-mib", type=int, default=256)
    ap.add_argument("--small-kib", type=int, default=64)
    ap.add_argument("--smalls", type=int, default=50)
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    results = []
    for lanes in args.lanes:
        r = run(args.backend, lanes, args.large_mib << 20, args.small_kib << 10, args.smalls)
        results.append(r)
        print(f"{r['backend']} lanes={lanes}: small ({args.small_kib} KiB) p50 {r['small_ms_p50']:.2f} ms "
              f"p99 {r['small_ms_p99']:.2f} ms max {r['small_ms_max']:.2f} ms; "
              f"{r['smalls_done_while_large_in_flight']}/{args.smalls} done while the large "
              f"({args.large_mib} MiB) was in flight; large {r['large_s']:.3f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
