"""KV streamed while prefill runs vs pulled after it, between two hosts of the test bed (scripts/netbed.py).

The prefill worker, the decode worker and the proxy each run on their own network-namespace host; the
prefill and decode hosts' links are shaped with tbf (default 1 Gbit/s), so the KV crosses a real, shaped
link (``auto`` picks tcp between hosts). Each worker has one thread (one core of this machine each, like
two hosts). For each configuration a fresh cluster serves ``--num-requests`` prompts of ``--input-len``
tokens at concurrency 1 (``xpyd bench``, from the root namespace through the bed's access link), and the
time from each request's first token to its second is read from the per-request timelines: that gap is
where the KV transfer shows, the first token coming from prefill and the second from decode once the KV
landed.

    sudo .venv/bin/python scripts/bench_stream.py --out docs/bench/DIR
    # configurations: pull (--no-kv-stream: the KV moves once the whole prompt is computed) and stream
    # (the default: each chunk's KV moves while the next chunk computes); same --prefill-chunk for both;
    # pull-fp8 and stream-fp8: the same with --kv-cache-dtype fp8_e4m3 on both workers (half the bytes);
    # pull-int8 and stream-int8: --kv-cache-dtype int8 (half the bytes and a 2-byte scale per row)
    sudo .venv/bin/python scripts/bench_stream.py --configs pull,pull-fp8,stream,stream-fp8 --out DIR

writes DIR/stream_<config>.json (the bench reports) and DIR/stream_summary.json, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))
import netbed  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python")
CONFIGS = {"pull": ["--no-kv-stream"], "stream": [], "pull-fp8": ["--no-kv-stream"], "stream-fp8": [],
           "pull-int8": ["--no-kv-stream"], "stream-int8": []}
KV_DTYPES = {"fp8": "fp8_e4m3", "int8": "int8"}  # (a configuration's suffix: the KV dtype of both its workers)


def _kv_flags(name: str) -> list[str]:
    suffix = name.rsplit("-", 1)[-1]
    return ["--kv-cache-dtype", KV_DTYPES[suffix]] if suffix in KV_DTYPES else []


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def wait_http(url: str, procs: list[subprocess.Popen], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a process exited during start-up (see the logs in the output folder)")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not up")


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process (each drains), then SIGKILL what has not exited 30 s later."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_config(name: str, extra: list[str], args: argparse.Namespace, model: str) -> dict:
    out = Path(args.out)
    bed = netbed.NetBed("bs" + os.urandom(2).hex(), access=True)
    procs: list[subprocess.Popen] = []
    try:
        p, d, x = (bed.add_host(h) for h in ("p", "d", "x"))
        if args.rate != "none":
            bed.shape(p, args.rate)
            bed.shape(d, args.rate)
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(ROOT))
        common = ["--model", model, "--threads", "1", "--max-model-len", str(args.input_len + 256),
                  "--batch-size", "4", *_kv_flags(name)]

        def start(host, argv: list[str], log: str) -> None:
            with (out / f"stream_{name}_{log}.log").open("wb") as f:
                procs.append(bed.popen(host, [PY, "-m", "xpyd", *argv], stdout=f, stderr=subprocess.STDOUT,
                                       env=env, cwd=ROOT, start_new_session=True))

        start(p, ["prefill", *common, "--host", p.ip, "--port", "8100", "--signal-port", "8101",
                  "--prefill-chunk", str(args.chunk), *extra], "prefill")
        # (a decode worker without a token follows request ids only to prefill workers it knows)
        peers = [f"--prefill-peers={p.ip}:8101"] if "--prefill-peers" in (ROOT / "xpyd/worker/config.py").read_text() else []
        start(d, ["decode", *common, "--host", d.ip, "--port", "8200", "--kv-port", "8201", *peers], "decode")
        wait_http(f"http://{p.ip}:8100/health", procs)
        wait_http(f"http://{d.ip}:8200/health", procs)
        start(x, ["proxy", "--host", x.ip, "--port", "8000", "--prefill", f"http://{p.ip}:8100",
                  "--decode", f"http://{d.ip}:8200"], "proxy")
        url = f"http://{x.ip}:8000"
        wait_http(url + "/health", procs)
        report = out / f"stream_{name}.json"
        subprocess.run([PY, "-m", "xpyd", "bench", "--url", url, "--tokenizer", model, "--no-progress",
                        "--input-len", str(args.input_len), "--output-len", "8", "--concurrency", "1",
                        "--num-requests", str(args.num_requests), "--warmup", "2", "--seed", "3",
                        "--include-requests", "--json", str(report)], check=True, cwd=ROOT, env=env,
                       stdout=subprocess.DEVNULL)
        data = json.loads(report.read_text())
        gaps = [1000 * (r["chunks_s"][1] - r["chunks_s"][0]) for r in data["requests"]
                if not r["error"] and len(r["chunks_s"]) > 1]
        pstats, dstats = get_json(f"http://{p.ip}:8100/xpyd/stats"), get_json(f"http://{d.ip}:8200/xpyd/stats")
        return {"config": name, "worker_args": extra + _kv_flags(name), "requests": len(gaps),
                "first_to_second_ms_p50": round(statistics.median(gaps), 1),
                "first_to_second_ms_mean": round(statistics.fmean(gaps), 1),
                "first_to_second_ms_max": round(max(gaps), 1),
                "ttft_ms_p50": round(data["ttft_ms"]["p50"], 1), "itl_ms_p50": round(data["itl_ms"]["p50"], 1),
                "kv_parts_streamed": pstats.get("kv_parts_streamed"), "kv_backend": dstats.get("kv_backend")}
    finally:
        stop_all(procs)
        bed.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="pull,stream", help=f"comma-separated, of {sorted(CONFIGS)}")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--num-requests", type=int, default=12)
    p.add_argument("--chunk", type=int, default=512, help="--prefill-chunk of the prefill worker")
    p.add_argument("--rate", default="1gbit", help="tbf rate of the prefill and decode hosts' links (none: unshaped)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    reason = netbed.available()
    if reason:
        print(f"no test bed here: {reason}", file=sys.stderr)
        return 2
    Path(args.out).mkdir(parents=True, exist_ok=True)
    from xpyd.model.loader import ensure_converted

    model = str(ensure_converted(None).path)
    rows = [run_config(c, CONFIGS[c], args, model) for c in args.configs.split(",")]
    base = rows[0]["first_to_second_ms_p50"]
    for r in rows:
        r["ratio_to_first"] = round(r["first_to_second_ms_p50"] / base, 3)
    (Path(args.out) / "stream_summary.json").write_text(json.dumps({"args": vars(args), "runs": rows}, indent=2) + "\n")
    print(f"{'config':>8} {'1st->2nd p50':>13} {'mean':>8} {'max':>8} {'ratio':>6} {'TTFT p50':>9} {'ITL p50':>8}")
    for r in rows:
        print(f"{r['config']:>8} {r['first_to_second_ms_p50']:>11.0f}ms {r['first_to_second_ms_mean']:>6.0f}ms "
              f"{r['first_to_second_ms_max']:>6.0f}ms {r['ratio_to_first']:>6.2f} {r['ttft_ms_p50']:>7.0f}ms "
              f"{r['itl_ms_p50']:>6.0f}ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
