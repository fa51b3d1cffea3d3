"""KV of a 4,096-token prompt moved prefill -> decode through the cuda_ipc backend, next to a device copy.

Two processes on one GPU (this one sends, a child receives), each with a Llama-3-8B-shaped KV pool
(32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks: 128 KiB of KV per token, 2 MiB per block).
A 4,096-token prompt's 256 blocks (512 MiB) move through the real backend objects (``make_backend``),
timed on the sender from ``send()`` to its token's DONE (which implies the receiver's: the bytes landed
and were fenced, and the commit round trip ran), median of ``--reps`` transfers, for two placements:
both sides' blocks contiguous (one run, one copy) and scattered (random blocks, coalesced runs).

The baseline is a plain device-to-device copy of the same 512 MiB inside this process, timed with CUDA
events in the same run. Rates are counted as the issue counts a copy: bytes read + bytes written (2x the
payload), for the copy and for the transfer alike; the payload rate (1x) is printed too.

    python scripts/gpu/transfer_bench.py [--reps 10] [--pool-blocks 1024]

CUDA only; about 20 s on an H200 (most of it the child's start).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import textwrap
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LAYERS, KV_HEADS, HEAD_DIM, ELEM, BLOCK = 32, 8, 128, 2, 16
TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * ELEM  # 131,072
BLOCK_BYTES = TOKEN_BYTES * BLOCK  # 2 MiB
PROMPT = 4096

RECEIVER = textwrap.dedent("""
    import json, sys
    import torch
    from xpyd.transfer import make_backend
    from xpyd.transfer.base import Region
    nbytes = int(sys.argv[1])
    pool = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    backend = make_backend("cuda_ipc", io_timeout=60.0)
    print(json.dumps(backend.register(pool).to_dict()), flush=True)
    tokens = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "expect":
            tokens[cmd["id"]] = backend.expect(cmd["id"], [Region(*r) for r in cmd["dst"]],
                                               secret=bytes.fromhex(cmd["secret"]))
            out = {}
        else:  # "check": the first and last bytes of each dst run, to prove the bytes landed
            tok = tokens.pop(cmd["id"])
            tok.wait(60)
            flat = pool.view(torch.uint8)
            out = {"state": tok.state().name, "error": tok.error,
                   "sample": [int(flat[o]) ^ int(flat[o + n - 1]) for o, n in cmd["dst"]]}
        print(json.dumps(out), flush=True)
    backend.close()
""")


def runs(blocks: list[int]) -> list[tuple[int, int]]:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--pool-blocks", type=int, default=1024, help="blocks in each side's pool (2 MiB each)")
    args = ap.parse_args()
    import torch

    from xpyd.transfer import make_backend
    from xpyd.transfer.auth import new_secret
    from xpyd.transfer.base import BackendDescriptor, Region
    from xpyd.transfer.cuda_ipc import pieces

    if not torch.cuda.is_available():
        raise SystemExit("transfer_bench needs a CUDA GPU")
    prompt_blocks = PROMPT // BLOCK
    if args.pool_blocks < 2 * prompt_blocks:
        raise SystemExit(f"--pool-blocks must be at least {2 * prompt_blocks}")
    nbytes = args.pool_blocks * BLOCK_BYTES
    payload = prompt_blocks * BLOCK_BYTES
    pool = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    pool.view(torch.uint8).copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda"))
    host = None  # the sender's bytes, for the receiver's check (first and last byte of each run)

    child = subprocess.Popen([sys.executable, "-c", RECEIVER, str(nbytes)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)

    def ask(**cmd) -> dict:
        child.stdin.write(json.dumps(cmd) + "\n")
        child.stdin.flush()
        line = child.stdout.readline()
        if not line:
            raise SystemExit(f"the receiver process exited ({child.poll()})")
        return json.loads(line)

    sender = make_backend("cuda_ipc", io_timeout=60.0)
    sender.register(pool)
    rng = np.random.default_rng(0)
    rows = []
    try:
        line = child.stdout.readline()
        if not line:
            raise SystemExit(f"the receiver process exited ({child.poll()})")
        peer = BackendDescriptor.from_dict(json.loads(line))
        host = pool.view(torch.uint8).cpu().numpy()
        for placement in ("contiguous", "scattered"):
            times, copies = [], 0
            for rep in range(args.reps + 1):  # the first one opens the handle: not timed
                if placement == "contiguous":
                    src, dst = runs(list(range(prompt_blocks))), runs(list(range(prompt_blocks)))
                else:
                    src = runs(rng.choice(args.pool_blocks, prompt_blocks, replace=False).tolist())
                    dst = runs(rng.choice(args.pool_blocks, prompt_blocks, replace=False).tolist())
                tid, secret = f"{placement}-{rep}", new_secret()
                ask(op="expect", id=tid, dst=dst, secret=secret.hex())
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                tok = sender.send(tid, [Region(*r) for r in src], peer, [Region(*r) for r in dst], secret=secret)
                tok.wait(60)
                elapsed = time.perf_counter() - t0
                if tok.state().name != "DONE":
                    raise SystemExit(f"transfer {tid} {tok.state().name}: {tok.error}")
                check = ask(op="check", id=tid, dst=dst)
                flat = np.concatenate([host[o: o + n] for o, n in src])
                want, at = [], 0
                for _, n in dst:
                    want.append(int(flat[at]) ^ int(flat[at + n - 1]))
                    at += n
                if check["state"] != "DONE" or check["sample"] != want:
                    raise SystemExit(f"transfer {tid}: the receiver saw {check['state']}, bytes "
                                     f"{'right' if check['sample'] == want else 'WRONG'}")
                if rep:
                    times.append(elapsed)
                copies = len(list(pieces([Region(*r) for r in src], [Region(*r) for r in dst])))
            t = statistics.median(times)
            rows.append((f"cuda_ipc, {placement} blocks ({copies} copies)", t, payload / t, 2 * payload / t))
        t = device_copy_seconds(torch, payload, args.reps)
        rows.append(("device copy, one process (copy_)", t, payload / t, 2 * payload / t))
    finally:
        sender.close()
        child.stdin.close()
        child.wait(30)

    name = torch.cuda.get_device_name()
    print(f"\n{name}: {PROMPT}-token prompt, Llama-3-8B KV shape ({TOKEN_BYTES // 1024} KiB/token), "
          f"{payload >> 20} MiB; median of {args.reps}")
    print(f"{'path':48} {'ms':>8} {'payload GB/s':>13} {'read+write GB/s':>16} {'vs copy':>8}")
    copy_rw = rows[-1][3]
    for label, t, one, rw in rows:
        print(f"{label:48} {t * 1e3:8.3f} {one / 1e9:13.1f} {rw / 1e9:16.1f} {rw / copy_rw:8.0%}")
    print("(read+write: bytes read + bytes written, 2x the payload, as a device copy's bandwidth is counted; "
          "the transfer's time is send() to DONE on the sender, control round trips included)")


if __name__ == "__main__":
    main()
