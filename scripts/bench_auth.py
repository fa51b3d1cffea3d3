#!/usr/bin/env python3
"""What the cluster token's authentication costs: the same 1P1D `xpyd up` (default model, bfloat16) from two
checkouts, both with a cluster token, alternately, three rounds; `xpyd bench` at concurrency 4 (256-token
prompts, 64 output tokens) against each; TTFT p50 and ITL p50 side by side and their ratios.

    .venv/bin/python scripts/bench_auth.py --base /path/to/older/checkout [--rounds 3] [--requests 128] [--out DIR]

The older checkout runs with this checkout's venv (PYTHONPATH points at it). Each run starts its own
cluster on free ports and stops it; nothing but 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv/bin/python")
TOKEN = "bench-auth-cluster-token"


def _free_port_run(n: int) -> int:
    for base in range(21000, 30000, 10):
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            for s in socks:
                s.close()
            return base
        except OSError:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def run_once(checkout: Path, label: str, out: Path, tokenizer: str, requests: int) -> dict:
    base = _free_port_run(30)  # proxy, prefill (HTTP + signal), decode (HTTP + KV), and room
    port, pp, dp = base, base + 10, base + 20
    env = dict(os.environ, PYTHONPATH=str(checkout), XPYD_CLUSTER_TOKEN=TOKEN, OMP_WAIT_POLICY="PASSIVE")
    log = (out / f"{label}.log").open("wb")
    up = subprocess.Popen([PY, "-m", "xpyd", "up", "--port", str(port), "--prefill-port", str(pp),
                           "--decode-port", str(dp)], stdout=log, stderr=subprocess.STDOUT, env=env,
                          cwd=checkout, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while "Press Ctrl-C to stop" not in (out / f"{label}.log").read_text(errors="replace"):
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{label}: xpyd up did not start:\n" + (out / f"{label}.log").read_text()[-2000:])
            time.sleep(0.5)
        report = out / f"{label}.json"
        subprocess.run([PY, "-m", "xpyd", "bench", "--url", f"http://127.0.0.1:{port}", "--tokenizer", tokenizer,
                        "--no-progress", "--num-requests", str(requests), "--concurrency", "4", "--input-len", "256",
                        "--output-len", "64", "--warmup", "2", "--json", str(report)],
                       check=True, stdout=subprocess.DEVNULL, cwd=ROOT, timeout=900)
        return json.loads(report.read_text())
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the other checkout (e.g. a git worktree of an older commit)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=128, help="requests per run (after 2 warm-up ones)")
    ap.add_argument("--out", default=str(ROOT / "docs/bench/auth-cost"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = subprocess.run([PY, "-c", "from xpyd.model.loader import ensure_converted; "
                                "print(ensure_converted(None).path)"], capture_output=True, text=True,
                               check=True, cwd=ROOT).stdout.strip()
    rows = []
    for r in range(1, args.rounds + 1):
        pair = {}
        for name, checkout in (("base", Path(args.base).resolve()), ("head", ROOT)):
            rep = run_once(checkout, f"{name}_r{r}", out, tokenizer, args.requests)
            pair[name] = (rep["ttft_ms"]["p50"], rep["itl_ms"]["p50"], rep["output_tokens_per_s"], rep["failed"])
        rows.append(pair)
        b, h = pair["base"], pair["head"]
        print(f"round {r}: TTFT p50 {b[0]:.1f} -> {h[0]:.1f} ms ({h[0] / b[0]:.3f}x), "
              f"ITL p50 {b[1]:.2f} -> {h[1]:.2f} ms ({h[1] / b[1]:.3f}x), "
              f"tok/s {b[2]:.1f} -> {h[2]:.1f}, failed {b[3]}/{h[3]}", flush=True)
    for i, what in ((0, "TTFT p50"), (1, "ITL p50")):
        ratios = [p["head"][i] / p["base"][i] for p in rows]
        print(f"{what}: head/base per round {', '.join(f'{x:.3f}' for x in ratios)}; "
              f"median {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
