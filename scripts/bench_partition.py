"""A partial network partition under load: one prefill/decode link of a 2P2D cluster cut for a while.

Five network-namespace hosts of the test bed (scripts/netbed.py): the proxy, p0, p1, d0 and d1, each
worker with one thread. ``--streams`` clients (threads in the root namespace, through the bed's access
link) send streaming completions one after another; ``--before`` seconds in, the link p0-d0 is cut (both
directions, silently: nftables drops every packet, as a cable cut) for ``--cut`` seconds, then healed,
and the load runs ``--after`` seconds more. Every worker stays healthy in the proxy's view: only the pair
p0-d0 cannot work. Counted per phase (by when a request started): requests and failures.

    sudo .venv/bin/python scripts/bench_partition.py --out docs/bench/DIR [--label current]
    # the same on another checkout (e.g. before a change), with this checkout's venv:
    sudo .venv/bin/python scripts/bench_partition.py --out docs/bench/DIR --xpyd-root /path/to/checkout --label before

writes DIR/partition_<label>.json (every request's start, end and error; the phase counts) and prints the
phase table.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import netbed  # noqa: E402
from bench_stream import get_json, stop_all, wait_http  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python")
WORDS = "the quick brown fox jumps over a lazy dog while small birds sing in green trees".split()


def one_request(proxy_host: str, text: str, max_tokens: int, timeout: float) -> dict:
    """A streaming completion read to its end: {start, end, ok, error}."""
    r = {"start": time.monotonic(), "end": 0.0, "ok": False, "error": None}
    conn = http.client.HTTPConnection(proxy_host, 8000, timeout=timeout)
    try:
        body = json.dumps({"prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                           "ignore_eos": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            r["error"] = f"HTTP {resp.status}: {resp.read(300)!r}"
            return r
        finish = None
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                r["error"] = event["error"].get("message")
            elif event.get("choices"):
                finish = event["choices"][0].get("finish_reason") or finish
        r["ok"] = r["error"] is None and finish is not None
        if not r["ok"] and r["error"] is None:
            r["error"] = "stream ended without a finish reason"
    except OSError as e:
        r["error"] = f"client: {type(e).__name__}: {e}"
    finally:
        conn.close()
        r["end"] = time.monotonic()
    return r


def run(args: argparse.Namespace, model: str) -> dict:
    out = Path(args.out)
    root = Path(args.xpyd_root).resolve()
    bed = netbed.NetBed("bp" + os.urandom(2).hex(), access=True)
    procs: list[subprocess.Popen] = []
    results: list[dict] = []
    try:
        hosts = {n: bed.add_host(n) for n in ("proxy", "p0", "p1", "d0", "d1")}
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(root))
        common = ["--model", model, "--threads", "1", "--max-model-len", "512", "--batch-size", "4"]

        def start(name: str, argv: list[str]) -> None:
            with (out / f"partition_{args.label}_{name}.log").open("wb") as f:
                procs.append(bed.popen(hosts[name], [PY, "-m", "xpyd", *argv], stdout=f,
                                       stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True))

        for name in ("p0", "p1"):
            start(name, ["prefill", *common, "--host", hosts[name].ip, "--port", "8100", "--signal-port", "8101"])
        # (a decode worker without a token follows request ids only to prefill workers it knows; checkouts
        # from before that rule have no --prefill-peers)
        peers = ([f"--prefill-peers={hosts['p0'].ip}:8101,{hosts['p1'].ip}:8101"]
                 if "--prefill-peers" in (root / "xpyd/worker/config.py").read_text() else [])
        for name in ("d0", "d1"):
            start(name, ["decode", *common, "--host", hosts[name].ip, "--port", "8200", "--kv-port", "8201",
                         *peers])
        urls = {n: f"http://{hosts[n].ip}:{8100 if n[0] == 'p' else 8200}" for n in ("p0", "p1", "d0", "d1")}
        for url in urls.values():
            wait_http(url + "/health", procs)
        proxy = hosts["proxy"].ip
        start("proxy", ["proxy", "--host", proxy, "--port", "8000", "--prefill", urls["p0"], "--prefill",
                        urls["p1"], "--decode", urls["d0"], "--decode", urls["d1"], "--policy", "least_loaded"])
        wait_http(f"http://{proxy}:8000/health", procs)

        stop = threading.Event()
        lock = threading.Lock()

        def client(stream: int) -> None:
            k = 0
            while not stop.is_set():
                words = " ".join(WORDS[(stream + k + i) % len(WORDS)] for i in range(args.prompt_words))
                r = one_request(proxy, f"s{stream}.{k}: {words}", args.max_tokens, timeout=60)
                with lock:
                    results.append(r)
                k += 1

        threads = [threading.Thread(target=client, args=(s,), daemon=True) for s in range(args.streams)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(args.before)
        t_cut = time.monotonic()
        bed.cut(hosts["p0"], hosts["d0"])
        time.sleep(args.cut)
        bed.heal(hosts["p0"], hosts["d0"])
        t_heal = time.monotonic()
        time.sleep(args.after)
        stop.set()
        for t in threads:
            t.join(90)
        t_end = time.monotonic()
        cluster = get_json(f"http://{proxy}:8000/cluster")
        received = {n: get_json(urls[n] + "/xpyd/stats").get("kv_backend", {}).get("received", {}) for n in ("d0", "d1")}
    finally:
        stop_all(procs)
        bed.close()

    def phase(lo: float, hi: float) -> dict:
        """Requests that started in [lo, hi) (seconds from the load's start)."""
        rs = [r for r in results if lo <= r["start"] - t0 < hi]
        failed = [r for r in rs if not r["ok"]]
        return {"from_s": round(lo, 1), "to_s": round(hi, 1), "requests": len(rs), "failed": len(failed),
                "failed_share": round(len(failed) / len(rs), 3) if rs else None}

    cut_s, heal_s, end_s = t_cut - t0, t_heal - t0, t_end - t0
    failed = sorted((r for r in results if not r["ok"]), key=lambda r: r["start"])
    return {"label": args.label, "xpyd_root": str(root), "args": vars(args),
            "phases": {"before": phase(0, cut_s), "cut": phase(cut_s, heal_s), "after": phase(heal_s, end_s)},
            "failures": [{"start_s": round(r["start"] - t0, 2), "end_s": round(r["end"] - t0, 2),
                          "error": (r["error"] or "")[:200]} for r in failed],
            "avoided_pairs_at_end": cluster.get("avoided_pairs"), "received": received,
            "requests": [{k: round(v - t0, 3) if k in ("start", "end") else v for k, v in r.items()}
                         for r in results]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--label", default="current")
    p.add_argument("--xpyd-root", default=str(ROOT), help="the checkout whose xpyd runs (this one's venv)")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt-words", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--before", type=float, default=10.0, help="seconds of load before the cut")
    p.add_argument("--cut", type=float, default=40.0, help="seconds the link p0-d0 stays cut")
    p.add_argument("--after", type=float, default=15.0, help="seconds of load after the heal")
    args = p.parse_args()
    reason = netbed.available() or netbed.nft_missing()
    if reason:
        print(f"no test bed here: {reason}", file=sys.stderr)
        return 2
    Path(args.out).mkdir(parents=True, exist_ok=True)
    from xpyd.model.loader import ensure_converted

    model = str(ensure_converted(None).path)
    report = run(args, model)
    (Path(args.out) / f"partition_{args.label}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"{args.label}: {args.streams} streams; p0-d0 cut from {report['phases']['cut']['from_s']}s "
          f"to {report['phases']['cut']['to_s']}s")
    print(f"{'phase':>7} {'requests':>9} {'failed':>7} {'share':>7}")
    for name, ph in report["phases"].items():
        share = "-" if ph["failed_share"] is None else f"{100 * ph['failed_share']:.1f}%"
        print(f"{name:>7} {ph['requests']:>9} {ph['failed']:>7} {share:>7}")
    print(f"avoided pairs at the end: {report['avoided_pairs_at_end']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
