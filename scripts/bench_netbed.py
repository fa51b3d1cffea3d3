#!/usr/bin/env python3
"""`xpyd bench transfer` between two namespace hosts over a shaped link, next to raw TCP on the same link.

Builds a bed of two hosts (scripts/netbed.py), ``tx`` and ``rx``, shapes both links with tc tbf
(default 1gbit; ``--rate none``: unshaped), and runs, one after the other on that link:

1. ``xpyd bench transfer --backend BACKEND --sender <tx> --receiver <rx>``: its socket baseline (plain
   sendmsg/recv_into between two processes, a 1-byte ack per transfer) and then the backend, the same
   sizes and repeats, timed the same way;
2. iperf3 (if installed) from tx to rx for a few seconds, as a cross-check of what the link carries.

Prints the backend's throughput over raw TCP's per size and says whether it reaches ``--goal`` (0.9);
removes the bed at the end, also on failure or Ctrl-C. Needs root.

    .venv/bin/python scripts/bench_netbed.py [--rate 1gbit] [--sizes 1M,16M,64M] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netbed  # noqa: E402  (scripts/ is not a package)

ROOT = Path(__file__).resolve().parent.parent
IPERF_SECONDS = 5
IPERF_PORT = 5201


def bench_transfer(bed: netbed.NetBed, args: argparse.Namespace, out: Path) -> dict:
    tx, rx = bed.host("tx"), bed.host("rx")
    argv = [sys.executable, "-m", "xpyd", "bench", "transfer", "--backend", args.backend, "--sizes", args.sizes,
            "--repeats", str(args.repeats), "--sender", f"{tx.ip}@{tx.ns}", "--receiver", f"{rx.ip}@{rx.ns}",
            "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    subprocess.run(argv, check=True, env=env, stdout=sys.stderr)
    return json.loads(out.read_text())


def iperf3(bed: netbed.NetBed) -> dict | None:
    """iperf3 tx -> rx for IPERF_SECONDS: the receiver's bits per second (or {"error": why}: only a
    cross-check, it never fails the run), None without iperf3."""
    if shutil.which("iperf3") is None:
        return None
    rx = bed.host("rx")
    server = bed.popen(rx, ["iperf3", "-s", "-1", "-B", rx.ip, "-p", str(IPERF_PORT)], stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while f"{rx.ip}:{IPERF_PORT}" not in bed.run(rx, ["ss", "-ltnH"]).stdout:  # until it listens
            if server.poll() is not None or time.monotonic() > deadline:
                return {"error": f"the iperf3 server did not start: {server.communicate()[1].strip()}"}
            time.sleep(0.05)
        client = bed.run("tx", ["iperf3", "-c", rx.ip, "-p", str(IPERF_PORT), "-t", str(IPERF_SECONDS), "-J"],
                         timeout=IPERF_SECONDS + 30)
        try:
            end = json.loads(client.stdout)["end"]
            return {"seconds": IPERF_SECONDS, "received_bps": end["sum_received"]["bits_per_second"],
                    "sent_bps": end["sum_sent"]["bits_per_second"], "retransmits": end["sum_sent"].get("retransmits")}
        except (ValueError, KeyError) as e:
            return {"error": f"iperf3 client: {client.stdout.strip()[-300:] or client.stderr.strip()} ({e!r})"}
    finally:
        if server.poll() is None:
            server.terminate()
        server.communicate(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="1gbit",
                        help="tc tbf rate of both links, none: unshaped veth (default: %(default)s)")
    parser.add_argument("--backend", default="tcp", help="transfer backend (default: %(default)s)")
    parser.add_argument("--sizes", default="1M,16M,64M", help="bytes per transfer (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="timed transfers per size (default: %(default)s)")
    parser.add_argument("--goal", type=float, default=0.9, help="backend / raw TCP to reach (default: %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="write everything measured to PATH")
    args = parser.parse_args(argv)

    reason = netbed.available()
    if reason:
        print(f"bench_netbed: cannot build a bed here: {reason}", file=sys.stderr)
        return 2
    bed = netbed.NetBed(f"bn{os.getpid() % 100000}")
    try:
        for name in ("tx", "rx"):
            bed.add_host(name)
            if args.rate != "none":
                bed.shape(name, args.rate)
        with tempfile.TemporaryDirectory() as tmp:
            report = bench_transfer(bed, args, Path(tmp) / "transfer.json")
        cross = iperf3(bed)
    finally:
        bed.close()

    rows, ok = [], True
    link = "an unshaped veth link" if args.rate == "none" else f"one {args.rate} tbf link"
    print(f"{args.backend} backend vs raw TCP over {link} between two namespace hosts "
          f"(median of {args.repeats}; GB/s = 1e9 bytes/s)")
    print(f"{'size':>7} | {args.backend + ' GB/s':>9} | {'raw TCP GB/s':>12} | {'ratio':>5}")
    for r in report["results"]:
        ratio = r["backend_vs_socket"]
        ok &= ratio >= args.goal
        rows.append({"size_bytes": r["size_bytes"], "backend_gbps": r["gbps"], "socket_gbps": r["socket_gbps"],
                     "ratio": ratio})
        print(f"{r['size_bytes'] / (1 << 20):>5g} M | {r['gbps']:>9.4f} | {r['socket_gbps']:>12.4f} | {ratio:>5.2f}")
    if cross is not None and "error" in cross:
        print(f"iperf3 cross-check failed: {cross['error']}")
    elif cross is not None:
        gbps = cross["received_bps"] / 8e9
        best = max(r["gbps"] for r in report["results"])
        print(f"iperf3 {IPERF_SECONDS} s, same link: {gbps:.4f} GB/s ({cross['received_bps'] / 1e6:.0f} Mbit/s, "
              f"{cross['retransmits']} retransmits); largest-size backend / iperf3 = {best / gbps:.2f}")
    else:
        print("iperf3: not installed, no cross-check (apt-get install -y iperf3)")
    print(f"goal {args.backend}/raw TCP >= {args.goal}: {'met' if ok else 'NOT met'} at every size")
    if args.json:
        Path(args.json).write_text(json.dumps({"rate": args.rate, "rows": rows, "iperf3": cross,
                                               "goal": args.goal, "met": ok, "transfer": report}, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
