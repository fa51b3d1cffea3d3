#!/usr/bin/env python3
"""SIGKILL decode workers of a simulated cluster under load: what the other streams, the killed streams and
`xpyd up` do about it.

Starts `xpyd up --engine sim --prefill X --decode Y` through etcd (with a cluster token, as a cluster runs; the proxy's
``x-xpyd-workers`` names can be tied to the workers through ``GET /cluster``), drives N concurrent streams with
`xpyd bench --include-requests`, and ``--after`` seconds into the load SIGKILLs ``--kill`` decode workers that
are serving streams. Then, from every request's timeline:

- streams on the killed workers: how long after the kill each ended, and with what error (goal: a clear error
  within 2 s);
- streams on the other workers: their inter-token gaps in the ``--window`` seconds before the kill against
  the same length after it, p50/p99 (goal: p99 within 1.1x), and whether any of them failed;
- `xpyd up`: seconds from the kill until the proxy routes to Y decode workers again (goal: 30 s).

    .venv/bin/python scripts/scale_kill.py --prefill 16 --decode 48 --streams 1000 --kill 8 --after 60 \
        --prefill-wait-timeout 300 --json OUT.json

Every process is a child of this one and stops with it; nothing but 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_sim import PY, ROOT, _kind, _tree, emit, memory, start_up, stop, up_command  # noqa: E402  (a script beside this one)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def _cluster(url: str) -> list[dict]:
    with urllib.request.urlopen(url + "/cluster", timeout=10) as r:
        return json.loads(r.read())["workers"]


def _decode_up(url: str) -> int:
    return sum(1 for w in _cluster(url) if w.get("role") == "decode" and w.get("health") == "up")


def _port_of(pid: int) -> int | None:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    for flag, value in zip(argv, argv[1:]):
        if flag == b"--port":
            return int(value)
    return None


def _decode_name(workers: dict | None) -> str | None:
    """The decode worker's name in a record's ``workers`` (the x-xpyd-workers header, by role)."""
    return (workers or {}).get("decode")


def analyse(records: list[dict], killed: set[str], kill_s: float, window: float) -> dict:
    """From `xpyd bench --include-requests` records (times relative to the bench's start, as ``kill_s``)."""
    on_killed = [r for r in records if _decode_name(r.get("workers")) in killed]
    others = [r for r in records if r not in on_killed]
    ended_after = [r["end_s"] - kill_s for r in on_killed if r["end_s"] >= kill_s]
    before, after = [], []
    for r in others:
        chunks = r["chunks_s"]
        for a, b in zip(chunks, chunks[1:]):
            if kill_s - window <= a and b < kill_s:
                before.append(1000 * (b - a))
            elif kill_s <= a and b < kill_s + window:
                after.append(1000 * (b - a))
    p99_before, p99_after = _percentile(before, 99), _percentile(after, 99)
    errors: dict[str, int] = {}
    for r in on_killed:
        if r.get("error"):
            key = str(r["error"])[:120]
            errors[key] = errors.get(key, 0) + 1
    return {
        "killed_streams": len(on_killed),
        "killed_streams_failed": sum(1 for r in on_killed if r.get("error")),
        "killed_streams_completed_before_kill": sum(1 for r in on_killed if r["end_s"] < kill_s and not r.get("error")),
        "killed_end_after_kill_s": {"p50": _percentile(ended_after, 50), "p99": _percentile(ended_after, 99),
                                    "max": max(ended_after) if ended_after else None},
        "killed_errors": errors,
        "other_streams": len(others),
        "other_streams_failed": sum(1 for r in others if r.get("error")),
        "other_itl_ms_before": {"n": len(before), "p50": _percentile(before, 50), "p99": p99_before},
        "other_itl_ms_after": {"n": len(after), "p50": _percentile(after, 50), "p99": p99_after},
        "other_itl_p99_ratio": round(p99_after / p99_before, 3) if p99_before and p99_after else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=int, default=16)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--kill", type=int, default=8, help="decode workers to SIGKILL")
    ap.add_argument("--after", type=float, default=60.0, help="seconds into the load")
    ap.add_argument("--window", type=float, default=10.0, help="seconds of ITL compared before/after the kill")
    ap.add_argument("--speedup", default="1")
    ap.add_argument("--kv-token-bytes", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prefill-wait-timeout", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0, help="which workers are killed")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    x, y = args.prefill, args.decode
    work = Path(tempfile.mkdtemp(prefix="xpyd-kill-"))
    log = work / "up.log"
    cmd, url = up_command(x, y, args.streams, "--engine", "sim", "--sim-speedup", args.speedup,
                          "--sim-kv-token-bytes", str(args.kv_token_bytes), "--batch-size", str(args.batch_size),
                          "--expose-worker-names")
    if args.prefill_wait_timeout is not None:
        cmd += ["--prefill-wait-timeout", str(args.prefill_wait_timeout)]
    env = {**os.environ, "XPYD_CLUSTER_TOKEN": secrets.token_hex(16)}
    started = time.monotonic()
    up = start_up(cmd, log, env)
    result: dict = {k: getattr(args, k) for k in ("prefill", "decode", "streams", "kill", "after", "window", "speedup",
                                                  "kv_token_bytes", "batch_size", "input_len", "output_len",
                                                  "prefill_wait_timeout", "seed")}
    bench = None
    try:
        while _decode_up(url) < y:
            if time.monotonic() - started > 600:
                raise RuntimeError("the proxy does not route to every decode worker")
            time.sleep(0.2)
        result["ready_s"] = round(time.monotonic() - started, 1)
        report = work / "bench.json"
        bench_cmd = [PY, "-m", "xpyd", "bench", "--url", url, "--model", "m", "--no-progress", "--num-requests",
                     str(args.streams), "--concurrency", str(args.streams), "--input-len", str(args.input_len),
                     "--output-len", str(args.output_len), "--warmup", "0", "--timeout", "900",
                     "--include-requests", "--json", str(report)]
        t_bench = time.perf_counter()
        bench = subprocess.Popen(bench_cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        time.sleep(args.after)
        names = {w["name"]: w for w in _cluster(url) if w.get("role") == "decode"}
        pids = {}
        for pid in _tree(up.pid):
            try:
                if _kind(pid) == "decode":
                    pids[_port_of(pid)] = pid
            except OSError:
                continue
        by_name = {}
        for name, w in names.items():
            port_ = int(w["http_url"].rsplit(":", 1)[1].split("/")[0])
            if port_ in pids:
                by_name[name] = pids[port_]
        if len(by_name) < args.kill:
            raise RuntimeError(f"matched only {len(by_name)} decode workers to processes: {sorted(names)[:3]}...")
        victims = random.Random(args.seed).sample(sorted(by_name), args.kill)
        t_kill = time.perf_counter()
        for name in victims:
            os.kill(by_name[name], signal.SIGKILL)
        kill_s = t_kill - t_bench
        result["killed"] = victims
        while _decode_up(url) >= y:  # the proxy notices (its probes, or a broken stream)
            if time.perf_counter() - t_kill > 60:
                break
            time.sleep(0.1)
        restored = None
        while time.perf_counter() - t_kill < 120:
            if _decode_up(url) >= y:
                restored = round(time.perf_counter() - t_kill, 2)
                break
            time.sleep(0.2)
        result["restored_s"] = restored
        out, err = bench.communicate(timeout=3600)
        if bench.returncode not in (0, 1):
            raise RuntimeError(f"xpyd bench failed ({bench.returncode}):\n{out[-2000:]}\n{err[-2000:]}")
        rep = json.loads(report.read_text())
        # The records are relative to the bench's own start, a little after it was launched: align on its clock.
        offset = rep.get("start_perf_counter")
        result["kill_s_into_load"] = round(t_kill - offset if offset is not None else kill_s, 3)
        result["clock_aligned"] = offset is not None
        result["bench"] = {k: rep.get(k) for k in ("completed", "failed", "errors", "duration_s", "ttft_ms", "itl_ms")}
        result.update(analyse(rep["requests"], set(victims), result["kill_s_into_load"], args.window))
        result["memory_after"] = memory(up.pid)
    finally:
        if bench is not None and bench.poll() is None:
            bench.kill()
        stop(up)
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
