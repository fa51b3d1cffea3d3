#!/usr/bin/env python3
"""The online planner against every static split, on a held-out load shape (issue #26's planner goal).

Writes a Mooncake-format trace of ``--duration`` seconds: a base rate that ramps up to ``--peak`` times itself over
the first third, back down over the second, flat for the last, plus a burst (``--burst`` times the rate for
``--burst-s`` seconds at 70% of the run); prompts of ``--input-len`` tokens (each its own blocks), ``--output-len``
output tokens. Then, each on a fresh `xpyd up --engine sim` through etcd (every process a child of this one):

- every static split X+Y = ``--max-workers`` (1:N-1 .. N-1:1), `xpyd bench --trace` at ``--time-scale``;
- `xpyd up --planner` from 1P1D with ``--max-workers``, the same bench; its fleet over time from its decisions.

For each: SLO attainment (`xpyd bench --slo`), worker-seconds (static: workers x the run; planner: the fleet's
size integrated over the run, from its decisions file), and the decisions per role per dwell time. The goal: the
planner's attainment >= 0.95 at worker-seconds <= 1.15x the best static split's that meets it.

    .venv/bin/python scripts/planner_shape.py --max-workers 4 --duration 240 --rate 2 --time-scale 2 \\
        --slo ttft=2s,itl=250ms --json OUT.json

Nothing but 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_sim import PY, ROOT, emit, start_up, stop, up_command  # noqa: E402  (a script beside this one)

BLOCK = 512  # the trace's block size (Mooncake's)


def rate_at(t: float, args: argparse.Namespace) -> float:
    third = args.duration / 3
    if t < third:
        factor = 1 + (args.peak - 1) * t / third
    elif t < 2 * third:
        factor = args.peak - (args.peak - 1) * (t - third) / third
    else:
        factor = 1.0
    burst_at = 0.7 * args.duration
    if burst_at <= t < burst_at + args.burst_s:
        factor *= args.burst
    return args.rate * factor


def write_trace(path: Path, args: argparse.Namespace) -> int:
    """Poisson arrivals at ``rate_at`` (thinning); each prompt its own blocks. The number of requests."""
    rng = random.Random(args.seed)
    top = args.rate * args.peak * args.burst
    t, n, next_block = 0.0, 0, 1
    blocks = -(-args.input_len // BLOCK)
    with path.open("w") as f:
        while True:
            t += rng.expovariate(top)
            if t >= args.duration:
                break
            if rng.random() * top > rate_at(t, args):
                continue
            ids = list(range(next_block, next_block + blocks))
            next_block += blocks
            f.write(json.dumps({"timestamp": int(t * 1000), "input_length": args.input_len,
                                "output_length": args.output_len, "hash_ids": ids}) + "\n")
            n += 1
    return n


def run(x: int, y: int, args: argparse.Namespace, trace: Path, work: Path, planner: bool) -> dict:
    name = "planner" if planner else f"{x}P{y}D"
    extra = ["--engine", "sim", "--sim-speedup", str(args.speedup), "--sim-kv-token-bytes", "2048",
             "--batch-size", str(args.batch_size)]
    decisions = work / f"{name}.decisions.jsonl"
    if planner:
        extra += ["--planner", "--slo", args.slo, "--max-workers", str(args.max_workers), "--planner-interval",
                  str(args.interval), "--planner-dwell", str(args.dwell), "--planner-decisions", str(decisions)]
    cmd, url = up_command(x, y, 256, *extra, room=args.max_workers)
    up = start_up(cmd, work / f"{name}.up.log")
    try:
        report = work / f"{name}.bench.json"
        t0 = time.monotonic()
        bench = subprocess.run([PY, "-m", "xpyd", "bench", "--url", url, "--model", "m", "--no-progress", "--trace",
                                str(trace), "--time-scale", str(args.time_scale), "--slo", args.slo, "--timeout",
                                "600", "--json", str(report)], cwd=ROOT, capture_output=True, text=True, timeout=3600)
        wall = time.monotonic() - t0
        if bench.returncode not in (0, 1):
            raise RuntimeError(f"xpyd bench failed:\n{bench.stdout[-1500:]}\n{bench.stderr[-1500:]}")
        rep = json.loads(report.read_text())
    finally:
        stop(up)
    out = {"config": name, "wall_s": round(wall, 1), "completed": rep.get("completed"), "failed": rep.get("failed"),
           "slo_attainment": rep.get("slo_attainment"), "goodput_requests_per_s": rep.get("goodput_requests_per_s")}
    if not planner:
        out["worker_seconds"] = round((x + y) * wall, 1)
        return out
    lines = [json.loads(line) for line in decisions.read_text().splitlines()] if decisions.exists() else []
    out["decisions"] = lines
    out["worker_seconds"] = round(_fleet_seconds(x + y, lines, t0, wall), 1)
    out["fleet_max"] = max([x + y] + [_running(x + y, lines, i) for i in range(len(lines))])
    return out


def _fleet_seconds(start: int, decisions: list[dict], t0: float, wall: float) -> float:
    """The fleet's size integrated over the bench's run [t0, t0 + wall]: it starts at ``start`` workers and changes
    by each decision's delta at its time (the launcher's ``time.monotonic``: the same clock as ``t0`` on Linux)."""
    size, at, total = start, t0, 0.0
    for d in sorted(decisions, key=lambda d: d["at_s"]):
        when = min(max(d["at_s"], t0), t0 + wall)
        total += size * (when - at)
        size, at = size + d["delta"], when
    return total + size * (t0 + wall - at)


def _running(start: int, decisions: list[dict], i: int) -> int:
    return start + sum(d["delta"] for d in decisions[: i + 1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-workers", type=int, default=4)
    ap.add_argument("--duration", type=float, default=240.0, help="the trace's seconds (before --time-scale)")
    ap.add_argument("--rate", type=float, default=2.0, help="base requests/s")
    ap.add_argument("--peak", type=float, default=4.0, help="the ramp's top, x the base rate")
    ap.add_argument("--burst", type=float, default=3.0)
    ap.add_argument("--burst-s", type=float, default=10.0)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--speedup", type=float, default=1.0, help="--sim-speedup (use the same as --time-scale)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--slo", default="ttft=2s,itl=250ms")
    ap.add_argument("--interval", type=float, default=10.0, help="--planner-interval")
    ap.add_argument("--dwell", type=float, default=30.0, help="--planner-dwell")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None, help="comma list of configs to run (e.g. planner,2P2D)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="xpyd-shape-"))
    trace = work / "shape.jsonl"
    n = write_trace(trace, args)
    result: dict = {"args": vars(args), "requests": n, "runs": []}
    configs = [(x, args.max_workers - x, False) for x in range(1, args.max_workers)] + [(1, 1, True)]
    only = set(args.only.split(",")) if args.only else None
    for x, y, planner in configs:
        name = "planner" if planner else f"{x}P{y}D"
        if only is not None and name not in only:
            continue
        r = run(x, y, args, trace, work, planner)
        print(json.dumps({k: v for k, v in r.items() if k != "decisions"}), file=sys.stderr, flush=True)
        result["runs"].append(r)
    static = [r for r in result["runs"] if r["config"] != "planner" and (r["slo_attainment"] or 0) >= 0.95]
    best = min(static, key=lambda r: r["worker_seconds"], default=None)
    planned = next((r for r in result["runs"] if r["config"] == "planner"), None)
    if best is not None and planned is not None:
        result["planner_vs_best_static_worker_seconds"] = round(planned["worker_seconds"] / best["worker_seconds"], 3)
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
