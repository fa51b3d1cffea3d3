#!/usr/bin/env python3
"""What the control plane costs as the cluster grows: for each size in --sizes (total workers, split 1:3
prefill:decode as 16P48D is; 2 is 1P1D), `xpyd up --engine sim` through etcd, then three phases, each with
every process's /metrics read before and after:

- idle_cold: --idle seconds after every worker is routed, before any request (no signal session open yet:
  a decode worker connects to a prefill worker the first time a request pairs them);
- load: `xpyd bench` with a fixed request count and concurrency (--requests, --concurrency) through the proxy;
- idle_warm: --idle seconds after the load (the signal sessions the load opened stay open and heartbeat).

Per phase: signal-plane messages/s (every message counted once, by its sender) and heartbeats/s per decode
and per prefill worker; etcd operations/s over every process (calls made, and watch events received); the
proxy's HTTP calls to the workers by kind (counted where they arrive; this script's own /metrics reads are
left out); proxy CPU; for the load, proxy CPU per request and routing time per request (p50/p99 from
xpyd_proxy_routing_seconds); PSS per worker kind. Also the one-off watch events of start-up (every worker's
registration reaches every watcher: the proxy and each worker).

Prints (and with --json / --markdown writes) the results and a table whose columns are the sizes, then a
line per metric: the exponent k of value ~ workers^k fitted over the sizes, and what that means (flat,
linear in workers, or workers x workers).

    .venv/bin/python scripts/scale_costs.py --sizes 2,8,32,64 --idle 30 --requests 200 --concurrency 64 \
        --speedup inf --json costs.json --markdown costs.md

Every process is a child of this one and stops with it; nothing but 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_sim import PY, ROOT, _cpu_seconds, _free_run, _kind, _tree, memory  # noqa: E402

SCRAPE_TIMEOUT = 10.0
OWN_ROUTES = ("/metrics",)  # this script's reads, not the proxy's calls


def split(n: int) -> tuple[int, int]:
    """Total workers -> (prefill, decode), 1:3 (2 -> 1P1D)."""
    if n < 2:
        raise ValueError(f"a size is at least 2 workers (one of each role), got {n}")
    p = max(1, n // 4)
    return p, n - p


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=SCRAPE_TIMEOUT) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, lab), v in samples.items()
               if n == name and all(dict(lab).get(k) == want for k, want in labels.items()))


def by_label(samples: dict, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, lab), v in samples.items():
        if n == name:
            key = dict(lab).get(label, "")
            out[key] = out.get(key, 0.0) + v
    return out


def quantile(buckets: dict[float, float], q: float) -> float | None:
    """Prometheus' histogram_quantile over cumulative ``buckets`` (upper bound -> count): linear within
    the bucket; None without observations."""
    bounds = sorted(buckets)
    n = buckets[bounds[-1]] if bounds else 0
    if n <= 0:
        return None
    rank, lower, below = q * n, 0.0, 0.0
    for b in bounds:
        if buckets[b] >= rank:
            if math.isinf(b):
                return lower  # beyond the last finite bucket: its bound is all that is known
            return lower + (b - lower) * (rank - below) / max(buckets[b] - below, 1e-12)
        lower, below = b, buckets[b]
    return lower


class Cluster:
    """One `xpyd up --engine sim` and what it takes to read every process."""

    def __init__(self, prefill: int, decode: int, args: argparse.Namespace) -> None:
        self.prefill, self.decode = prefill, decode
        self.port, etcd = _free_run(1), _free_run(2, 29000)
        pp = _free_run(2 * prefill, 22000)
        dp = _free_run(2 * decode, pp + 2 * prefill)
        self.work = Path(tempfile.mkdtemp(prefix="xpyd-costs-"))
        self.log = self.work / "up.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [PY, "-m", "xpyd", "up", "--engine", "sim", "--prefill", str(prefill), "--decode", str(decode),
                    "--port", str(self.port), "--prefill-port", str(pp), "--decode-port", str(dp),
                    "--etcd-port", str(etcd), "--served-model-name", "m", "--sim-speedup", args.speedup,
                    "--sim-kv-token-bytes", str(args.kv_token_bytes), "--batch-size", str(args.batch_size),
                    "--max-queue", str(max(256, args.requests)),
                    "--max-concurrent-requests", str(max(1024, 2 * args.concurrency))]
        self.up: subprocess.Popen | None = None
        self.workers: dict[str, list[str]] = {}  # role -> metrics base URLs

    def start(self, timeout: float = 600) -> float:
        started = time.monotonic()
        self.up = subprocess.Popen(self.cmd, stdout=self.log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT,
                                   start_new_session=True)
        while True:
            if self.up.poll() is not None or time.monotonic() - started > timeout:
                raise RuntimeError("xpyd up did not start:\n" + self.log.read_text(errors="replace")[-3000:])
            if "Press Ctrl-C to stop" in self.log.read_text(errors="replace"):
                try:
                    with urllib.request.urlopen(self.url + "/cluster", timeout=SCRAPE_TIMEOUT) as r:
                        workers = json.loads(r.read())["workers"]
                except OSError:
                    workers = []
                if sum(w["health"] == "up" for w in workers) == self.prefill + self.decode:
                    break
            time.sleep(0.2)
        for w in workers:
            self.workers.setdefault(w["role"], []).append(w["http_url"])
        return time.monotonic() - started

    def pid(self, kind: str) -> list[int]:
        return [p for p in _tree(self.up.pid) if _safe_kind(p) == kind]

    def snapshot(self) -> dict:
        """Every process's metrics and CPU seconds, now."""
        cpu = {}
        for kind in ("proxy", "prefill", "decode", "etcd"):
            cpu[kind] = sum(_safe_cpu(p) for p in self.pid(kind))
        return {"t": time.monotonic(), "cpu": cpu, "proxy": scrape(self.url),
                "workers": {role: [scrape(u) for u in urls] for role, urls in self.workers.items()}}

    def stop(self) -> None:
        if self.up is None or self.up.poll() is not None:
            return
        os.killpg(self.up.pid, signal.SIGTERM)
        try:
            self.up.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(self.up.pid, signal.SIGKILL)
            self.up.wait()


def _safe_kind(pid: int) -> str:
    try:
        return _kind(pid)
    except OSError:
        return "gone"


def _safe_cpu(pid: int) -> float:
    try:
        return _cpu_seconds(pid)
    except OSError:
        return 0.0


def _sum_workers(snap: dict, role: str, name: str, **labels: str) -> float:
    return sum(total(s, name, **labels) for s in snap["workers"].get(role, []))


def phase(a: dict, b: dict, cluster: Cluster, requests: int | None = None) -> dict:
    """The costs between two snapshots."""
    dt = b["t"] - a["t"]
    P, D = cluster.prefill, cluster.decode

    def rate(role: str, name: str, **labels: str) -> float:
        return (_sum_workers(b, role, name, **labels) - _sum_workers(a, role, name, **labels)) / dt

    sig = "xpyd_signal_messages_total"
    messages = rate("decode", sig, direction="sent") + rate("prefill", sig, direction="sent")
    etcd_names = "xpyd_etcd_operations_total"
    etcd_ops: dict[str, float] = {}
    for role in ("prefill", "decode"):
        for sa, sb in zip(a["workers"].get(role, []), b["workers"].get(role, [])):
            for op, v in by_label(sb, etcd_names, "op").items():
                etcd_ops[op] = etcd_ops.get(op, 0.0) + (v - by_label(sa, etcd_names, "op").get(op, 0.0)) / dt
    for op, v in by_label(b["proxy"], etcd_names, "op").items():
        etcd_ops[op] = etcd_ops.get(op, 0.0) + (v - by_label(a["proxy"], etcd_names, "op").get(op, 0.0)) / dt
    http: dict[str, float] = {}
    for role in ("prefill", "decode"):
        for sa, sb in zip(a["workers"].get(role, []), b["workers"].get(role, [])):
            before = by_label(sa, "xpyd_http_requests_total", "route")
            for route, v in by_label(sb, "xpyd_http_requests_total", "route").items():
                if route not in OWN_ROUTES:
                    http[route] = http.get(route, 0.0) + (v - before.get(route, 0.0)) / dt
    out = {
        "seconds": round(dt, 2),
        "signal_messages_per_s": round(messages, 2),
        "signal_by_kind_per_s": {k: round(v, 2) for k, v in sorted(_kinds(a, b, dt).items()) if v},
        "heartbeats_per_s_per_decode": round(rate("decode", sig, direction="sent", kind="heartbeat") / D, 3),
        "heartbeats_per_s_per_prefill": round(rate("prefill", sig, direction="received", kind="heartbeat") / P, 3),
        "signal_sessions_opened": int(_sum_workers(b, "decode", sig, direction="sent", kind="hello")),
        "etcd_ops_per_s": round(sum(etcd_ops.values()), 2),
        "etcd_by_op_per_s": {k: round(v, 2) for k, v in sorted(etcd_ops.items()) if v},
        "proxy_http_to_workers_per_s": round(sum(http.values()), 2),
        "proxy_http_by_route_per_s": {k: round(v, 2) for k, v in sorted(http.items()) if v},
        "cpu_ms_per_s": {k: round(1000 * (b["cpu"][k] - a["cpu"][k]) / dt, 1) for k in b["cpu"]},
    }
    out["worker_cpu_ms_per_s_per_worker"] = round(
        (out["cpu_ms_per_s"]["prefill"] + out["cpu_ms_per_s"]["decode"]) / (P + D), 2)
    if requests:
        out["signal_messages_per_request"] = round(messages * dt / requests, 2)
        out["proxy_http_to_workers_per_request"] = round(out["proxy_http_to_workers_per_s"] * dt / requests, 2)
        out["proxy_cpu_ms_per_request"] = round(1000 * (b["cpu"]["proxy"] - a["cpu"]["proxy"]) / requests, 3)
        buckets = {}
        for (n, lab), v in b["proxy"].items():
            if n == "xpyd_proxy_routing_seconds_bucket":
                le = float(dict(lab)["le"])
                buckets[le] = v - a["proxy"].get((n, lab), 0.0)
        count, summed = (total(b["proxy"], f"xpyd_proxy_routing_seconds_{s}")
                         - total(a["proxy"], f"xpyd_proxy_routing_seconds_{s}") for s in ("count", "sum"))
        p50, p99 = quantile(buckets, 0.5), quantile(buckets, 0.99)
        out["routing_us"] = {"count": int(count), "mean": round(1e6 * summed / count, 1) if count else None,
                             "p50": round(1e6 * p50, 1) if p50 is not None else None,
                             "p99": round(1e6 * p99, 1) if p99 is not None else None}
    return out


def _kinds(a: dict, b: dict, dt: float) -> dict[str, float]:
    """Messages/s by kind, each counted by its sender."""
    out: dict[str, float] = {}
    for role in ("prefill", "decode"):
        for sa, sb in zip(a["workers"].get(role, []), b["workers"].get(role, [])):
            for (n, lab), v in sb.items():
                labels = dict(lab)
                if n == "xpyd_signal_messages_total" and labels.get("direction") == "sent":
                    out[labels["kind"]] = out.get(labels["kind"], 0.0) + (v - sa.get((n, lab), 0.0)) / dt
    return out


def bench(cluster: Cluster, args: argparse.Namespace) -> dict:
    report = cluster.work / "bench.json"
    run = subprocess.run(
        [PY, "-m", "xpyd", "bench", "--url", cluster.url, "--model", "m", "--no-progress", "--num-requests",
         str(args.requests), "--concurrency", str(args.concurrency), "--input-len", str(args.input_len),
         "--output-len", str(args.output_len), "--warmup", "0", "--timeout", "900", "--json", str(report)],
        cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if run.returncode != 0:
        raise RuntimeError(f"xpyd bench failed ({run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    rep = json.loads(report.read_text())
    return {k: rep.get(k) for k in ("completed", "failed", "duration_s", "requests_per_s", "output_tokens_per_s")}


def start(n: int, args: argparse.Namespace, tries: int = 3) -> tuple[Cluster, float]:
    """A started cluster of ``n`` workers; new ports if one was taken meanwhile (the last run's etcd may
    still hold its port for a moment, and the ports are free only when chosen)."""
    for attempt in range(tries):
        cluster = Cluster(*split(n), args)
        try:
            return cluster, cluster.start()
        except RuntimeError as e:
            cluster.stop()
            if "already in use" not in str(e) or attempt == tries - 1:
                raise
            print(f"a port was taken, starting again: {str(e)[-200:]}", file=sys.stderr)
    raise AssertionError("unreachable")


def measure(n: int, args: argparse.Namespace) -> dict:
    cluster, ready = start(n, args)
    result: dict = {"workers": n, "prefill": cluster.prefill, "decode": cluster.decode, "ready_s": round(ready, 1)}
    try:
        s0 = cluster.snapshot()
        result["startup_watch_events"] = int(
            total(s0["proxy"], "xpyd_etcd_operations_total", op="watch_event")
            + sum(_sum_workers(s0, r, "xpyd_etcd_operations_total", op="watch_event") for r in ("prefill", "decode")))
        time.sleep(args.idle)  # (the phase is a span of time: nothing to wait for)
        s1 = cluster.snapshot()
        result["memory_idle"] = memory(cluster.up.pid)
        result["bench"] = bench(cluster, args)
        s2 = cluster.snapshot()
        result["memory_after_load"] = memory(cluster.up.pid)
        time.sleep(args.idle)
        s3 = cluster.snapshot()
        result["idle_cold"] = phase(s0, s1, cluster)
        result["load"] = phase(s1, s2, cluster, requests=args.requests)
        result["idle_warm"] = phase(s2, s3, cluster)
    finally:
        cluster.stop()
    return result


def _pss(r: dict, kind: str) -> float | None:
    m = r["memory_after_load"].get(kind)
    return round(m["pss_mb_total"] / m["processes"], 1) if m else None


# (row name, how to read it from one size's result, what it is per: "cluster" totals grow with the
# workers if each worker costs the same; "worker" and "request" values should stay flat)
ROWS = [
    ("PSS per prefill worker, MB", lambda r: _pss(r, "prefill"), "worker"),
    ("PSS per decode worker, MB", lambda r: _pss(r, "decode"), "worker"),
    ("PSS proxy, MB", lambda r: _pss(r, "proxy"), "process"),
    ("proxy CPU per request, ms", lambda r: r["load"]["proxy_cpu_ms_per_request"], "request"),
    ("routing p50, us", lambda r: r["load"]["routing_us"]["p50"], "request"),
    ("routing p99, us", lambda r: r["load"]["routing_us"]["p99"], "request"),
    ("signal msgs/s, idle before load", lambda r: r["idle_cold"]["signal_messages_per_s"], "cluster"),
    ("signal msgs/s, under load", lambda r: r["load"]["signal_messages_per_s"], "cluster"),
    ("signal msgs per request, under load", lambda r: r["load"]["signal_messages_per_request"], "request"),
    ("signal msgs/s, idle after load", lambda r: r["idle_warm"]["signal_messages_per_s"], "cluster"),
    ("signal sessions opened (decode->prefill)", lambda r: r["idle_warm"]["signal_sessions_opened"], "cluster"),
    ("heartbeats/s per decode worker, idle after load", lambda r: r["idle_warm"]["heartbeats_per_s_per_decode"],
     "worker"),
    ("heartbeats/s per prefill worker, idle after load",
     lambda r: r["idle_warm"]["heartbeats_per_s_per_prefill"], "worker"),
    ("etcd ops/s, idle", lambda r: r["idle_warm"]["etcd_ops_per_s"], "cluster"),
    ("etcd ops/s, under load", lambda r: r["load"]["etcd_ops_per_s"], "cluster"),
    ("etcd watch events at start-up", lambda r: r["startup_watch_events"], "cluster"),
    ("proxy HTTP calls to workers/s, idle", lambda r: r["idle_warm"]["proxy_http_to_workers_per_s"], "cluster"),
    ("proxy HTTP calls to workers/s, under load", lambda r: r["load"]["proxy_http_to_workers_per_s"], "cluster"),
    ("proxy HTTP calls to workers per request, under load",
     lambda r: r["load"]["proxy_http_to_workers_per_request"], "request"),
    ("proxy CPU ms/s, idle", lambda r: r["idle_warm"]["cpu_ms_per_s"]["proxy"], "cluster"),
    ("worker CPU ms/s per worker, idle", lambda r: r["idle_warm"]["worker_cpu_ms_per_s_per_worker"], "worker"),
]


def exponent(sizes: list[int], values: list) -> float | None:
    """k of value ~ workers^k, least squares over the sizes with a positive value."""
    pts = [(math.log(n), math.log(v)) for n, v in zip(sizes, values) if isinstance(v, (int, float)) and v > 0]
    if len(pts) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else None


def verdict(k: float | None, per: str, values: list) -> str:
    if k is None:
        return "zero at every size" if all(v == 0 for v in values) else "too few non-zero sizes to fit"
    if per == "cluster":  # a total over the cluster: linear in workers is each worker costing the same
        if k <= 1.25:
            return f"~N^{k:.2f}: linear in workers or less (per worker flat)"
        if k >= 1.75:
            return f"~N^{k:.2f}: workers x workers (per worker grows with the cluster)"
        return f"~N^{k:.2f}: between linear and workers x workers"
    if abs(k) <= 0.25:
        return f"~N^{k:.2f}: flat per {per}"
    if k < 0:
        return f"~N^{k:.2f}: falls as workers grow, per {per}"
    if k <= 1.25:
        return f"~N^{k:.2f}: grows with workers per {per} (linear or less)"
    return f"~N^{k:.2f}: grows faster than workers per {per}"


def table(results: list[dict]) -> str:
    sizes = [r["workers"] for r in results]
    head = "| metric | " + " | ".join(f"{r['workers']} ({r['prefill']}P{r['decode']}D)" for r in results) + " |"
    lines = [head, "|---" * (len(results) + 1) + "|"]
    growth = []
    for name, get, per in ROWS:
        values = []
        for r in results:
            try:
                values.append(get(r))
            except (KeyError, TypeError):
                values.append(None)
        lines.append(f"| {name} | " + " | ".join("-" if v is None else f"{v:g}" for v in values) + " |")
        growth.append(f"- {name}: {verdict(exponent(sizes, values), per, values)}")
    return "\n".join(lines) + "\n\nGrowth with workers N (fitted over the sizes):\n" + "\n".join(growth) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2,8,32,64", help="total workers per run, comma-separated (1:3 P:D)")
    ap.add_argument("--idle", type=float, default=30.0, help="seconds of each idle phase")
    ap.add_argument("--requests", type=int, default=200, help="requests of the load")
    ap.add_argument("--concurrency", type=int, default=64, help="concurrent requests of the load")
    ap.add_argument("--speedup", default="inf", help="--sim-speedup of the workers (inf: no simulated time)")
    ap.add_argument("--kv-token-bytes", type=int, default=2048, help="--sim-kv-token-bytes (as scale_sim.py)")
    ap.add_argument("--batch-size", type=int, default=32, help="per worker")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--markdown", default=None, help="write the table here")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results = []
    for n in sizes:
        print(f"--- {n} workers", file=sys.stderr, flush=True)
        results.append(measure(n, args))
        print(json.dumps(results[-1], indent=1), file=sys.stderr, flush=True)
    settings = {k: getattr(args, k) for k in ("idle", "requests", "concurrency", "speedup", "kv_token_bytes",
                                              "batch_size",
                                              "input_len", "output_len")}
    md = table(results)
    print(md)
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": settings, "results": results}, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(md)
    return 0 if all(r["bench"]["failed"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
