#!/usr/bin/env python3
"""lm-evaluation-harness through two or more OpenAI-compatible servers, compared item by item.

Runs ``lm_eval --model local-completions`` (token-id prompts, echo + logprobs: what an evaluation sends for
loglikelihoods) with the task ``xpyd_mc`` (bench/lm_eval/xpyd_mc: 40 four-choice questions) against each
server, then compares every server with the first: accuracy (acc, acc_norm), and each (question, choice)
loglikelihood from the logged samples (``resps``): max |diff| and how many are within --tol (1e-3).
``--hf-reference`` adds lm-eval's own ``hf`` model (transformers, float32, on this machine) as one more column.

    scripts/peers/setup_peers.sh     # once: /work/.venvs/lmeval (lm-eval[api] + transformers)
    .venv/bin/python scripts/peers/lm_eval_compare.py --model-dir DIR --served-model-name smollm2 \\
        --server vllm=http://127.0.0.1:18701 --server xpyd=http://127.0.0.1:18800 --hf-reference \\
        --output-dir /tmp/lm_eval_runs --json /tmp/lm_eval_compare.json

``--compare-only`` compares the runs already under --output-dir without sending anything. Runs from the
repository root (the task's data_files path is relative to it). Exit status 1 when a run fails, or with
--fail-on-diff when accuracy differs or a loglikelihood is beyond --tol.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASK = "xpyd_mc"
HF = "transformers"


def lm_eval_bin(arg: str | None) -> str:
    if arg:
        return arg
    return os.path.join(os.environ.get("PEERS_DIR", "/work/.venvs"), "lmeval", "bin", "lm_eval")


def parse_servers(specs: list[str]) -> list[tuple[str, str]]:
    out = []
    for i, spec in enumerate(specs):
        name, _, url = spec.partition("=") if "=" in spec.split("://", 1)[0] else (f"server{i + 1}", "", spec)
        out.append((name, url.rstrip("/")))
    if len({n for n, _ in out}) != len(out):
        raise SystemExit("server names must be distinct (NAME=URL)")
    return out


def run_lm_eval(args, name: str, url: str | None) -> tuple[int, float]:
    """One lm_eval run into OUTPUT_DIR/NAME (url None: lm-eval's hf model on this machine)."""
    out = os.path.join(args.output_dir, name)
    if url is None:
        model, model_args = "hf", f"pretrained={args.model_dir},dtype=float32"
    else:
        model = "local-completions"
        model_args = (f"model={args.served_model_name},base_url={url}/v1/completions,tokenizer={args.model_dir},"
                      "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1")
    cmd = [lm_eval_bin(args.lm_eval), "--model", model, "--model_args", model_args, "--tasks", TASK,
           "--include_path", "bench/lm_eval", "--log_samples", "--output_path", out, "--batch_size", "1"]
    if url is None:
        cmd += ["--device", "cpu"]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    os.makedirs(out, exist_ok=True)
    t0 = time.monotonic()
    with open(os.path.join(out, "lm_eval.log"), "w") as log:
        print(f"[{name}] {' '.join(cmd)}", file=sys.stderr, flush=True)
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            timeout=args.timeout).returncode
    return rc, time.monotonic() - t0


def _newest(pattern: str) -> str | None:
    files = glob.glob(pattern, recursive=True)
    return max(files, key=os.path.getmtime) if files else None


def load_run(output_dir: str, name: str) -> dict:
    """{"acc", "acc_norm", "items": {(doc_id, choice): loglikelihood}, "greedy": {...}} of the newest run."""
    base = os.path.join(output_dir, name)
    results = _newest(os.path.join(base, "**", "results_*.json"))
    samples = _newest(os.path.join(base, "**", f"samples_{TASK}_*.jsonl"))
    if results is None or samples is None:
        raise FileNotFoundError(f"no lm_eval results/samples under {base}")
    with open(results) as f:
        metrics = json.load(f)["results"][TASK]
    items, greedy, pred = {}, {}, {}
    with open(samples) as f:
        for line in f:
            s = json.loads(line)
            doc = int(s["doc_id"])
            lls = []
            for c, resp in enumerate(s["filtered_resps"]):  # [loglikelihood, is_greedy] per choice
                ll, is_greedy = resp if isinstance(resp, (list, tuple)) else (resp, None)
                items[(doc, c)] = float(ll)
                greedy[(doc, c)] = str(is_greedy) == "True"
                lls.append(float(ll))
            pred[doc] = max(range(len(lls)), key=lls.__getitem__)
    return {"acc": metrics.get("acc,none"), "acc_norm": metrics.get("acc_norm,none"), "items": items,
            "greedy": greedy, "pred": pred, "results_file": results, "samples_file": samples}


def compare_runs(base: dict, other: dict, tol: float) -> dict:
    keys = sorted(set(base["items"]) & set(other["items"]))
    diffs = [(abs(base["items"][k] - other["items"][k]), k) for k in keys]
    worst = max(diffs, default=(0.0, None))
    return {
        "items": len(keys),
        "missing": len(set(base["items"]) ^ set(other["items"])),
        "within_tol": sum(d <= tol for d, _ in diffs),
        "max_abs_diff": worst[0],
        "worst_item": None if worst[1] is None else {"doc_id": worst[1][0], "choice": worst[1][1],
                                                      "base": base["items"][worst[1]],
                                                      "other": other["items"][worst[1]]},
        "greedy_differs": sum(base["greedy"][k] != other["greedy"][k] for k in keys),
        "predictions_differ": sorted(d for d in base["pred"] if d in other["pred"] and base["pred"][d] != other["pred"][d]),
        "acc_same": base["acc"] == other["acc"],
        "acc_norm_same": base["acc_norm"] == other["acc_norm"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", action="append", default=[], metavar="NAME=URL",
                    help="a server's base URL (the first is the baseline; repeatable)")
    ap.add_argument("--model-dir", required=True, help="the HF model folder (tokenizer; --hf-reference's model)")
    ap.add_argument("--served-model-name", default="smollm2", help="the model name the servers answer to")
    ap.add_argument("--hf-reference", action="store_true", help="also run lm-eval's hf model (float32, CPU)")
    ap.add_argument("--output-dir", default="/tmp/xpyd_lm_eval", help="one lm_eval output folder per server here")
    ap.add_argument("--lm-eval", help="the lm_eval command (default: $PEERS_DIR/lmeval/bin/lm_eval)")
    ap.add_argument("--limit", type=int, help="only the first N questions (a smoke run)")
    ap.add_argument("--tol", type=float, default=1e-3, help="loglikelihood tolerance (default 1e-3)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per lm_eval run")
    ap.add_argument("--compare-only", action="store_true", help="compare the runs already in --output-dir")
    ap.add_argument("--json", help="write the comparison here")
    ap.add_argument("--fail-on-diff", action="store_true")
    args = ap.parse_args(argv)

    sys.stdout.reconfigure(line_buffering=True)
    runs = parse_servers(args.server) + ([(HF, None)] if args.hf_reference else [])
    if not runs:
        raise SystemExit("give at least one --server NAME=URL (or --hf-reference)")
    report: dict = {"task": TASK, "tol": args.tol, "limit": args.limit, "runs": {}, "comparisons": {}}
    failed = False
    for name, url in runs:
        if not args.compare_only:
            rc, secs = run_lm_eval(args, name, url)
            report["runs"][name] = {"url": url, "rc": rc, "seconds": round(secs, 1)}
            if rc != 0:
                failed = True
                print(f"[{name}] lm_eval exited {rc}: see {os.path.join(args.output_dir, name, 'lm_eval.log')}",
                      file=sys.stderr)
                continue
        try:
            run = load_run(args.output_dir, name)
        except FileNotFoundError as e:
            failed = True
            print(f"[{name}] {e}", file=sys.stderr)
            continue
        report["runs"].setdefault(name, {"url": url}).update(
            acc=run["acc"], acc_norm=run["acc_norm"], items=len(run["items"]), samples_file=run["samples_file"])
        report["runs"][name]["_run"] = run

    loaded = [n for n, _ in runs if "_run" in report["runs"].get(n, {})]
    print(f"{'server':<14} {'acc':>7} {'acc_norm':>9} {'items':>6}")
    for n in loaded:
        r = report["runs"][n]
        print(f"{n:<14} {r['acc']:>7.4f} {r['acc_norm']:>9.4f} {r['items']:>6}")
    differs = False
    if len(loaded) > 1:
        base = loaded[0]
        pairs = [(n, base) for n in loaded[1:]]
        if HF in loaded and base != HF:  # every server against the float32 reference too
            pairs += [(n, HF) for n in loaded[1:] if n != HF]
        print(f"\n{'server':<14} {'against':<14} {'acc':>5} {'acc_norm':>8} {'max |diff|':>11} "
              f"{'within ' + format(args.tol, 'g'):>12} {'greedy!=':>8} {'pred!=':>6}")
        for n, against in pairs:
            c = compare_runs(report["runs"][against]["_run"], report["runs"][n]["_run"], args.tol)
            report["comparisons"][f"{n} vs {against}"] = c
            differs |= not (c["acc_same"] and c["acc_norm_same"] and c["within_tol"] == c["items"] and not c["missing"])
            print(f"{n:<14} {against:<14} {'same' if c['acc_same'] else 'DIFF':>5} "
                  f"{'same' if c['acc_norm_same'] else 'DIFF':>8} {c['max_abs_diff']:>11.2e} "
                  f"{str(c['within_tol']) + '/' + str(c['items']):>12} {c['greedy_differs']:>8} "
                  f"{len(c['predictions_differ']):>6}")
    for n in report["runs"]:
        report["runs"][n].pop("_run", None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    return 1 if failed or (args.fail_on_diff and differs) else 0


if __name__ == "__main__":
    sys.exit(main())
