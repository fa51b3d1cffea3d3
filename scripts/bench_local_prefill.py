#!/usr/bin/env python3
"""Conditional disaggregation, measured: `xpyd up` (1P1D, the default model) with the decode worker prefilling
short prompts itself (the default --local-prefill-max-tokens) against always remote (0), driven by `xpyd bench`
through the proxy with cold prompts (no shared prefixes) of each --input-lens length. Prints one table row per
(length, configuration): client TTFT p50/p90, ITL p50, and how many requests each path served (the proxy's
xpyd_proxy_prefill_path_total); writes each bench's JSON under --out.

    .venv/bin/python scripts/bench_local_prefill.py [--input-lens 64,1024] [--requests 32] [--concurrency 4] \
        [--output-len 32] [--rounds 2] [--out DIR] [--up-args "--dtype bfloat16"]

The two configurations alternate, --rounds times (a shared machine's load moves); each row is the median of the
rounds' p50s. Starts its own clusters on free ports and stops them; nothing but 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CONFIGS = {"remote (0)": ["--local-prefill-max-tokens", "0"], "conditional (default)": []}


def _free_base(n: int) -> int:
    for base in range(23000, 30000, 10):
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def _paths(port: int) -> dict[str, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {m[0]: int(float(m[1])) for m in re.findall(r'xpyd_proxy_prefill_path_total\{path="(\w+)"\} (\S+)', text)}


def _run(args, name: str, extra: list[str], round_: int, env: dict) -> dict[int, dict]:
    """One cluster of configuration ``name``: a bench per input length; {length: summary}."""
    base = _free_base(30)
    out = args.out / f"{name.split()[0]}-{round_}"
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "up.log"
    rows = {}
    with log_path.open("wb") as log:
        up = subprocess.Popen([sys.executable, "-m", "xpyd", "up", "--port", str(base), "--prefill-port",
                               str(base + 10), "--decode-port", str(base + 20), *extra, *shlex.split(args.up_args)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while "Press Ctrl-C to stop" not in log_path.read_text(errors="replace"):
                if up.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("xpyd up did not start:\n" + log_path.read_text()[-2000:])
                time.sleep(0.5)
            for n in args.input_lens:
                before = _paths(base)
                report = out / f"bench-{n}.json"
                subprocess.run([sys.executable, "-m", "xpyd", "bench", "--url", f"http://127.0.0.1:{base}",
                                "--no-progress", "--num-requests", str(args.requests), "--concurrency",
                                str(args.concurrency), "--input-len", str(n), "--output-len", str(args.output_len),
                                "--warmup", "2", "--seed", str(1000 * round_ + n), "--json", str(report)],
                               check=True, env=env, timeout=3600, stdout=subprocess.DEVNULL)
                after = _paths(base)
                r = json.loads(report.read_text())
                rows[n] = {"ttft_p50": r["ttft_ms"]["p50"], "ttft_p90": r["ttft_ms"]["p90"],
                           "itl_p50": r["itl_ms"]["p50"],
                           "paths": {k: after.get(k, 0) - before.get(k, 0) for k in ("remote", "local")}}
        finally:
            os.killpg(up.pid, signal.SIGTERM)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input-lens", default="64,1024", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench-local-prefill"))
    ap.add_argument("--up-args", default="", help="more `xpyd up` options, one string")
    args = ap.parse_args()
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    env.pop("XPYD_LOCAL_PREFILL_MAX_TOKENS", None)  # (the proxy's default is what is measured)
    results: dict[str, list[dict[int, dict]]] = {name: [] for name in CONFIGS}
    loads = []
    for round_ in range(args.rounds):
        for name, extra in CONFIGS.items():
            loads.append(os.getloadavg()[0])
            results[name].append(_run(args, name, extra, round_, env))
    print(f"load average (1 min) at each cluster's start: {', '.join(f'{x:.2f}' for x in loads)}")
    print("| input tokens | prefill | TTFT p50 (ms) | TTFT p90 (ms) | ITL p50 (ms) | requests remote / local |")
    print("|---:|---|---:|---:|---:|---:|")
    summary = {}
    for n in args.input_lens:
        for name in CONFIGS:
            runs = [r[n] for r in results[name]]
            med = {k: statistics.median(r[k] for r in runs) for k in ("ttft_p50", "ttft_p90", "itl_p50")}
            paths = {k: sum(r["paths"][k] for r in runs) for k in ("remote", "local")}
            summary[(n, name)] = med
            print(f"| {n} | {name} | {med['ttft_p50']:.1f} | {med['ttft_p90']:.1f} | {med['itl_p50']:.1f} | "
                  f"{paths['remote']} / {paths['local']} |")
    for n in args.input_lens:
        ratio = summary[(n, "conditional (default)")]["ttft_p50"] / summary[(n, "remote (0)")]["ttft_p50"]
        print(f"{n} tokens: TTFT p50 conditional / remote = {ratio:.3f}")
    (args.out / "summary.json").write_text(json.dumps(
        {"loads": loads, "runs": {name: [{str(k): v for k, v in r.items()} for r in rs]
                                  for name, rs in results.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
