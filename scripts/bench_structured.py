"""What structured output costs a decode step: the same requests with and without a JSON schema, side by side
(alternating rounds, ABAB...), on one xpyd deployment started here.

Each request streams; its decode speed is (completion tokens - 1) / (last chunk - first chunk), so outputs of
other lengths compare fairly. Both kinds generate max_tokens tokens (the schema asks for more than that; the free
requests ignore EOS). Prints the medians per kind, the ratio, and writes --json FILE.

    .venv/bin/python scripts/bench_structured.py --rounds 3 --requests 16 --concurrency 4 --json out.json
    .venv/bin/python scripts/bench_structured.py --pd ...      # 1P1D (`xpyd up`) instead of one colocated worker
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

SCHEMA = {"type": "object", "properties": {
    "fruits": {"type": "array", "items": {"type": "string"}, "minItems": 30, "maxItems": 30},
    "note": {"type": "string"}}, "required": ["fruits", "note"], "additionalProperties": False}
PROMPT = "List thirty fruits as a JSON object with a 'fruits' array and a short 'note'."


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy in {timeout:g}s")


async def _one(session: aiohttp.ClientSession, url: str, body: dict) -> float | None:
    first = last = None
    tokens = 0
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
                continue
            now = time.perf_counter()
            if any((c.get("delta") or {}).get("content") for c in event.get("choices", ())):
                first = first if first is not None else now
                last = now
    if first is None or last is None or last <= first or tokens < 3:
        return None
    return (tokens - 1) / (last - first)


async def _round(url: str, constrained: bool, requests: int, concurrency: int, max_tokens: int) -> list[float]:
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "fruits", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def go() -> float | None:
            async with sem:
                return await _one(session, url, body)
        speeds = await asyncio.gather(*(go() for _ in range(requests)))
    return [s for s in speeds if s is not None]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the packaged SmolLM2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--pd", action="store_true", help="1P1D through `xpyd up` (default: one colocated worker)")
    p.add_argument("--url", default=None, help="a running deployment instead (its served name must be 'm')")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    proc = None
    url = args.url
    if url is None:
        from xpyd.model.loader import ensure_converted

        model = args.model or str(ensure_converted(None, progress=False).path)
        port = _free_port()
        cmd = [sys.executable, "-m", "xpyd", "up", "--model", model, "--port", str(port), "--served-model-name", "m",
               "--prefill-port", str(_free_port()), "--decode-port", str(_free_port())]
        if not args.pd:
            cmd.append("--colocated")
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
    try:
        _wait(url)
        asyncio.run(_round(url, True, args.concurrency, args.concurrency, 16))  # warm-up (and the grammar engine)
        asyncio.run(_round(url, False, args.concurrency, args.concurrency, 16))
        results: dict[str, list[float]] = {"free": [], "json_schema": []}
        for r in range(args.rounds):
            for constrained in ((False, True) if r % 2 == 0 else (True, False)):
                speeds = asyncio.run(_round(url, constrained, args.requests, args.concurrency, args.max_tokens))
                results["json_schema" if constrained else "free"].append(statistics.median(speeds))
                print(f"round {r} {'json_schema' if constrained else 'free':12s} median decode "
                      f"{statistics.median(speeds):7.1f} tok/s a request ({len(speeds)} requests)", flush=True)
        free, constrained = statistics.median(results["free"]), statistics.median(results["json_schema"])
        print(f"median over rounds: free {free:.1f}, json_schema {constrained:.1f} tok/s a request; "
              f"json_schema/free = {constrained / free:.3f}")
        if args.json:
            Path(args.json).write_text(json.dumps({"rounds": results, "free": free, "json_schema": constrained,
                                                   "ratio": constrained / free, "args": vars(args)}, indent=1))
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)


if __name__ == "__main__":
    main()
