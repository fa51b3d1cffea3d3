"""Time the native decode attention over the paged KV pool against the slot kernel it replaced.

    PYTHONPATH=. .venv/bin/python scripts/bench_decode_attention.py [--block-sizes 8,16,32,64]
        [--contexts 256,1024,2048] [--batches 1,8,16] [--rounds 9] [--threads 2]
        [--prefetch-ab 0,8,16,32] [--old-commit 8c48144] [--wrapper]

SmolLM2-135M's attention shape (9 heads, 3 KV heads, head_dim 64) and a pool holding 30 layers. Every
request attends over `context` tokens. The paged pool is [blocks, 3, 30, 2, block_size, 64] with each
request's blocks drawn from a shuffled order (scattered, as an allocator that has run a while hands them
out); the slot pool is the old layout, [batch, context, 30, 2, 3, 64], read by the old kernel
(`decode_attention.c` at --old-commit, built here with the same flags).

One round calls the kernel once per layer, layers 0..29 in turn, as a decode step does (so a call finds
its layer's K/V in memory, not in a cache that the previous call warmed); a call's time is the round's
over 30 (after one untimed call). After 2 warm-up rounds, the rounds of all variants alternate, each
variant going first in turn, and the median per call is printed, in microseconds. Each round starts when other processes leave the cores idle (waits up to 2 min;
the rounds that ran anyway are counted at the end). Kernels are called through ctypes directly (the wrapper's argument checks are
timed apart with --wrapper).

--prefetch-ab builds the paged kernel once per software-prefetch distance (-DXPYD_PREFETCH=N, rows
ahead; 0: off) and times them side by side instead.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from xpyd.cli import _env_defaults  # noqa: E402

_env_defaults()

import torch  # noqa: E402

from xpyd.model import native  # noqa: E402

HEADS, KV_HEADS, HD, LAYERS = 9, 3, 64, 30
BF16 = torch.bfloat16
ROOT = Path(__file__).resolve().parents[1]

_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
OLD_ARGTYPES = [_P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64,
                _P, _P, _INT, _INT, _INT, _INT, _F32, _P, _INT]


def compile_kernel(folder: Path, files: dict[str, bytes], defines: list[str], name: str) -> Path:
    for file, data in files.items():
        (folder / file).write_bytes(data)
    out = folder / f"{name}.so"
    subprocess.run([native._compiler(), *native._FLAGS, *defines, str(folder / "decode_attention.c"), "-o", str(out),
                    "-lm"], check=True)
    return out


def old_kernel(folder: Path, commit: str):
    files = {f: subprocess.run(["git", "show", f"{commit}:xpyd/model/csrc/{f}"], cwd=ROOT, check=True,
                               capture_output=True).stdout for f in ("decode_attention.c", "bf16.h")}
    sub = folder / "old"
    sub.mkdir()
    lib = ctypes.CDLL(str(compile_kernel(sub, files, [], "old")))
    fn = lib.xpyd_decode_attention_bf16
    fn.argtypes, fn.restype = OLD_ARGTYPES, _INT
    return fn


def new_kernel(folder: Path, prefetch: int | None) -> native.DecodeAttention:
    if prefetch is None:
        kernel = native.load_decode_attention()
        if kernel is None:
            sys.exit(f"native decode attention unavailable: {native.unavailable_reason()}")
        return kernel
    csrc = ROOT / "xpyd" / "model" / "csrc"
    files = {f: (csrc / f).read_bytes() for f in ("decode_attention.c", "bf16.h")}
    sub = folder / f"pf{prefetch}"
    sub.mkdir()
    return native.DecodeAttention(compile_kernel(sub, files, [f"-DXPYD_PREFETCH={prefetch}"], f"pf{prefetch}"))


def step_inputs(batch: int, gen: torch.Generator):
    qkv = torch.randn(batch, HEADS + 2 * KV_HEADS, HD, generator=gen).to(BF16)
    return qkv[:, :HEADS], qkv[:, HEADS : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]


def paged_call(kernel: native.DecodeAttention, batch: int, context: int, block_size: int, gen: torch.Generator,
               wrapper: bool = False):
    per = -(-context // block_size)
    pool = torch.randn(batch * per, KV_HEADS, LAYERS, 2, block_size, HD, generator=gen).to(BF16)
    tables = torch.randperm(batch * per, generator=gen).view(batch, per).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int64)
    q, k, v = step_inputs(batch, gen)
    out = torch.empty(batch, HEADS, HD, dtype=BF16)
    threads = torch.get_num_threads()
    s = pool.stride()

    def call(layer: int) -> None:
        if wrapper:
            kernel(q, k, v, pool, layer, tables, lens, HD**-0.5, out)
            return
        rc = kernel._fn(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                        pool.data_ptr(), s[0], s[1], s[2] * layer, s[2] * layer + s[3], s[4], block_size,
                        tables.data_ptr(), tables.stride(0), lens.data_ptr(), batch, HEADS, KV_HEADS, HD, HD**-0.5,
                        out.data_ptr(), threads)
        assert rc == 0, rc

    return call


def slot_call(fn, batch: int, context: int, gen: torch.Generator):
    pool = torch.randn(batch, context, LAYERS, 2, KV_HEADS, HD, generator=gen).to(BF16)
    slots = torch.randperm(batch, generator=gen)
    lens = torch.full((batch,), context, dtype=torch.int64)
    q, k, v = step_inputs(batch, gen)
    out = torch.empty(batch, HEADS, HD, dtype=BF16)
    threads = torch.get_num_threads()
    s = pool.stride()

    def call(layer: int) -> None:
        rc = fn(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), pool.data_ptr(),
                s[0], s[1], s[2] * layer, s[2] * layer + s[3], s[4], slots.data_ptr(), lens.data_ptr(), batch,
                HEADS, KV_HEADS, HD, HD**-0.5, out.data_ptr(), threads)
        assert rc == 0, rc

    return call


def _busy_jiffies() -> tuple[int, int]:
    """(all CPUs' busy jiffies, this process's) so far."""
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    with open("/proc/self/stat") as f:
        mine = f.read().rsplit(")", 1)[1].split()
    return sum(cpu) - cpu[3] - cpu[4], int(mine[11]) + int(mine[12])


def wait_quiet(window: float = 0.1, most: float = 0.15, patience: float = 120.0) -> bool:
    """Wait (up to `patience` s) until other processes use under `most` of a core over `window` s: the
    machine's 2 cores may be shared, and a descheduled OpenMP thread stalls a whole call. False: gave up."""
    deadline = time.monotonic() + patience
    hz = os.sysconf("SC_CLK_TCK")
    while True:
        (all0, me0), t0 = _busy_jiffies(), time.monotonic()
        time.sleep(window)
        (all1, me1), t1 = _busy_jiffies(), time.monotonic()
        if ((all1 - all0) - (me1 - me0)) / hz / (t1 - t0) < most:
            return True
        if t1 > deadline:
            return False
        time.sleep(1.0)


NOISY = [0]


def race(calls: dict[str, object], rounds: int) -> dict[str, float]:
    """Median microseconds per call of each variant, rounds of all layers alternating between variants."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(rounds + 2):
        NOISY[0] += not wait_quiet()
        for name in names[r % len(names):] + names[: r % len(names)]:  # each variant first in turn
            call = calls[name]
            call(LAYERS - 1)  # untimed: threads awake (they sleep while wait_quiet waits), code warm
            t0 = time.perf_counter()
            for layer in range(LAYERS):
                call(layer)
            if r >= 2:
                times[name].append((time.perf_counter() - t0) / LAYERS * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def prefetch_ab(tmp: Path, args, block_sizes, contexts, batches, gen) -> None:
    kernels = {f"pf{d}": new_kernel(tmp, d) for d in (int(x) for x in args.prefetch_ab.split(","))}
    print("| context | batch | block | " + " | ".join(kernels) + " |")
    print("|---:|---:|---:|" + "---:|" * len(kernels))
    for context in contexts:
        for batch in batches:
            for bs in block_sizes:
                calls = {name: paged_call(k, batch, context, bs, gen) for name, k in kernels.items()}
                res = race(calls, args.rounds)
                print(f"| {context} | {batch} | {bs} | " + " | ".join(f"{res[n]:.0f}" for n in kernels) + " |",
                      flush=True)
                del calls


def old_and_new(tmp: Path, args, block_sizes, contexts, batches, gen) -> None:
    old = old_kernel(tmp, args.old_commit)
    kernel = new_kernel(tmp, None)
    cols = ["slots (old)"] + [f"bs {bs}" for bs in block_sizes] + (["bs 16 + wrapper"] if args.wrapper else [])
    print("| context | batch | " + " | ".join(cols) + " |")
    print("|---:|---:|" + "---:|" * len(cols))
    for context in contexts:
        for batch in batches:
            calls = {"slots (old)": slot_call(old, batch, context, gen)}
            for bs in block_sizes:
                calls[f"bs {bs}"] = paged_call(kernel, batch, context, bs, gen)
            if args.wrapper:
                calls["bs 16 + wrapper"] = paged_call(kernel, batch, context, 16, gen, wrapper=True)
            res = race(calls, args.rounds)
            print(f"| {context} | {batch} | " + " | ".join(f"{res[c]:.0f}" for c in cols) + " |", flush=True)
            del calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-sizes", default="8,16,32,64")
    ap.add_argument("--contexts", default="256,1024,2048")
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--old-commit", default="8c48144")
    ap.add_argument("--prefetch-ab", default="", help="software-prefetch distances to compare, e.g. 0,8,16,32")
    ap.add_argument("--wrapper", action="store_true", help="also time the Python wrapper (argument and table checks)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = ([int(x) for x in v.split(",")] for v in (args.block_sizes, args.contexts, args.batches))
    gen = torch.Generator().manual_seed(0)
    print(f"# decode attention, us per call (one layer of {LAYERS}), heads {HEADS}/{KV_HEADS}, head_dim {HD}, "
          f"{args.threads} threads, median of {args.rounds} rounds")
    with tempfile.TemporaryDirectory() as tmp:
        (prefetch_ab if args.prefetch_ab else old_and_new)(Path(tmp), args, *sizes, gen)
    if NOISY[0]:
        print(f"# {NOISY[0]} rounds ran while other processes were busy")


if __name__ == "__main__":
    main()
