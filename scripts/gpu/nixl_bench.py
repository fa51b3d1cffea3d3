"""KV of a 4,096-token prompt moved prefill -> decode through the nixl backend with both pools in GPU memory
(NIXL ``VRAM``), next to a device copy measured in the same run.

Two processes on one GPU (this one sends, a child receives), each with a Llama-3-8B-shaped KV pool (32
layers, 8 KV heads, head_dim 128, bf16, 16-token blocks: 2 MiB per block), built and registered as the
workers do it (``make_worker_backend("nixl", ...)``, ``pool_memory``: the pool goes to NIXL as VRAM, no host
staging). A 4,096-token prompt's 256 blocks (512 MiB) move, timed on the sender from ``send()`` to its token's
DONE (the receiver's READs ended and the commit round trip ran), median of ``--reps`` transfers after one
untimed warm-up (UCX's connection and CUDA IPC mappings), for two placements: both sides' blocks contiguous
(one run) and scattered (random blocks, coalesced runs). Each side calls ``progress()`` every
``progress_tick`` as a worker's engine loop does while a transfer is in flight. After each placement the
receiver hashes every dst byte against the sender's src bytes.

The baseline is a device-to-device copy of the same 512 MiB in this process (CUDA events). Rates are
printed as payload GB/s and as bytes read + written (2x payload, how the issue counts a copy).

    python scripts/gpu/nixl_bench.py [--reps 5] [--pool-blocks 512]

Needs CUDA and NIXL; exits with one line saying why otherwise, or if NIXL cannot move VRAM here (the
warm-up transfer fails). About 15 s on an H200 when UCX moves the bytes over CUDA IPC.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import queue
import statistics
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LAYERS, KV_HEADS, HEAD_DIM, ELEM, BLOCK = 32, 8, 128, 2, 16
BLOCK_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * ELEM * BLOCK  # 2 MiB
PROMPT = 4096
TIMEOUT = 60.0  # every wait on the receiver or a token

RECEIVER = textwrap.dedent("""
    import hashlib, json, sys, threading
    from types import SimpleNamespace
    import torch
    from xpyd.transfer.base import Region
    from xpyd.transfer.selection import make_worker_backend
    from xpyd.worker.kv_staging import pool_memory
    def tick(backend, stop):  # progress() every progress_tick, as a worker's engine loop does
        while not stop.wait(backend.progress_tick):
            backend.progress()
    nbytes = int(sys.argv[1])
    torch.cuda.set_device(0)
    t = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    backend = make_worker_backend("nixl", "127.0.0.1", 0, None)
    backend.register(pool_memory(SimpleNamespace(device=t.device, tensor=t, staging=None), backend))
    stop = threading.Event()
    threading.Thread(target=tick, args=(backend, stop), daemon=True).start()
    print(json.dumps({"desc": backend.descriptor.to_dict(), "memory": list(backend._memory)}), flush=True)
    flat = t.view(torch.uint8)
    tokens = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "expect":
            tokens[cmd["id"]] = backend.expect(cmd["id"], [Region(*r) for r in cmd["dst"]],
                                               secret=bytes.fromhex(cmd["secret"]))
            out = {}
        elif cmd["op"] == "state":
            tok = tokens.pop(cmd["id"])
            tok.wait(cmd["timeout"])
            out = {"state": tok.state().name, "error": tok.error}
        else:  # "hash": sha256 of the dst runs' bytes, in order
            torch.cuda.synchronize()
            h = hashlib.sha256()
            for o, n in cmd["dst"]:
                h.update(flat[o: o + n].cpu().numpy().tobytes())
            out = {"sha": h.hexdigest()}
        print(json.dumps(out), flush=True)
    stop.set()
    backend.close()
""")


def tick(backend, stop: threading.Event) -> None:
    """Call ``backend.progress()`` every ``progress_tick``, as a worker's engine loop does, until ``stop``."""
    while not stop.wait(backend.progress_tick):
        backend.progress()


def why_not() -> str | None:
    """Why this cannot run here (no CUDA, no NIXL), or None."""
    try:
        import torch
    except ImportError:
        return "needs torch with CUDA"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    from xpyd.transfer.nixl_agent import load

    try:
        load()
    except ImportError as e:
        return str(e)
    return None


def runs(blocks) -> list[tuple[int, int]]:
    """Byte runs of ``blocks`` (sorted), adjacent ones coalesced, as the workers' ``byte_ranges``."""
    out: list[list[int]] = []
    for b in sorted(blocks):
        if out and out[-1][0] + out[-1][1] == b * BLOCK_BYTES:
            out[-1][1] += BLOCK_BYTES
        else:
            out.append([b * BLOCK_BYTES, BLOCK_BYTES])
    return [(o, n) for o, n in out]


def device_copy_seconds(torch, nbytes: int, reps: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return statistics.median(times)


class Child:
    """The receiver process; every answer awaited at most ``TIMEOUT`` seconds."""

    def __init__(self, nbytes: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(nbytes)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def line(self) -> dict:
        try:
            line = self.lines.get(timeout=TIMEOUT)
        except queue.Empty:
            raise SystemExit(f"nixl_bench: the receiver answered nothing within {TIMEOUT:g}s") from None
        if not line:
            raise SystemExit(f"nixl_bench: the receiver process exited ({self.proc.poll()}); see its stderr above")
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.line()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(TIMEOUT)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            self.proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pool-blocks", type=int, default=512, help="blocks in each side's pool (2 MiB each)")
    args = ap.parse_args()
    reason = why_not()
    if reason is not None:
        raise SystemExit(f"nixl_bench: cannot run here: {reason}")
    prompt_blocks = PROMPT // BLOCK
    if args.pool_blocks < prompt_blocks or args.reps < 1:
        raise SystemExit(f"nixl_bench: --pool-blocks must be at least {prompt_blocks} and --reps at least 1")
    import torch
    from types import SimpleNamespace

    from xpyd.transfer.auth import new_secret
    from xpyd.transfer.base import BackendDescriptor, Region
    from xpyd.transfer.selection import make_worker_backend
    from xpyd.worker.kv_staging import pool_memory

    began = time.perf_counter()
    torch.cuda.set_device(0)
    nbytes = args.pool_blocks * BLOCK_BYTES
    payload = prompt_blocks * BLOCK_BYTES
    copy_s = device_copy_seconds(torch, payload, max(args.reps, 5))
    t = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    t.view(torch.uint8).copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    host = t.view(torch.uint8).cpu().numpy()  # the sender's bytes, for the receiver's check

    child = Child(nbytes)
    sender = make_worker_backend("nixl", "127.0.0.1", 0, None)
    stop = threading.Event()
    try:
        sender.register(pool_memory(SimpleNamespace(device=t.device, tensor=t, staging=None), sender))
        threading.Thread(target=tick, args=(sender, stop), daemon=True).start()
        first = child.line()
        peer, theirs = BackendDescriptor.from_dict(first["desc"]), tuple(first["memory"])
        print(f"nixl_bench: sender pool {sender._memory[0]} (device {sender._memory[1]}), receiver pool "
              f"{theirs[0]} (device {theirs[1]}); UCX_TLS={os.environ.get('UCX_TLS', '(unset: UCX picks)')}")
        rng = np.random.default_rng(0)
        placements = {
            "contiguous": [(runs(range(prompt_blocks)), runs(range(prompt_blocks)))] * (args.reps + 1),
            "scattered": [(runs(rng.choice(args.pool_blocks, prompt_blocks, replace=False).tolist()),
                           runs(rng.choice(args.pool_blocks, prompt_blocks, replace=False).tolist()))
                          for _ in range(args.reps + 1)],
        }
        rows = []
        for name, plan in placements.items():
            times = []
            for rep, (src, dst) in enumerate(plan):
                tid, secret = f"{name}-{rep}", new_secret()
                child.ask(op="expect", id=tid, dst=dst, secret=secret.hex())
                t0 = time.perf_counter()
                tok = sender.send(tid, [Region(*r) for r in src], peer, [Region(*r) for r in dst], secret=secret)
                tok.wait(TIMEOUT)
                elapsed = time.perf_counter() - t0
                theirs_state = child.ask(op="state", id=tid, timeout=TIMEOUT)
                if tok.state().name != "DONE" or theirs_state["state"] != "DONE":
                    raise SystemExit(f"nixl_bench: NIXL cannot move VRAM here: transfer {tid} is "
                                     f"{tok.state().name} on the sender ({tok.error}), {theirs_state['state']} "
                                     f"on the receiver ({theirs_state['error']})")
                if rep:  # the first of each placement is not timed
                    times.append(elapsed)
            want = hashlib.sha256()
            for o, n in src:  # (the last transfer's src bytes, in dst order)
                want.update(host[o: o + n].tobytes())
            if child.ask(op="hash", dst=dst)["sha"] != want.hexdigest():
                raise SystemExit(f"nixl_bench: WRONG BYTES: the receiver's dst of {name} differs from the src")
            label = f"nixl {sender._memory[0]}->{theirs[0]}, {name} ({len(src)} src runs)"
            rows.append((label, statistics.median(times), times))
    finally:
        stop.set()
        sender.close()
        child.close()

    gb = payload / 1e9
    print(f"\n{payload >> 20} MiB ({prompt_blocks} blocks of {BLOCK_BYTES >> 20} MiB), median of {args.reps}; "
          f"bytes verified (sha256)")
    print(f"{'path':<46} {'median ms':>10} {'payload GB/s':>13} {'r+w GB/s':>9} {'of copy':>8}")
    print(f"{'device copy (copy_, CUDA events)':<46} {copy_s * 1e3:>10.2f} {gb / copy_s:>13.1f} "
          f"{2 * gb / copy_s:>9.1f} {'100%':>8}")
    for label, median, times in rows:
        print(f"{label:<46} {median * 1e3:>10.2f} {gb / median:>13.1f} {2 * gb / median:>9.1f} "
              f"{copy_s / median:>8.0%}   (min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f} ms)")
    print(f"\n(took {time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
