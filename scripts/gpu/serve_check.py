"""`xpyd up --device cuda` on one GPU, served through the proxy and checked as a client sees it (issue #28).

    python3 scripts/gpu/serve_check.py exact --model SMALL_DIR [--kv-backend cuda_ipc] [--out DIR]
    python3 scripts/gpu/serve_check.py bench --model BIG_DIR [--kv-backend cuda_ipc] [--out DIR]

exact: 1P1D (both workers on the one GPU, --gpu-memory-utilization 0.2 each), float32, seeded random weights
(--load-format dummy); greedy completions of token-id prompts must equal transformers' greedy tokens on the
same GPU (decoded with the same tokenizer), and seeded sampling must equal the colocated worker's, which
then serves the same requests. bench: 1P1D bf16 on the 8B shape (0.45 each): `xpyd bench` at concurrency 1
and 16 and the prefill-stall workload, and the gap between the first and second token of a 4,096-token
prompt against the decode step time, then the same benches on one colocated worker.
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

PORT = 8000


def up(model: str, dtype: str, extra: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "xpyd", "up", "--device", "cuda", "--model", model, "--dtype", dtype,
           "--load-format", "dummy", "--port", str(PORT), "--startup-timeout", "600", *extra]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"xpyd up exited {proc.returncode}: see {log}\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models", timeout=2) as r:
                if r.status == 200:
                    print(f"up after {600 - (deadline - time.monotonic()):.0f}s", flush=True)
                    return proc
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit("xpyd up did not get ready in 600 s")


def down(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def complete(body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def served_model() -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def exact(args) -> int:
    import torch
    from transformers import AutoConfig, AutoTokenizer

    sys.path.insert(0, str(Path(__file__).parent))
    from exactness import prompts, reference

    from xpyd.model.dummy_weights import dummy_model

    out = Path(args.out)
    config = AutoConfig.from_pretrained(args.model)
    tok = AutoTokenizer.from_pretrained(args.model)
    all_ids = prompts(6, config.vocab_size)
    new = 32
    model = dummy_model(config, torch.float32, "cuda")
    ref_text = []
    for ids in all_ids:
        ref, _ = reference(model, ids, new, "cuda")
        ref_text.append(tok.decode(ref, skip_special_tokens=True))
    del model
    torch.cuda.empty_cache()
    sampled = [{"prompt": ids, "max_tokens": new, "temperature": 0.8, "top_p": 0.95, "seed": 11 + i,
                "ignore_eos": True} for i, ids in enumerate(all_ids)]
    results = {}
    for mode, extra in (("pd", ["--prefill", "1", "--decode", "1", "--kv-backend", args.kv_backend,
                                "--gpu-memory-utilization", "0.2", "--batch-size", "8", "--max-model-len", "1024"]),
                        ("colocated", ["--colocated", "--gpu-memory-utilization", "0.2", "--batch-size", "8",
                                       "--max-model-len", "1024"])):
        proc = up(args.model, "float32", extra, out / f"up-{mode}.log")
        try:
            name = served_model()
            greedy = [complete({"model": name, "prompt": ids, "max_tokens": new, "temperature": 0,
                                "ignore_eos": True})["choices"][0]["text"] for ids in all_ids]
            seeded = [complete({"model": name, **b})["choices"][0]["text"] for b in sampled]
        finally:
            down(proc)
        results[mode] = {"greedy": greedy, "seeded": seeded}
        same = sum(a == b for a, b in zip(greedy, ref_text))
        print(f"{mode}: greedy equal to transformers on the GPU for {same}/{len(all_ids)} prompts", flush=True)
    pd_vs_col = sum(a == b for a, b in zip(results["pd"]["seeded"], results["colocated"]["seeded"]))
    g_pd_col = sum(a == b for a, b in zip(results["pd"]["greedy"], results["colocated"]["greedy"]))
    print(f"P/D vs colocated: greedy {g_pd_col}/6 equal, seeded sampling {pd_vs_col}/6 equal", flush=True)
    (out / "exact.json").write_text(json.dumps({"reference": ref_text, **results}, indent=1))
    ok = all(a == b for a, b in zip(results["pd"]["greedy"], ref_text)) and pd_vs_col == 6 and g_pd_col == 6
    return 0 if ok else 1


def bench_runs(out: Path, tag: str, tokenizer: str) -> dict:
    base = [sys.executable, "-m", "xpyd", "bench", "--url", f"http://127.0.0.1:{PORT}", "--tokenizer", tokenizer,
            "--no-progress"]
    runs = {
        "c1": ["--num-requests", "16", "--concurrency", "1", "--input-len", "1024", "--output-len", "128"],
        "c16": ["--num-requests", "96", "--concurrency", "16", "--input-len", "1024", "--output-len", "128"],
        "stall": ["--workload", "prefill-stall", "--num-requests", "64", "--duration", "40"],
    }
    summary = {}
    for name, opts in runs.items():
        path = out / f"bench-{tag}-{name}.json"
        subprocess.run([*base, *opts, "--warmup", "2", "--json", str(path)], check=True, timeout=300)
        summary[name] = json.loads(path.read_text())
    return summary


def first_gap(name: str, prompt_len: int = 4096, rounds: int = 4) -> dict:
    """The first -> second token gap of a ``prompt_len``-token prompt, from whole responses: the latency of
    max_tokens=2 minus that of max_tokens=1 (medians over ``rounds`` fresh prompts each, so no prefix-cache
    hits). Stream chunks cannot say it: the output processor holds back tokens that end inside a UTF-8
    character, which random weights produce often, so a chunk may carry several tokens."""
    import random
    import statistics

    rng = random.Random(5)
    times: dict[int, list[float]] = {1: [], 2: [], 34: []}
    for _ in range(rounds):
        for new in (1, 2, 34):
            body = {"model": name, "prompt": [rng.randrange(100, 30000) for _ in range(prompt_len)],
                    "max_tokens": new, "temperature": 0, "ignore_eos": True}
            t0 = time.perf_counter()
            complete(body)
            times[new].append(time.perf_counter() - t0)
    one, two = statistics.median(times[1]), statistics.median(times[2])
    step = (statistics.median(times[34]) - two) / 32  # a decode step of this stream alone (tokens 3..34)
    return {"prompt_len": prompt_len, "latency_1_token_s": one, "latency_2_tokens_s": two, "first_gap_s": two - one,
            "decode_step_s": step, "all_s": times}


def bench(args) -> int:
    out = Path(args.out)
    report = {}
    for mode, extra in (("pd", ["--prefill", "1", "--decode", "1", "--kv-backend", args.kv_backend,
                                "--gpu-memory-utilization", "0.45", "--batch-size", "64",
                                "--max-model-len", "8192", "--prefill-chunk", "4096"]),
                        ("colocated", ["--colocated", "--gpu-memory-utilization", "0.9", "--batch-size", "64",
                                       "--max-model-len", "8192"])):
        if args.only and mode != args.only:
            continue
        proc = up(args.model, "bfloat16", extra, out / f"up-bench-{mode}.log")
        try:
            name = served_model()
            complete({"model": name, "prompt": [7] * 4096, "max_tokens": 2, "ignore_eos": True})  # (warm-up)
            gap = first_gap(name)
            print(f"{mode}: first->second token of a 4096-token prompt {gap['first_gap_s'] * 1e3:.1f} ms "
                  f"(latency {gap['latency_1_token_s'] * 1e3:.1f} ms for 1 token), "
                  f"{gap['first_gap_s'] / gap['decode_step_s']:.2f} decode steps of "
                  f"{gap['decode_step_s'] * 1e3:.2f} ms (tokens 3..34 of the same prompts)", flush=True)
            report[mode] = {"first_gap": gap}
            if args.gap_only:
                continue
            report[mode]["bench"] = bench_runs(out, mode, args.model)
            c1 = report[mode]["bench"]["c1"]["tpot_ms"]["p50"]
            print(f"{mode}: the same gap is {gap['first_gap_s'] * 1e3 / c1:.2f} decode steps of {c1:.2f} ms "
                  "(TPOT p50 at concurrency 1)", flush=True)
        finally:
            down(proc)
    (out / "bench-summary.json").write_text(json.dumps(report, indent=1, default=str))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("exact", "bench"))
    p.add_argument("--model", required=True)
    p.add_argument("--kv-backend", default="cuda_ipc")
    p.add_argument("--only", choices=("pd", "colocated"), default=None)
    p.add_argument("--gap-only", action="store_true", help="bench: the first -> second token gap alone")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/serve-check"))
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return exact(args) if args.what == "exact" else bench(args)


if __name__ == "__main__":
    sys.exit(main())
