#!/usr/bin/env python3
"""The hot path, side by side: two xpyd trees (e.g. before and after a change) under the same load.

For each tree: `xpyd up` (1P1D, defaults, the tree's code via PYTHONPATH), one 1-token request first (what
`vllm bench serve` sends to check readiness), then `xpyd bench` at concurrency 1 (20 requests, 256-token
prompts, 64 output tokens) and concurrency 4 (32 requests), then 10 s idle. Reported per tree:

- first->second token (the gap between the first content chunk, prefill's, and the second, decode's):
  p50 and p99 over the concurrency-1 requests;
- CPU seconds per 1,000 generated tokens of the proxy and of the decode worker (utime + stime from
  /proc over both runs), and the decode worker's CPU share while idle;
- ITL p50 and output tokens/s at concurrency 4.

    .venv/bin/python scripts/bench_hot_path.py --tree before=/tmp/xpyd-before --tree after=. --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parents[1]
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def child(parent: int, role: str) -> int:
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if ppid == parent and len(argv) > 3 and argv[3] == role.encode():
            return int(d.name)
    raise LookupError(f"no {role} process under {parent}")


def bench(url: str, tokenizer: str, out: Path, concurrency: int, requests: int) -> dict:
    subprocess.run([str(HERE / ".venv/bin/xpyd"), "bench", "--url", url, "--tokenizer", tokenizer, "--no-progress",
                    "--num-requests", str(requests), "--concurrency", str(concurrency), "--input-len", "256",
                    "--output-len", "64", "--warmup", "2", "--include-requests", "--json", str(out)],
                   check=True, stdout=subprocess.DEVNULL, cwd=HERE)
    return json.loads(out.read_text())


def run_tree(name: str, tree: Path, out: Path, port: int, tokenizer: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
    log = out / f"{name}_up.log"
    up = subprocess.Popen([sys.executable, "-m", "xpyd", "up", "--port", str(port)], cwd=tree, env=env,
                          stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while "Press Ctrl-C to stop" not in log.read_text(errors="replace"):
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: xpyd up did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.5)
        proxy, decode = child(up.pid, "proxy"), child(up.pid, "decode")
        body = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=60).read()
        cpu0 = cpu_seconds(proxy), cpu_seconds(decode)
        c1 = bench(url, tokenizer, out / f"{name}_c1.json", 1, 20)
        c4 = bench(url, tokenizer, out / f"{name}_c4.json", 4, 32)
        cpu1 = cpu_seconds(proxy), cpu_seconds(decode)
        time.sleep(10)
        idle = (cpu_seconds(decode) - cpu1[1]) / 10
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)
    tokens = c1["total_output_tokens"] + c4["total_output_tokens"]
    gaps = [(r["chunks_s"][1] - r["chunks_s"][0]) * 1000 for r in c1["requests"] if len(r["chunks_s"]) > 1]
    return {
        "first_to_second_ms_p50": float(np.percentile(gaps, 50)),
        "first_to_second_ms_p99": float(np.percentile(gaps, 99)),
        "proxy_cpu_s_per_1k_tokens": (cpu1[0] - cpu0[0]) / tokens * 1000,
        "decode_cpu_s_per_1k_tokens": (cpu1[1] - cpu0[1]) / tokens * 1000,
        "decode_idle_cpu_share": idle,
        "c1_ttft_ms_p50": c1["ttft_ms"]["p50"],
        "c1_itl_ms_p50": c1["itl_ms"]["p50"],
        "c1_output_tok_s": c1["output_tokens_per_s"],
        "c4_itl_ms_p50": c4["itl_ms"]["p50"],
        "c4_output_tok_s": c4["output_tokens_per_s"],
        "failed": c1["failed"] + c4["failed"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", action="append", required=True, metavar="NAME=PATH")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = subprocess.run([sys.executable, "-c", "from xpyd.model.loader import ensure_converted; "
                                "print(ensure_converted(None).path)"], check=True, capture_output=True, text=True,
                               cwd=HERE).stdout.strip()
    results = {}
    for spec in args.tree:
        name, _, path = spec.partition("=")
        tree = Path(path).resolve()
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True,
                                text=True).stdout.strip()
        results[name] = {"tree": str(tree), "commit": commit, **run_tree(name, tree, args.out, args.port, tokenizer)}
        print(name, json.dumps(results[name], indent=1), flush=True)
    (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    names = list(results)
    print("\n| metric | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for key in results[names[0]]:
        if key in ("tree", "commit"):
            continue
        cells = [f"{results[n][key]:.4g}" if isinstance(results[n][key], float) else str(results[n][key]) for n in names]
        print(f"| {key} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
