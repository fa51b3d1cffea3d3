"""Chunked prefill on the long-prompt scenario: short prompts arriving while long prompts keep the prefill
worker busy, the same load against `xpyd up` once per --prefill-chunk value (0 = unchunked).

Per value: a fresh `xpyd up` (1P1D, bfloat16), then two `xpyd bench` runs at the same time through its proxy:
  long:  --input-len LONG  --output-len 4, closed loop at --long-concurrency (the prefill worker never idles),
         for --duration + TAIL seconds
  short: --input-len SHORT --output-len 4, Poisson at --short-rate, for --duration seconds, started once the
         long prompts run
so every short prompt is sent and answered while the long load runs (neither client's start-up nor the long
client's end, which take the CPU from the workers for a moment, fall on a short prompt's wait). The long prompts'
own rate is taken over the short run's window: the prompt tokens of the long requests sent and answered inside
it, over the time from the first one's send to the last one's answer (both clients' clocks are the machine's
monotonic clock). The prefill worker's /xpyd/stats before and after give its tokens/s over the whole run (short
prompts included).

    .venv/bin/python scripts/bench_chunked.py --chunks 0,256,512 --out docs/bench/DIR
writes DIR/chunk{N}_{long,short}.json and DIR/chunked_summary.json, and prints a table with each value's
ratio to the first (short TTFT p99, prefill tokens/s).
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

ROOT = Path(__file__).resolve().parent.parent
TAIL = 10.0  # seconds the long client runs past the short one
PY = sys.executable  # (the venv running this script: its workers import xpyd as it does)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def wait_ready(proc: subprocess.Popen, log: Path, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"xpyd up exited:\n{log.read_text()[-3000:]}")
        if "Press Ctrl-C to stop" in log.read_text(errors="replace"):
            return
        time.sleep(1.0)
    raise TimeoutError("xpyd up did not become ready")


def run_one(chunk: int, args: argparse.Namespace, tokenizer: str) -> dict:
    out = Path(args.out)
    log = out / f"chunk{chunk}_up.log"
    up = subprocess.Popen([PY, "-m", "xpyd", "up", "--max-model-len", str(args.long + 256), "--port", str(args.port),
                           "--prefill-chunk", str(chunk), *args.up_args.split()],
                          stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT,
                          env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    try:
        wait_ready(up, log)
        url = f"http://127.0.0.1:{args.port}"
        prefill = next(w["http_url"] for w in get_json(f"{url}/cluster")["workers"] if w["role"] == "prefill")
        bench = [PY, "-m", "xpyd", "bench", "--url", url, "--tokenizer", tokenizer, "--no-progress",
                 "--output-len", "4", "--include-requests", *args.bench_args.split()]
        warm = subprocess.run([*bench, "--input-len", str(args.long), "--num-requests", "2", "--seed", "99"],
                              capture_output=True, cwd=ROOT)
        if warm.returncode:
            raise RuntimeError(warm.stderr.decode()[-2000:])
        before, t0 = get_json(f"{prefill}/xpyd/stats"), time.monotonic()  # (from here: tokens/s of the run)
        # (as many prompts as the run can use: the bench makes them all before it sends the first one, and
        # making thousands of exact-length prompts would take the CPU from the workers)
        # (long prompts: enough that the closed loop runs for the whole --duration however fast the worker is: a
        # client that runs out early measures the load offered, not what the worker can do)
        n_long = int((args.duration + TAIL) * args.long_concurrency * 2) + 8
        n_short = int(args.duration * args.short_rate * 1.5) + 8
        long = subprocess.Popen([*bench, "--duration", str(args.duration + TAIL), "--input-len", str(args.long),
                                 "--concurrency", str(args.long_concurrency),
                                 "--num-requests", str(n_long), "--seed", "1",
                                 "--json", str(out / f"chunk{chunk}_long.json")], stdout=subprocess.DEVNULL, cwd=ROOT)
        while get_json(f"{prefill}/xpyd/stats")["running"] == 0:  # the long prompts occupy the worker first
            time.sleep(0.1)
        short = subprocess.run([*bench, "--duration", str(args.duration), "--input-len", str(args.short),
                                "--rate", str(args.short_rate),
                                "--num-requests", str(n_short), "--seed", "2",
                                "--json", str(out / f"chunk{chunk}_short.json")], stdout=subprocess.DEVNULL, cwd=ROOT)
        long.wait()
        after, elapsed = get_json(f"{prefill}/xpyd/stats"), time.monotonic() - t0
        if short.returncode or long.returncode:
            raise RuntimeError("a bench run failed")
        s = json.loads((out / f"chunk{chunk}_short.json").read_text())
        l = json.loads((out / f"chunk{chunk}_long.json").read_text())
        tokens = after["prefill_tokens"] - before["prefill_tokens"]
        inside = _long_inside(l, s)
        if not inside["requests"]:
            raise RuntimeError("no long request ran inside the short run's window")
        return {"chunk": chunk, "short_ttft_p50_ms": s["ttft_ms"]["p50"], "short_ttft_p99_ms": s["ttft_ms"]["p99"],
                "short_ttft_max_ms": s["ttft_ms"]["max"],
                "short_completed": s["completed"], "long_ttft_p50_ms": l["ttft_ms"]["p50"],
                "long_completed": l["completed"], "long_inside_window": inside,
                "long_prompt_tokens_per_s": inside["tokens_per_s"],
                "prefill_tokens": tokens, "seconds": round(elapsed, 1),
                "prefill_tokens_per_s": round(tokens / elapsed, 1),
                "steps": after["prefill_steps"] - before["prefill_steps"],
                "step_cost": after.get("prefill_step_cost")}
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()


def _long_inside(long: dict, short: dict) -> dict:
    """The long requests sent and answered inside the short run's window (its first send to its last answer,
    on the machine's monotonic clock): how many, their prompt tokens, and those over the time from the first
    one's send to the last one's answer."""
    s0 = short["start_perf_counter"]
    ok = [r for r in short["requests"] if r["error"] is None]
    lo, hi = s0 + min(r["send_s"] for r in ok), s0 + max(r["end_s"] for r in ok)
    l0 = long["start_perf_counter"]
    inside = [r for r in long["requests"] if r["error"] is None and lo <= l0 + r["send_s"] and l0 + r["end_s"] <= hi]
    if not inside:
        return {"requests": 0, "prompt_tokens": 0, "seconds": 0.0, "tokens_per_s": 0.0}
    seconds = max(r["end_s"] for r in inside) - min(r["send_s"] for r in inside)
    tokens = sum(r["prompt_tokens"] for r in inside)
    return {"requests": len(inside), "prompt_tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", default="0,512", help="--prefill-chunk values, comma-separated (first = baseline)")
    p.add_argument("--long", type=int, default=2048, help="long prompt tokens")
    p.add_argument("--short", type=int, default=128, help="short prompt tokens")
    p.add_argument("--long-concurrency", type=int, default=1)
    p.add_argument("--short-rate", type=float, default=1.0, help="short prompts per second (Poisson)")
    p.add_argument("--duration", type=float, default=60.0, help="the short run's seconds (the long one's: + 10)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--up-args", default="", help="more `xpyd up` options, one string")
    p.add_argument("--bench-args", default="", help="more `xpyd bench` options for every run, one string "
                   "(with --up-args=--expose-worker-timing each request's phases come in the JSON)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from xpyd.model.loader import ensure_converted

    tokenizer = str(ensure_converted(None).path)
    rows = [run_one(int(c), args, tokenizer) for c in args.chunks.split(",")]
    base = rows[0]
    for r in rows:
        r["short_ttft_p99_ratio"] = round(r["short_ttft_p99_ms"] / base["short_ttft_p99_ms"], 3)
        r["prefill_tokens_per_s_ratio"] = round(r["prefill_tokens_per_s"] / base["prefill_tokens_per_s"], 3)
        r["long_prompt_tokens_per_s_ratio"] = round(r["long_prompt_tokens_per_s"] / base["long_prompt_tokens_per_s"], 3)
    (Path(args.out) / "chunked_summary.json").write_text(json.dumps({"args": vars(args), "runs": rows}, indent=2) + "\n")
    print(f"{'chunk':>6} {'short TTFT p50':>15} {'p99':>9} {'ratio':>6} {'long TTFT p50':>14} {'prefill tok/s':>14} "
          f"{'ratio':>6} {'long tok/s':>11} {'ratio':>6}")
    for r in rows:
        print(f"{r['chunk']:>6} {r['short_ttft_p50_ms']:>13.0f}ms {r['short_ttft_p99_ms']:>7.0f}ms "
              f"{r['short_ttft_p99_ratio']:>6.2f} {r['long_ttft_p50_ms']:>12.0f}ms {r['prefill_tokens_per_s']:>14.0f} "
              f"{r['prefill_tokens_per_s_ratio']:>6.2f} {r['long_prompt_tokens_per_s']:>11.0f} "
              f"{r['long_prompt_tokens_per_s_ratio']:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
