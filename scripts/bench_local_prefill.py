#!/usr/bin/env python3
"""Conditional disaggregation, measured: `xpyd up` (1P1D, the default model) with the decode worker prefilling
short prompts itself (--local-prefill-max-tokens --threshold, 256) against always remote (0), driven by `xpyd bench`
through the proxy with cold prompts (no shared prefixes) of each --input-lens length. Prints one table row per
(length, configuration): client TTFT p50/p90, ITL p50, and how many requests each path served (the proxy's
xpyd_proxy_prefill_path_total); writes each bench's JSON under --out.

    .venv/bin/python scripts/bench_local_prefill.py [--input-lens 64,1024] [--requests 32] [--concurrency 4] \
        [--output-len 32] [--rounds 3] [--threshold 256] [--out DIR] [--up-args "--dtype bfloat16"]

Both configurations serve from the same workers: `xpyd up`'s proxy (conditional) and a second proxy with
--local-prefill-max-tokens 0 in front of them; their benches alternate, --rounds times (a shared machine's load
moves), and each row is the median of the rounds' p50s. Starts its own cluster on free ports and stops it;
nothing but 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_sim import _free_run  # noqa: E402  (a script beside this one)


def _paths(port: int) -> dict[str, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {m[0]: int(float(m[1])) for m in re.findall(r'xpyd_proxy_prefill_path_total\{path="(\w+)"\} (\S+)', text)}


def _wait_for(log_path: Path, proc: subprocess.Popen, text: str) -> None:
    deadline = time.monotonic() + 600
    while text not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{log_path.name}: did not start:\n" + log_path.read_text()[-2000:])
        time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _bench(args, port: int, n: int, seed: int, report: Path, env: dict) -> dict:
    before = _paths(port)
    subprocess.run([sys.executable, "-m", "xpyd", "bench", "--url", f"http://127.0.0.1:{port}", "--no-progress",
                    "--num-requests", str(args.requests), "--concurrency", str(args.concurrency), "--input-len",
                    str(n), "--output-len", str(args.output_len), "--warmup", "2", "--seed", str(seed), "--json",
                    str(report)], check=True, env=env, timeout=3600, stdout=subprocess.DEVNULL)
    after = _paths(port)
    r = json.loads(report.read_text())
    return {"ttft_p50": r["ttft_ms"]["p50"], "ttft_p90": r["ttft_ms"]["p90"], "itl_p50": r["itl_ms"]["p50"],
            "paths": {k: after.get(k, 0) - before.get(k, 0) for k in ("remote", "local")},
            "load": os.getloadavg()[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input-lens", default="64,1024", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench-local-prefill"))
    ap.add_argument("--up-args", default="", help="more `xpyd up` options, one string")
    ap.add_argument("--threshold", type=int, default=256, help="`xpyd up`'s --local-prefill-max-tokens")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    base = _free_run(30, 23000)
    ports = {"remote (0)": base + 5, "conditional": base}
    up_log, proxy_log = args.out / "up.log", args.out / "proxy-remote.log"
    runs: dict[str, dict[int, list[dict]]] = {name: {n: [] for n in args.input_lens} for name in ports}
    with up_log.open("wb") as log, proxy_log.open("wb") as plog:
        up = subprocess.Popen([sys.executable, "-m", "xpyd", "up", "--port", str(base), "--prefill-port",
                               str(base + 10), "--decode-port", str(base + 20), "--local-prefill-max-tokens",
                               str(args.threshold), *shlex.split(args.up_args)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        remote = None
        try:
            _wait_for(up_log, up, "Press Ctrl-C to stop")
            # the same workers behind a second proxy that sends every prompt to the prefill worker
            remote = subprocess.Popen([sys.executable, "-m", "xpyd", "proxy", "--port", str(base + 5), "--prefill",
                                       f"http://127.0.0.1:{base + 10}", "--decode", f"http://127.0.0.1:{base + 20}",
                                       "--local-prefill-max-tokens", "0"], stdout=plog, stderr=subprocess.STDOUT,
                                      env=env, start_new_session=True)
            _wait_for(proxy_log, remote, "proxy on http")
            for round_ in range(args.rounds):
                for n in args.input_lens:
                    order = list(ports) if round_ % 2 == 0 else list(reversed(ports))
                    for name in order:
                        report = args.out / f"{name.split()[0]}-{n}-{round_}.json"
                        runs[name][n].append(_bench(args, ports[name], n, 1000 * round_ + n, report, env))
        finally:
            if remote is not None:
                _stop(remote)
            _stop(up)
    loads = [r["load"] for name in runs for n in runs[name] for r in runs[name][n]]
    print(f"load average (1 min) after each bench: min {min(loads):.2f}, median {statistics.median(loads):.2f}, "
          f"max {max(loads):.2f}")
    print("| input tokens | prefill | TTFT p50 (ms) | TTFT p90 (ms) | ITL p50 (ms) | requests remote / local |")
    print("|---:|---|---:|---:|---:|---:|")
    med = {}
    for n in args.input_lens:
        for name in ports:
            rs = runs[name][n]
            m = med[(n, name)] = {k: statistics.median(r[k] for r in rs) for k in ("ttft_p50", "ttft_p90", "itl_p50")}
            paths = {k: sum(r["paths"][k] for r in rs) for k in ("remote", "local")}
            print(f"| {n} | {name} | {m['ttft_p50']:.1f} | {m['ttft_p90']:.1f} | {m['itl_p50']:.1f} | "
                  f"{paths['remote']} / {paths['local']} |")
    for n in args.input_lens:
        per_round = [c["ttft_p50"] / r["ttft_p50"] for c, r in zip(runs["conditional"][n],
                                                                    runs["remote (0)"][n])]
        ratio = med[(n, "conditional")]["ttft_p50"] / med[(n, "remote (0)")]["ttft_p50"]
        print(f"{n} tokens: TTFT p50 conditional / remote = {ratio:.3f} (per round: "
              f"{', '.join(f'{x:.3f}' for x in per_round)})")
    (args.out / "summary.json").write_text(json.dumps({name: {str(n): rs for n, rs in by.items()}
                                                       for name, by in runs.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
