#!/usr/bin/env python3
"""SIGKILL a decode worker under greedy streams and see that every stream goes on (request migration, issue #26):
all complete, token for token what an uninterrupted run gives, and the longest pause a client sees.

Starts `xpyd up --prefill X --decode Y` through etcd (``--engine sim`` or the real model), sends ``--streams``
greedy streaming completions (each prompt its own) once uninterrupted, then the same again; when every stream of
the second round has ``--kill-after`` token chunks (or the round is ``--after`` seconds old, whichever is first),
SIGKILLs the ``--kill`` decode workers serving most streams. From the client's side of the second round:

- completed / failed, and how many of them had been on a killed worker (``x-xpyd-workers``, tied to the workers'
  processes through ``GET /cluster``);
- token-exact: each stream's text against the uninterrupted round's (greedy: the same tokens);
- the longest pause each stream saw (the largest gap between its chunks), on killed workers and the others;
- the proxy's ``xpyd_proxy_migrations_total``.

    .venv/bin/python scripts/migration_kill.py --prefill 2 --decode 2 --streams 16 --model-engine real --json OUT
    .venv/bin/python scripts/migration_kill.py --prefill 16 --decode 48 --streams 1000 --kill 1 --json OUT

Every process is a child of this one and stops with it; nothing but 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_kill import _cluster, _decode_up, _percentile, _port_of  # noqa: E402  (scripts beside this one)
from scale_sim import _kind, _tree, emit, start_up, stop, up_command  # noqa: E402

WORDS = ("river", "mountain", "city", "garden", "window", "music", "paper", "engine", "forest", "ocean", "market",
         "bridge", "winter", "letter", "signal", "harbor")


def prompt(i: int, words: int) -> str:
    return f"Story {i}: " + " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(words))


class Stream:
    def __init__(self, i: int) -> None:
        self.i = i
        self.text: list[str] = []
        self.chunk_times: list[float] = []
        self.decode: str | None = None  # its first decode worker's name
        self.error: str | None = None
        self.done = False


async def one(session: aiohttp.ClientSession, url: str, s: Stream, body: dict) -> None:
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                s.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return
            workers = dict(p.split("=") for p in r.headers.get("x-xpyd-workers", "").replace(" ", "").split(",") if p)
            s.decode = workers.get("decode")
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    s.done = True
                    break
                ev = json.loads(data)
                if "error" in ev:
                    s.error = ev["error"].get("message", "error")[:200]
                    return
                for c in ev.get("choices") or ():
                    s.text.append(c.get("text") or "")
                    s.chunk_times.append(time.monotonic())
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        s.error = f"{type(e).__name__}: {e}"


async def round_(url: str, n: int, body: dict, words: int, on_progress=None) -> list[Stream]:
    streams = [Stream(i) for i in range(n)]
    timeout = aiohttp.ClientTimeout(total=1800, sock_read=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(one(session, url, s, {**body, "prompt": prompt(s.i, words)})) for s in streams]
        if on_progress is not None:
            tasks.append(asyncio.create_task(on_progress(streams)))
        await asyncio.gather(*tasks)
    return streams


def decode_pids(up_pid: int) -> dict[int, int]:
    pids = {}
    for pid in _tree(up_pid):
        try:
            if _kind(pid) == "decode":
                pids[_port_of(pid)] = pid
        except OSError:
            continue
    return pids


def migrations(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("xpyd_proxy_migrations_total "):
                return float(line.split()[1])
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--kill", type=int, default=1, help="decode workers to SIGKILL (those serving most streams)")
    ap.add_argument("--kill-after", type=int, default=8, help="token chunks every stream has before the kill")
    ap.add_argument("--after", type=float, default=120.0, help="kill at the latest this long into the round")
    ap.add_argument("--model-engine", choices=("sim", "real"), default="sim")
    ap.add_argument("--speedup", default="1", help="sim: --sim-speedup")
    ap.add_argument("--kv-token-bytes", type=int, default=2048,
                    help="sim: --sim-kv-token-bytes (the model's own size makes 64 workers' pools outgrow the memory)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--prompt-words", type=int, default=60)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="float32", help="real: the model's dtype")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    x, y = args.prefill, args.decode
    work = Path(tempfile.mkdtemp(prefix="xpyd-migration-"))
    log = work / "up.log"
    engine = (["--engine", "sim", "--sim-speedup", args.speedup, "--sim-kv-token-bytes", str(args.kv_token_bytes)]
              if args.model_engine == "sim" else ["--dtype", args.dtype])
    cmd, url = up_command(x, y, args.streams, *engine, "--batch-size", str(args.batch_size), "--expose-worker-names")
    env = {**os.environ, "XPYD_CLUSTER_TOKEN": secrets.token_hex(16)}
    body = {"model": "m", "max_tokens": args.output_len, "temperature": 0, "ignore_eos": True, "stream": True}
    result: dict = {k: getattr(args, k) for k in ("prefill", "decode", "streams", "kill", "kill_after", "model_engine",
                                                  "speedup", "kv_token_bytes", "batch_size", "prompt_words",
                                                  "output_len")}
    started = time.monotonic()
    up = start_up(cmd, log, env, timeout=900)
    try:
        while _decode_up(url) < y:
            time.sleep(0.2)
        result["ready_s"] = round(time.monotonic() - started, 1)
        baseline = asyncio.run(round_(url, args.streams, body, args.prompt_words))
        result["baseline_failed"] = sum(1 for s in baseline if s.error or not s.done)
        before = migrations(url)
        killed: dict = {}

        async def kill_when_ready(streams: list[Stream]) -> None:
            t0 = time.monotonic()
            while time.monotonic() - t0 < args.after:
                if all(len(s.chunk_times) >= args.kill_after or s.done or s.error for s in streams):
                    break
                await asyncio.sleep(0.05)
            serving = Counter(s.decode for s in streams if s.decode and not s.done and not s.error)
            names = {w["name"]: w for w in _cluster(url) if w.get("role") == "decode"}
            pids = decode_pids(up.pid)
            victims = [name for name, _ in serving.most_common(args.kill)]
            killed["at"] = time.monotonic()
            for name in victims:
                port_ = int(names[name]["http_url"].rsplit(":", 1)[1].split("/")[0])
                os.kill(pids[port_], signal.SIGKILL)
            killed["names"] = victims
            killed["in_flight_on_them"] = sum(serving[v] for v in victims)

        streams = asyncio.run(round_(url, args.streams, body, args.prompt_words, kill_when_ready))
        t_kill = killed["at"]
        on_killed = [s for s in streams if s.decode in killed["names"]]
        others = [s for s in streams if s not in on_killed]

        def pause(s: Stream) -> float:
            return max((b - a for a, b in zip(s.chunk_times, s.chunk_times[1:])), default=0.0)

        def across(s: Stream) -> float:  # the gap that spans the kill
            return max((b - a for a, b in zip(s.chunk_times, s.chunk_times[1:]) if a <= t_kill < b), default=0.0)

        expected = {s.i: "".join(s.text) for s in baseline}
        result.update(
            killed=killed["names"], streams_on_killed=len(on_killed), in_flight_on_killed=killed["in_flight_on_them"],
            completed=sum(1 for s in streams if s.done and not s.error),
            failed=sum(1 for s in streams if s.error or not s.done),
            errors=Counter(s.error for s in streams if s.error).most_common(5),
            token_exact=sum(1 for s in streams if s.done and "".join(s.text) == expected[s.i]),
            killed_token_exact=sum(1 for s in on_killed if s.done and "".join(s.text) == expected[s.i]),
            longest_pause_killed_s=round(max((pause(s) for s in on_killed), default=0.0), 3),
            pause_across_kill_killed_s={"p50": _percentile([across(s) for s in on_killed], 50),
                                        "max": max((across(s) for s in on_killed), default=None)},
            longest_pause_others_s=round(max((pause(s) for s in others), default=0.0), 3),
            migrations=migrations(url) - before,
        )
    finally:
        stop(up)
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
