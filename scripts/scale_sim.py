#!/usr/bin/env python3
"""A simulated cluster at scale on this machine: `xpyd up --engine sim --prefill X --decode Y` through etcd,
then `xpyd bench` with N concurrent streams through its proxy. Prints (and with --json writes) what it costs:

- start-up: seconds until `xpyd up` is ready and the proxy routes to every worker;
- memory: proportional set size (PSS: shared pages split) per process kind (prefill, decode, proxy, etcd, up),
  idle after start and again after the load;
- the load: `xpyd bench`'s report (completed, failed, TTFT/ITL percentiles, throughput);
- what the proxy adds, same requests (the proxy runs with --expose-worker-timing): the workers' own TTFT and
  ITL against the client's, proxy-added TTFT p50/p99 and client/worker ITL p99 (``proxy_overhead``, and a
  line on stderr);
- the proxy's CPU seconds per request (its process's user + system time over the load / requests);
- the whole cluster's CPU seconds over the load, and output tokens per CPU second (control-plane scaling on a
  box with fewer cores than workers: compare 1P3D and 16P48D at --speedup inf).

    .venv/bin/python scripts/scale_sim.py --prefill 16 --decode 48 --streams 1000 [--speedup 1] \
        [--kv-token-bytes 2048] [--input-len 512 --output-len 128] [--json OUT.json]

Every process is a child of this one and stops with it; nothing but 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv/bin/python")
TICK = os.sysconf("SC_CLK_TCK")


def _free_run(n: int, start: int = 21000) -> int:
    """The first port p >= start with p .. p+n-1 all bindable now."""
    p = start
    while p + n < 32000:
        socks = []
        try:
            for q in range(p, p + n):
                s = socket.socket()
                socks.append(s)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", q))
            return p
        except OSError:
            p = q + 1
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no free run of {n} ports")


def up_command(x: int, y: int, streams: int, *extra: str, room: int = 0) -> tuple[list[str], str]:
    """`xpyd up` of ``x`` prefill and ``y`` decode workers through etcd, on free ports (``room``: ports for that many
    workers of each role, for a planner that starts more), its queue and concurrency limits sized for ``streams``
    at once, served as "m", with ``extra`` flags; and the proxy's URL."""
    port, etcd = _free_run(1), _free_run(2, 29000)
    pp = _free_run(2 * max(x, room), 22000)
    dp = _free_run(2 * max(y, room), pp + 2 * max(x, room))
    cmd = [PY, "-m", "xpyd", "up", "--prefill", str(x), "--decode", str(y), "--port", str(port), "--prefill-port",
           str(pp), "--decode-port", str(dp), "--etcd-port", str(etcd), "--served-model-name", "m", "--max-queue",
           str(max(256, streams)), "--max-concurrent-requests", str(max(1024, 2 * streams)), *extra]
    return cmd, f"http://127.0.0.1:{port}"


def start_up(cmd: list[str], log: Path, env: dict | None = None, timeout: float = 600.0) -> subprocess.Popen:
    """Run ``cmd`` (an `xpyd up`), its output to ``log``, until it says it serves; RuntimeError with the log's
    tail if it exits or takes longer than ``timeout``."""
    started = time.monotonic()
    up = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                          start_new_session=True)
    while "Press Ctrl-C to stop" not in log.read_text(errors="replace"):
        if up.poll() is not None or time.monotonic() - started > timeout:
            stop(up)
            raise RuntimeError("xpyd up did not start:\n" + log.read_text(errors="replace")[-3000:])
        time.sleep(0.2)
    return up


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
        except (OSError, ValueError):
            continue
    return out


def _tree(pid: int) -> list[int]:
    return [pid] + [q for c in _children(pid) for q in _tree(c)]


def _kind(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    if argv and argv[0].endswith(b"etcd"):
        return "etcd"
    for word in (b"prefill", b"decode", b"proxy", b"up"):
        if word in argv[1:5]:
            return word.decode()
    return "other"


def _pss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def memory(up_pid: int) -> dict:
    """PSS per process kind: count, total and largest, in MB."""
    kinds: dict[str, list[int]] = {}
    for pid in _tree(up_pid):
        try:
            kinds.setdefault(_kind(pid), []).append(_pss_kb(pid))
        except OSError:
            continue
    out = {k: {"processes": len(v), "pss_mb_total": round(sum(v) / 1024, 1), "pss_mb_max": round(max(v) / 1024, 1)}
           for k, v in sorted(kinds.items())}
    out["all"] = {"processes": sum(len(v) for v in kinds.values()),
                  "pss_mb_total": round(sum(sum(v) for v in kinds.values()) / 1024, 1)}
    return out


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its descendants now (those that exited are not counted)."""
    total = 0.0
    for p in _tree(pid):
        try:
            total += _cpu_seconds(p)
        except (OSError, ValueError, IndexError):
            continue
    return total


def stop(up: subprocess.Popen) -> None:
    """SIGTERM `xpyd up`'s process group, wait (SIGKILL after 120 s); nothing if it is gone."""
    try:
        os.killpg(up.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        up.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(up.pid, signal.SIGKILL)
        up.wait()


def emit(result: dict, path: str | None) -> None:
    """Print ``result`` as JSON, and write it to ``path`` if given."""
    print(json.dumps(result, indent=1))
    if path:
        Path(path).write_text(json.dumps(result, indent=1) + "\n")


def _routed(url: str) -> int:
    with urllib.request.urlopen(url + "/cluster", timeout=10) as r:
        return sum(1 for w in json.loads(r.read())["workers"] if w["health"] == "up")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=int, default=16)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--streams", type=int, default=1000, help="concurrent streams (and requests) of the load")
    ap.add_argument("--speedup", default="1", help="--sim-speedup of the workers (inf: no simulated time)")
    ap.add_argument("--profile", default=None, help="--sim-profile (default: the built-in one)")
    ap.add_argument("--kv-token-bytes", type=int, default=2048, help="--sim-kv-token-bytes")
    ap.add_argument("--batch-size", type=int, default=32, help="per worker")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prefill-wait-timeout", type=float, default=None,
                    help="the decode workers' --prefill-wait-timeout (default: theirs, 30 s; a queue of N prompts "
                         "on X prefill workers is deeper than that at speed-up 1)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    x, y = args.prefill, args.decode
    work = Path(tempfile.mkdtemp(prefix="xpyd-scale-"))
    log = work / "up.log"
    cmd, url = up_command(x, y, args.streams, "--engine", "sim", "--sim-speedup", args.speedup,
                          "--sim-kv-token-bytes", str(args.kv_token_bytes), "--batch-size", str(args.batch_size),
                          "--expose-worker-timing")
    if args.profile:
        cmd += ["--sim-profile", args.profile]
    if args.prefill_wait_timeout is not None:
        cmd += ["--prefill-wait-timeout", str(args.prefill_wait_timeout)]
    started = time.monotonic()
    up = start_up(cmd, log)
    result: dict = {"prefill": x, "decode": y, "streams": args.streams, "speedup": args.speedup,
                    "prefill_wait_timeout": args.prefill_wait_timeout,
                    "kv_token_bytes": args.kv_token_bytes, "batch_size": args.batch_size,
                    "input_len": args.input_len, "output_len": args.output_len}
    try:
        result["ready_s"] = round(time.monotonic() - started, 1)
        while _routed(url) < x + y:
            if time.monotonic() - started > 600:
                raise RuntimeError(f"the proxy routes to {_routed(url)} of {x + y} workers")
            time.sleep(0.2)
        result["all_routed_s"] = round(time.monotonic() - started, 1)
        result["memory_idle"] = memory(up.pid)
        proxy = next(p for p in _tree(up.pid) if _kind(p) == "proxy")
        cpu0 = _cpu_seconds(proxy)
        cluster0 = _tree_cpu(up.pid)
        report = work / "bench.json"
        bench = subprocess.run(
            [PY, "-m", "xpyd", "bench", "--url", url, "--model", "m", "--no-progress", "--num-requests",
             str(args.streams), "--concurrency", str(args.streams), "--input-len", str(args.input_len),
             "--output-len", str(args.output_len), "--warmup", "4", "--timeout", "900", "--json", str(report)],
            cwd=ROOT, capture_output=True, text=True, timeout=3600)
        if bench.returncode != 0:
            raise RuntimeError(f"xpyd bench failed ({bench.returncode}):\n{bench.stdout[-2000:]}\n{bench.stderr[-2000:]}")
        cpu = _cpu_seconds(proxy) - cpu0
        cluster_cpu = _tree_cpu(up.pid) - cluster0
        rep = json.loads(report.read_text())
        result["bench"] = {k: rep.get(k) for k in ("completed", "failed", "errors", "duration_s", "requests_per_s",
                                                    "output_tokens_per_s", "ttft_ms", "itl_ms", "e2e_ms",
                                                    "proxy_overhead")}
        if (o := rep.get("proxy_overhead")) is not None:
            print(f"proxy-added TTFT p50 {_ms(o['proxy_ttft_ms']['p50'])} ms, p99 {_ms(o['proxy_ttft_ms']['p99'])} ms; "
                  f"ITL p99 client {_ms(o['client_itl_ms']['p99'])} ms / workers {_ms(o['worker_itl_ms']['p99'])} ms "
                  f"= {_ms(o['itl_p99_ratio'])} ({o['requests']} requests with the workers' timing, "
                  f"{o['missing']} without)", file=sys.stderr)
        done = (rep.get("completed") or 0) + (rep.get("failed") or 0) + 4
        result["proxy_cpu_ms_per_request"] = round(1000 * cpu / max(1, done), 3)
        # Every process of the cluster (proxy, workers, etcd, up) over the load: what the work cost in CPU, and
        # the output tokens per CPU second it bought (how a control plane scales when cores, not workers, are
        # what a box has too few of).
        result["cluster_cpu_s"] = round(cluster_cpu, 2)
        tokens = (rep.get("output_tokens_per_s") or 0) * (rep.get("duration_s") or 0)
        result["output_tokens_per_cpu_s"] = round(tokens / cluster_cpu, 1) if cluster_cpu > 0 else None
        result["memory_after_load"] = memory(up.pid)
    finally:
        stop(up)
    emit(result, args.json)
    return 0 if result.get("bench", {}).get("failed") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
