#!/usr/bin/env python3
"""Optimistic admission with preemption, measured: --requests concurrent chat requests without max_tokens
(distinct ~--prompt-tokens-token prompts, greedy, each answered up to its end of sequence or the context) through
`xpyd up` (--mode colocated, or pd: 1P1D) with --batch-size and the KV cache under test (--kv-cache-tokens,
default 16,384: the default memory of 8 x 2,048), then the same requests on a cache that holds them all
(--reference-kv-cache-tokens: nothing can be preempted there). While the requests run, the worker that decodes
is polled (/xpyd/stats every --poll seconds): how many run at once (the most, and the mean over the polls while
requests are in flight), how many wait, preemptions. Prints both runs' numbers and whether every answer of the
run under test is the reference's; writes the answers and the polls to --out.

    .venv/bin/python scripts/bench_preemption.py [--mode colocated|pd] [--requests 64] [--prompt-tokens 256] \
        [--batch-size 64] [--kv-cache-tokens 16384] [--reference-kv-cache-tokens 131072] [--out DIR] \
        [--up-args "--dtype float32"] [--skip-reference] [--instruction TEXT] [--direct]
    .venv/bin/python scripts/bench_preemption.py --openai-url http://127.0.0.1:PORT --model-name NAME --out DIR
        (the same requests to another server, e.g. vLLM CPU: scripts/peers/start_vllm.sh MODEL_DIR PORT NAME
        --max-num-seqs 64; its wall time and output tokens/s)

Starts its own cluster on free ports for each run and stops it; nothing but 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_local_prefill import _stop, _wait_for  # noqa: E402  (scripts beside this one)
from scale_sim import _free_run  # noqa: E402

WORDS = ("river", "market", "engine", "garden", "letter", "winter", "signal", "copper", "harbor", "planet", "violin",
         "ladder", "forest", "candle", "museum", "rocket", "pepper", "island", "silver", "thunder", "meadow", "bridge",
         "anchor", "castle", "dragon", "feather", "glacier", "lantern", "orchard", "pyramid", "saddle", "tunnel")


def prompts(n: int, tokens: int, tokenizer, instruction: str) -> list[list[dict]]:
    """``n`` distinct chat conversations whose templated prompts are ``tokens`` tokens at most (and within a
    word of it)."""
    def length(messages: list[dict]) -> int:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    out = []
    for i in range(n):
        rng = random.Random(i)
        words = [rng.choice(WORDS) for _ in range(tokens)]
        while True:  # (the longest that fits: one word fewer at a time)
            messages = [{"role": "user", "content": f"Notes #{i}: " + " ".join(words) +
                         "\n\n" + instruction}]
            if length(messages) <= tokens or not words:
                break
            words.pop()
        out.append(messages)
    return out


def _chat(url: str, messages: list[dict], model: str | None = None) -> tuple[str, int, str]:
    """A greedy chat request without max_tokens, streamed (bytes keep coming however long it runs): its text,
    completion tokens and finish reason."""
    from xpyd.signal.request_id import RequestId

    body = {"messages": messages, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    addr = url.removeprefix("http://")  # (a worker called directly: an id naming it as both workers, as the
    # colocated proxy's do; the proxy makes its own)
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "X-Request-Id": str(RequestId.new(addr, addr))})
    text, n, reason = "", 0, ""
    with urllib.request.urlopen(req, timeout=7200) as r:  # (a request preempted behind long answers on a slow
        # machine hears nothing for as long as they take: over 10 minutes here)
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            for c in event["choices"]:
                text += c["delta"].get("content") or ""
                reason = c.get("finish_reason") or reason
            if event.get("usage"):
                n = event["usage"]["completion_tokens"]
    return text, n, reason


def _stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/xpyd/stats", timeout=30) as r:
        return json.loads(r.read())


def run_elsewhere(args, conversations: list) -> dict:
    """The same requests to another OpenAI server (``--openai-url``, e.g. vLLM CPU started with
    scripts/peers/start_vllm.sh and ``--max-num-seqs`` = --batch-size): its wall time and output tokens/s."""
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(len(conversations)) as ex:
        answers = list(ex.map(lambda m: _chat(args.openai_url, m, args.model_name), conversations))
    wall = time.monotonic() - t0
    lens = [n for _, n, _ in answers]
    reasons = [r for _, _, r in answers]
    result = {"name": "elsewhere", "url": args.openai_url, "wall_s": round(wall, 1), "answers": len(answers),
              "output_tokens": sum(lens), "output_min": min(lens), "output_max": max(lens),
              "finish_reasons": {r: reasons.count(r) for r in set(reasons)}, "load_avg": os.getloadavg()[0],
              "output_tok_s": round(sum(lens) / wall, 1)}
    (args.out / "elsewhere.json").write_text(json.dumps({**result, "texts": [t for t, _, _ in answers],
                                                         "completion_tokens": lens}, indent=1))
    print(json.dumps(result), flush=True)
    return result


def run(args, kv_tokens: int, conversations: list, name: str, env: dict) -> dict:
    base = _free_run(30, 23000)
    worker = f"http://127.0.0.1:{base + 20}"  # the decode (or colocated) worker
    target = worker if args.direct else f"http://127.0.0.1:{base}"
    log_path = args.out / f"{name}-up.log"
    argv = [sys.executable, "-m", "xpyd", "up", "--port", str(base), "--prefill-port", str(base + 10),
            "--decode-port", str(base + 20), "--batch-size", str(args.batch_size), "--kv-cache-tokens", str(kv_tokens),
            *(["--colocated"] if args.mode == "colocated" else []), *shlex.split(args.up_args)]
    polls: list[dict] = []
    with log_path.open("wb") as log:
        up = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            _wait_for(log_path, up, "Press Ctrl-C to stop")
            done = threading.Event()

            def poll() -> None:
                t0 = time.monotonic()
                while not done.is_set():
                    s = _stats(worker)
                    polls.append({"t": round(time.monotonic() - t0, 2), **{k: s.get(k, 0) for k in (
                        "running", "waiting", "prefilling", "transferring", "preempted", "preemptions",
                        "blocks_used", "blocks_total")}})
                    if len(polls) % int(30 / args.poll) == 1:
                        print(f"{name}: {polls[-1]}", flush=True)
                    done.wait(args.poll)

            poller = threading.Thread(target=poll, daemon=True)
            t0 = time.monotonic()
            poller.start()
            with cf.ThreadPoolExecutor(len(conversations)) as ex:
                answers = list(ex.map(lambda m: _chat(target, m), conversations))
            wall = time.monotonic() - t0
            done.set()
            poller.join()
            end = _stats(worker)
        finally:
            _stop(up)
            (args.out / f"{name}-polls.json").write_text(json.dumps(polls))
    texts, lens, reasons = (list(x) for x in zip(*answers))
    busy = [p for p in polls if p["running"] + p["waiting"] + p["prefilling"] + p["transferring"] > 0]
    result = {"name": name, "kv_cache_tokens": kv_tokens, "wall_s": round(wall, 1), "answers": len(answers),
              "output_tokens": sum(lens), "output_min": min(lens), "output_max": max(lens),
              "finish_reasons": {r: reasons.count(r) for r in set(reasons)},
              "max_running": max(p["running"] for p in polls),
              "mean_running": round(sum(p["running"] for p in busy) / max(1, len(busy)), 1),
              "polls_with_32_running": sum(p["running"] >= 32 for p in busy), "polls": len(busy),
              "preemptions": end.get("preemptions"), "recomputed_tokens": end.get("recomputed_tokens"),
              "blocks_used_after": end.get("blocks_used"), "load_avg": os.getloadavg()[0],
              "output_tok_s": round(sum(lens) / wall, 1)}
    (args.out / f"{name}.json").write_text(json.dumps({**result, "texts": texts, "completion_tokens": lens,
                                                       "polls": polls}, indent=1))
    print(json.dumps(result), flush=True)
    return {**result, "texts": texts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("colocated", "pd"), default="colocated")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--kv-cache-tokens", type=int, default=16384)
    ap.add_argument("--reference-kv-cache-tokens", type=int, default=131072)
    ap.add_argument("--poll", type=float, default=0.25)
    ap.add_argument("--out", type=Path, default=Path("bench-preemption"))
    ap.add_argument("--up-args", default="", help="more `xpyd up` options, one string")
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--instruction", default="Summarize these notes in two sentences.",
                    help="what each prompt asks after its notes (how long the answers are)")
    ap.add_argument("--direct", action="store_true", help="colocated: send the requests to the worker itself, not "
                    "through the proxy (as the recorded runs did, before silent streams wrote keep-alives)")
    ap.add_argument("--openai-url", default=None, metavar="URL",
                    help="send the same requests to this OpenAI server instead (no xpyd started), e.g. vLLM CPU")
    ap.add_argument("--model-name", default=None, help="with --openai-url: the request's model (its served name)")
    args = ap.parse_args()
    if args.direct and args.mode != "colocated":
        ap.error("--direct: colocated only (a P/D request needs the proxy)")
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    from transformers import AutoTokenizer

    from xpyd.model.loader import ensure_converted

    up = shlex.split(args.up_args)
    folder = up[up.index("--model") + 1] if "--model" in up else ensure_converted(None, progress=False).path
    conversations = prompts(args.requests, args.prompt_tokens, AutoTokenizer.from_pretrained(str(folder)),
                            args.instruction)
    if args.openai_url is not None:
        run_elsewhere(args, conversations)
        return 0
    tested = run(args, args.kv_cache_tokens, conversations, f"{args.mode}-{args.kv_cache_tokens}", env)
    if args.skip_reference:
        return 0
    ref = run(args, args.reference_kv_cache_tokens, conversations, f"{args.mode}-{args.reference_kv_cache_tokens}",
              env)
    same = [a == b for a, b in zip(tested["texts"], ref["texts"])]
    print(f"answers identical to the reference's: {sum(same)} / {len(same)}"
          + ("" if all(same) else f" (differ: {[i for i, s in enumerate(same) if not s]})"))
    print(f"reference preemptions: {ref['preemptions']}")
    return 0 if all(same) and ref["preemptions"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
