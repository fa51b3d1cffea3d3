#!/usr/bin/env python3
"""Where the TTFT goes: `xpyd up --expose-worker-timing` (1P1D, the default model, or `--engine sim`), then
`xpyd bench` through its proxy; prints each TTFT phase's p50/p99 and the phases' sum against the client's TTFT
(the goal: sum p50 within 2% of client TTFT p50), and writes the bench's JSON.

    .venv/bin/python scripts/bench_phases.py [--requests 64] [--concurrency 4] [--input-len 256] \
        [--output-len 32] [--out DIR] [--up-args "--dtype bfloat16"] [--bench-args "--no-stream"]

``--up-args --colocated`` measures a colocated worker behind its proxy; ``--bench-args "--no-stream"`` JSON
answers (the time to the answer, split), ``--bench-args "--n 2"`` several choices.

Starts its own cluster on free ports and stops it; nothing but 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_sim import _free_run  # noqa: E402  (a script beside this one)

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("bench-phases"))
    ap.add_argument("--up-args", default="", help="more `xpyd up` options, one string")
    ap.add_argument("--bench-args", default="", help="more `xpyd bench` options, one string")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    base = _free_run(30, 23000)
    port = base
    log_path = args.out / "up.log"
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    with log_path.open("wb") as log:
        up = subprocess.Popen([sys.executable, "-m", "xpyd", "up", "--expose-worker-timing", "--port", str(port),
                               "--prefill-port", str(base + 10), "--decode-port", str(base + 20),
                               *shlex.split(args.up_args)], stdout=log, stderr=subprocess.STDOUT, env=env,
                              start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while "Press Ctrl-C to stop" not in log_path.read_text(errors="replace"):
                if up.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("xpyd up did not start:\n" + log_path.read_text()[-2000:])
                time.sleep(0.5)
            report = args.out / "bench.json"
            subprocess.run([sys.executable, "-m", "xpyd", "bench", "--url", f"http://127.0.0.1:{port}",
                            "--no-progress", "--num-requests", str(args.requests), "--concurrency",
                            str(args.concurrency), "--input-len", str(args.input_len), "--output-len",
                            str(args.output_len), "--warmup", "2", "--include-requests", "--json", str(report),
                            *shlex.split(args.bench_args)],
                           check=True, env=env, timeout=1800)
        finally:
            os.killpg(up.pid, signal.SIGTERM)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()
    ph = json.loads(report.read_text())["phases"]
    print(f"requests split: {ph['requests']} (without: {ph['missing']})")
    for name, d in ph["ttft_ms"].items():
        print(f"  {name:<18} p50 {d['p50']:9.3f} ms  p99 {d['p99']:9.3f} ms")
    s, c = ph["sum_ms"]["p50"], ph["client_ttft_ms"]["p50"]
    print(f"sum p50 {s:.3f} ms, client TTFT p50 {c:.3f} ms: sum / client = {ph['sum_over_client_ttft_p50']:.4f} "
          f"({100 * (1 - s / c):.2f}% unattributed; client/other p50 {ph['client_other_ms']['p50']:.3f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
