#!/usr/bin/env python3
"""The proxy's throughput against the reference design's (issue #24, goal 2), on the same instant workers.

Starts P prefill and D decode sim workers (``--engine sim --sim-speedup inf``: no simulated time, so the workers
answer as fast as their HTTP and scheduling allow) and, in turn, one proxy in front of them: ``xpyd proxy`` (with
``--workers N`` for each N of ``--xpyd-workers``) or ``scripts/reference_proxy.py`` (the AWS Neuron DI guide's
design: Quart + aiohttp, a new session per request, round robin). Each proxy gets a warm-up run, then a measured
``xpyd bench`` run of ``--requests`` short streaming requests at ``--concurrency`` (16-token prompts, 8 output
tokens by default: it measures the proxy, not the engine). Rounds alternate the order of the proxies (ABBA...)
so a drift of the machine's load hits both alike. For each run it reports:

- ``rps``: completed requests per second of wall time (``xpyd bench``'s);
- ``cpu_s``: the proxy's CPU seconds over the measured run (user + system of its process and its children,
  from /proc/PID/stat), ``cpu_ms_per_req`` = that / requests, and ``rps_per_core`` = requests / cpu_s: the
  requests/s one fully used core gives (the goal's "per core used");
- ``workers_cpu_s``: the workers' CPU seconds over the run (are they what limits ``rps``?);
- ``failed`` and ``errors`` by kind.

and, over the rounds, the median of each and the ratios xpyd / reference (and xpyd --workers N / --workers 1).
On a shared machine the numbers are provisional: run it on a quiet one. The full measured run::

    .venv/bin/python scripts/bench_proxy_throughput.py --requests 10000 --rounds 3 --json proxy_tput.json

and the proxy's scaling to a second core, on a machine with cores to spare (the proxy on 2 of them, the
workers and the client on the rest)::

    .venv/bin/python scripts/bench_proxy_throughput.py --requests 10000 --rounds 3 --xpyd-workers 1,2 \
        --prefill 4 --decode 4 --proxy-cpus 0-1 --other-cpus 2-15 --json proxy_scaling.json

and a smoke run (a few seconds a run)::

    .venv/bin/python scripts/bench_proxy_throughput.py --requests 300 --rounds 1 --warmup 64

Every process is a child of this one, on 127.0.0.1, and stops with it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv/bin/python")
TICK = os.sysconf("SC_CLK_TCK")
sys.path.insert(0, str(ROOT))

from scripts.scale_sim import _free_run, _tree  # noqa: E402  (ports, a process's tree)

REFERENCE = "reference"


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` (processes that are gone count 0)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / TICK


def tree_cpu(pid: int) -> float:
    return cpu_seconds(_tree(pid))


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    url: str

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not _healthy(self.url):
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n" + self.tail())
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not healthy in {timeout:g}s:\n" + self.tail())
            time.sleep(0.2)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()


def pinned(cpus: str | None, argv: list[str]) -> list[str]:
    """``argv`` run on the CPUs ``cpus`` (taskset's list, e.g. 0-1), or anywhere when None."""
    return argv if cpus is None else ["taskset", "-c", cpus, *argv]


def start(name: str, argv: list[str], url: str, work: Path, src: str | None = None) -> Proc:
    """``src``: a folder holding another ``xpyd`` package to run instead of this checkout's."""
    log = work / f"{name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_WAIT_POLICY="PASSIVE")
    if src is not None:
        env["PYTHONPATH"] = src
    # (run in ``src``: ``python -m`` puts its working directory first on sys.path, ahead of PYTHONPATH, so from
    # this checkout the baseline would run this checkout's package, and so would its --workers children)
    popen = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=src or ROOT, env=env,
                             start_new_session=True)
    return Proc(name, popen, log, url)


def start_workers(args: argparse.Namespace, work: Path) -> tuple[list[Proc], list[Proc]]:
    """P prefill and D decode sim workers (each takes two ports: HTTP and signal plane / KV listener)."""
    p, d = args.prefill, args.decode
    base = _free_run(2 * (p + d), 24000)
    # Room for every stream on the decode workers and every prompt on the prefill workers at once.
    batch = -(-args.concurrency // min(p, d)) + 16
    common = ["--engine", "sim", "--sim-speedup", "inf", "--sim-kv-token-bytes", "64", "--served-model-name", "m",
              "--batch-size", str(batch), "--max-model-len", str(args.max_model_len), "--threads", "1"]
    prefills, decodes = [], []
    for i in range(p):
        port = base + 2 * i
        prefills.append(start(f"prefill{i}", pinned(args.other_cpus, [
            PY, "-m", "xpyd", "prefill", *common, "--port", str(port), "--signal-port", str(port + 1)]),
            f"http://127.0.0.1:{port}", work))
    for i in range(d):
        port = base + 2 * (p + i)
        decodes.append(start(f"decode{i}", pinned(args.other_cpus, [
            PY, "-m", "xpyd", "decode", *common, "--port", str(port), "--kv-port", str(port + 1)]),
            f"http://127.0.0.1:{port}", work))
    for w in (*prefills, *decodes):
        w.wait_healthy()
    return prefills, decodes


def start_proxy(kind: str, args: argparse.Namespace, prefills: list[Proc], decodes: list[Proc], port: int,
                work: Path, n: int, src: str | None = None) -> Proc:
    urls = [a for w in prefills for a in ("--prefill", w.url)] + [a for w in decodes for a in ("--decode", w.url)]
    if kind == REFERENCE:
        argv = [PY, str(ROOT / "scripts/reference_proxy.py"), "--port", str(port), *urls]
    else:
        argv = [PY, "-m", "xpyd", "proxy", "--port", str(port), *urls,
                "--max-concurrent-requests", str(4 * args.concurrency), "--max-queue", str(4 * args.concurrency)]
        if args.policy:
            argv += ["--policy", args.policy]
        if n > 1:
            argv += ["--workers", str(n)]
    proxy = start(f"{kind}{n}-{port}", pinned(args.proxy_cpus, argv), f"http://127.0.0.1:{port}", work, src)
    proxy.wait_healthy(60)
    return proxy


def bench(url: str, requests: int, args: argparse.Namespace, report: Path) -> dict:
    cmd = [PY, "-m", "xpyd", "bench", "--url", url, "--model", "m", "--no-progress", "--num-requests",
           str(requests), "--concurrency", str(args.concurrency), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--timeout", "120", "--json", str(report)]
    done = subprocess.run(pinned(args.other_cpus, cmd), cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"xpyd bench failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads(report.read_text())


def run_one(label: str, kind: str, n: int, args: argparse.Namespace, workers: list[Proc], prefills: list[Proc],
            decodes: list[Proc], work: Path, src: str | None = None) -> dict:
    port = _free_run(1, 23000)
    proxy = start_proxy(kind, args, prefills, decodes, port, work, n, src)
    spy: subprocess.Popen | None = None
    try:
        if args.warmup:
            bench(proxy.url, args.warmup, args, work / f"{label}-warmup.json")
        pids = _tree(proxy.popen.pid)  # (with --workers N: the processes that serve)
        wpids = [q for w in workers for q in _tree(w.popen.pid)]
        out = f"{args.py_spy}.{label.rsplit('-r', 1)[0]}.txt"
        if args.py_spy and not Path(out).exists():  # (each proxy's first run)
            spy = subprocess.Popen([str(ROOT / ".venv/bin/py-spy"), "record", "--pid", str(proxy.popen.pid),
                                    "--subprocesses", "--threads", "--rate", "250", "--format", "raw", "--output",
                                    out], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
            time.sleep(1)  # (attached)
        cpu0, wcpu0 = cpu_seconds(pids), cpu_seconds(wpids)
        rep = bench(proxy.url, args.requests, args, work / f"{label}.json")
        cpu, wcpu = cpu_seconds(pids) - cpu0, cpu_seconds(wpids) - wcpu0
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
        proxy.stop()
    completed = rep.get("completed") or 0
    return {"proxy": label, "processes": len(pids), "completed": completed, "failed": rep.get("failed"),
            "errors": rep.get("errors"), "duration_s": rep.get("duration_s"), "rps": rep.get("requests_per_s"),
            "cpu_s": round(cpu, 2), "cpu_ms_per_req": round(1000 * cpu / max(1, completed), 3),
            "rps_per_core": round(completed / cpu, 1) if cpu > 0 else None, "workers_cpu_s": round(wcpu, 2)}


def summarize(runs: list[dict], labels: list[str]) -> dict:
    out: dict = {}
    for label in labels:
        mine = [r for r in runs if r["proxy"] == label]
        out[label] = {k: statistics.median(r[k] for r in mine) for k in ("rps", "cpu_ms_per_req", "rps_per_core")
                      if all(r[k] is not None for r in mine)}
        out[label]["failed"] = sum(r["failed"] or 0 for r in mine)
    ref = out.get(REFERENCE, {})
    for label in labels:
        if label == REFERENCE or not ref:
            continue
        for k in ("rps", "rps_per_core"):
            if k in out[label] and ref.get(k):
                out[label][f"{k}_vs_reference"] = round(out[label][k] / ref[k], 2)
    one = out.get("xpyd", {})
    for label in labels:
        if label.startswith("xpyd-w") and one.get("rps"):
            out[label]["rps_vs_xpyd_w1"] = round(out[label]["rps"] / one["rps"], 2)
        if label == "xpyd-base" and out[label].get("rps_per_core"):
            one["rps_per_core_vs_base"] = round(one["rps_per_core"] / out[label]["rps_per_core"], 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=int, default=2, help="prefill sim workers")
    ap.add_argument("--decode", type=int, default=2, help="decode sim workers")
    ap.add_argument("--requests", type=int, default=5000, help="measured requests per run")
    ap.add_argument("--warmup", type=int, default=512, help="requests before each measured run (not counted)")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each proxy, alternating")
    ap.add_argument("--policy", default=None, help="xpyd proxy's --policy (default: its own default)")
    ap.add_argument("--xpyd-workers", default="1",
                    help="comma-separated --workers counts of xpyd proxy to measure, e.g. 1,2 (default: 1)")
    ap.add_argument("--no-reference", action="store_true", help="measure xpyd proxy only")
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="also measure xpyd proxy (--workers 1) from the xpyd package in DIR (e.g. a copy of the "
                         "package before a change: DIR/xpyd/...), as 'xpyd-base', for a before/after in one run")
    ap.add_argument("--py-spy", default=None, metavar="PREFIX",
                    help="sample each proxy's first measured run with py-spy (pip install py-spy) into "
                         "PREFIX.<proxy>.txt (collapsed stacks; its CPU time is not in the numbers, but it slows "
                         "the proxy)")
    ap.add_argument("--proxy-cpus", default=None, metavar="LIST",
                    help="run the proxy on these CPUs (taskset -c LIST, e.g. 0-1 for --workers 2): with "
                         "--other-cpus, the proxy's scaling is measured apart from the workers and the client")
    ap.add_argument("--other-cpus", default=None, metavar="LIST",
                    help="run the sim workers and xpyd bench on these CPUs (taskset -c LIST, e.g. 2-15)")
    ap.add_argument("--json", default=None, help="write the runs and the summary here")
    args = ap.parse_args()

    proxies: list[tuple[str, str, int, str | None]] = [
        ("xpyd" if n == 1 else f"xpyd-w{n}", "xpyd", n, None) for n in map(int, args.xpyd_workers.split(","))]
    if args.baseline:
        proxies.append(("xpyd-base", "xpyd", 1, str(Path(args.baseline).resolve())))
    if not args.no_reference:
        proxies.append((REFERENCE, REFERENCE, 1, None))
    work = Path(tempfile.mkdtemp(prefix="xpyd-proxy-tput-"))
    workers: list[Proc] = []
    runs: list[dict] = []
    try:
        prefills, decodes = start_workers(args, work)
        workers = [*prefills, *decodes]
        for r in range(args.rounds):
            for label, kind, n, src in (proxies if r % 2 == 0 else proxies[::-1]):
                run = run_one(f"{label}-r{r}", kind, n, args, workers, prefills, decodes, work, src)
                run["proxy"] = label
                runs.append(run)
                print(json.dumps(run), flush=True)
    finally:
        for w in workers:
            w.stop()
    result = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "cores": os.cpu_count(),
              "runs": runs, "summary": summarize(runs, [p[0] for p in proxies]), "logs": str(work)}
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(r["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
