"""The cuda_ipc receiver's copy of many runs at once: one Triton launch over a table of chunks.

A transfer's pieces (``(src offset in the peer's pool, dst offset in ours, bytes)``, one per overlap of a
source run and a destination run) are many when the pools are scattered: 242 for a 4,096-token prompt in
2 MiB blocks picked at random. One ``copy_`` each costs a launch and ~15-20 us of Python and driver time,
far more than the 2 MiB takes to move, so the device sits idle between them. Here instead:

- ``chunk_table(pieces, chunk)`` cuts every piece into chunks of at most ``chunk`` bytes (host, numpy: a
  few vector operations however many pieces) and returns one int64 table ``[3, n]`` (src, dst, length);
- ``word_bytes`` picks the widest word (8, 4, 2 or 1 bytes) that divides every offset, length and both
  tensors' addresses, and ``vector`` whether they are 16-byte aligned too (then each thread moves 16 bytes
  per load and store);
- ``copy_runs(dst, src, pieces)`` sends the table to the device in one copy (on the current stream, from
  pinned memory: a copy from pageable memory would first wait for the stream on the host) and launches one
  kernel, one program per chunk, that copies its chunk in ``BLOCK_BYTES`` steps.

No host synchronisation: the caller fences (``CudaOps.copy`` synchronises its stream once per batch).
``copy_runs_foreach`` is the same copy through ``torch._foreach_copy_`` (multi-tensor apply: a few
launches for hundreds of runs) for a device without Triton. On a CPU the kernel runs only under Triton's
interpreter (``TRITON_INTERPRET=1``), which is what the unit tests use; ``why_unavailable`` says why it
cannot run. Triton is imported when the kernel is first built, never at import.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache
from typing import Sequence

import numpy as np

CHUNK_BYTES = 256 << 10  # bytes per program: 2,048 programs for 512 MiB, several waves on an H200's 132 SMs
BLOCK_BYTES = 16 << 10  # bytes per step of a program (8 warps: 64 bytes, 4 x 16-byte vectors, per thread)
NUM_WARPS = 8

Piece = tuple[int, int, int]


def chunk_table(pieces: Sequence[Piece], chunk: int = CHUNK_BYTES) -> np.ndarray:
    """``[3, n]`` int64: the src offset, dst offset and length (bytes) of each chunk of at most ``chunk``
    bytes, pieces in order, each piece's chunks in order (the last one of a piece may be shorter)."""
    if chunk <= 0:
        raise ValueError(f"chunk must be > 0, got {chunk}")
    p = np.asarray(pieces, dtype=np.int64).reshape(-1, 3)
    if (p[:, 2] <= 0).any() or (p[:, :2] < 0).any():
        raise ValueError("pieces need offsets >= 0 and lengths > 0")
    counts = -(-p[:, 2] // chunk)
    which = np.repeat(np.arange(len(p)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    start = (np.arange(int(counts.sum()), dtype=np.int64) - first) * chunk
    return np.stack([p[which, 0] + start, p[which, 1] + start, np.minimum(chunk, p[which, 2] - start)])


def word_bytes(table: np.ndarray, *addresses: int) -> int:
    """The widest word, 8, 4, 2 or 1 bytes, that divides every entry of ``table`` and every address."""
    g = math.gcd(8, *(int(a) for a in addresses))
    if table.size:
        g = math.gcd(g, int(np.gcd.reduce(table, axis=None)))
    return 1 << (g.bit_length() - 1) if g else 8


def vector(table: np.ndarray, *addresses: int) -> bool:
    """True if every entry and address is a multiple of 16 (each load and store may move 16 bytes)."""
    return all(int(a) % 16 == 0 for a in addresses) and bool((table % 16 == 0).all())


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def why_unavailable(device) -> str | None:
    """None when ``copy_runs`` can run on ``device`` (a ``torch.device``); otherwise why not."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not importable ({e})"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        return None if _interpreting() else "on the CPU the copy kernel runs only under TRITON_INTERPRET=1"
    return f"Triton has no backend for device type {device.type!r} here"


_DTYPES = {8: "int64", 4: "int32", 2: "int16", 1: "uint8"}


def copy_runs(dst, src, pieces: Sequence[Piece], chunk: int = CHUNK_BYTES, block: int = BLOCK_BYTES) -> int:
    """Copy each piece ``src[s:s+n] -> dst[d:d+n]`` (flat uint8 tensors on one device) in one launch, on the
    current stream, without waiting for it; the number of chunks (programs) launched. ``chunk``: bytes per
    program, a multiple of ``block`` (bytes per step), both powers of two >= 8."""
    import torch

    if block < 8 or block & (block - 1) or chunk % block:
        raise ValueError(f"block must be a power of two >= 8 and divide chunk, got {block=}, {chunk=}")
    table = chunk_table(pieces, chunk)
    _check(dst, src, table)
    w = word_bytes(table, dst.data_ptr(), src.data_ptr())
    dtype = getattr(torch, _DTYPES[w])
    vec = 16 // w if w == 8 and vector(table, dst.data_ptr(), src.data_ptr()) else 1
    n = table.shape[1]
    words = torch.from_numpy((table // w).reshape(-1))
    if dst.device.type == "cuda":  # from pinned memory (torch's caching host allocator: reused, and not before
        words = words.pin_memory()  # this copy is done), so that the upload waits for nothing on the host
    words = words.to(dst.device, non_blocking=True)
    kernel = _kernel(_interpreting() or dst.device.type == "cpu")
    kernel[(n,)](_words(src, w, dtype), _words(dst, w, dtype), words, n, CHUNK=chunk // w,
                 BLOCK=block // w, VEC=vec, num_warps=NUM_WARPS)
    return n


def copy_runs_foreach(dst, src, pieces: Sequence[Piece]) -> int:
    """The same copy through ``torch._foreach_copy_`` (no Triton): one view pair per piece, multi-tensor
    apply launches; the number of pieces."""
    import torch

    table = np.asarray(pieces, dtype=np.int64).reshape(-1, 3).T
    _check(dst, src, table)
    w = word_bytes(table, dst.data_ptr(), src.data_ptr())
    dtype = getattr(torch, _DTYPES[w])
    sw, dw = _words(src, w, dtype), _words(dst, w, dtype)
    s, d, n = (table // w).tolist()
    torch._foreach_copy_([dw[o: o + k] for o, k in zip(d, n)], [sw[o: o + k] for o, k in zip(s, n)])
    return len(n)


def _check(dst, src, table: np.ndarray) -> None:
    import torch

    for name, t in (("dst", dst), ("src", src)):
        if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name} must be a flat contiguous uint8 tensor")
    if src.device != dst.device:
        raise ValueError(f"src on {src.device}, dst on {dst.device}: one device only")
    ends = table[:2] + table[2]
    if table.size and (int(ends[0].max()) > src.numel() or int(ends[1].max()) > dst.numel()):
        raise ValueError("a piece runs past the end of its pool")


def _words(t, w: int, dtype):
    """``t`` (flat uint8) as words of ``w`` bytes (its tail shorter than a word left out: no piece reaches it,
    since every piece's end is a multiple of ``w``)."""
    return t[: t.numel() - t.numel() % w].view(dtype)


@lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """The kernel, compiled for the GPU or wrapped for the interpreter: Triton picks the mode when a function
    is decorated, so it is decorated here, once per mode."""
    import triton
    import triton.language as tl

    def copy_chunks(src, dst, table, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr):
        pid = tl.program_id(0)
        s = tl.multiple_of(tl.load(table + pid), VEC)
        d = tl.multiple_of(tl.load(table + n + pid), VEC)
        length = tl.multiple_of(tl.load(table + 2 * n + pid), VEC)
        offs = tl.arange(0, BLOCK)
        for start in range(0, CHUNK, BLOCK):
            idx = start + offs
            mask = idx < length
            tl.store(dst + d + idx, tl.load(src + s + idx, mask=mask), mask=mask)

    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = interpret
        return triton.jit(copy_chunks)
