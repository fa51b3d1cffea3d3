"""The cuda_ipc receiver's copy of many runs at once: one Triton launch over a table of pieces.

A transfer's pieces (``(src offset in the peer's pool, dst offset in ours, bytes)``, one per overlap of a
source run and a destination run) are many when the pools are scattered: 242 for a 4,096-token prompt in
2 MiB blocks picked at random. One ``copy_`` each costs a launch and ~15-20 us of Python and driver time,
far more than the 2 MiB takes to move, so the device sits idle between them. Here instead one launch
copies them all, with one of three launch geometries (``VARIANTS``; ``copy_runs(..., variant=)``):

- ``tiles`` (the default): the pieces cut into rows of at most ``sub`` bytes (1 MiB), a 2-D grid
  ``(tiles per row, rows)``; each program copies one ``tile`` (32 KiB) of its row in one step, unmasked
  unless it is the row's last, partial tile (programs past a row's end return at once). The table is
  small (one row per MiB) and each program reads its row once;
- ``flat``: the pieces cut into rows of one ``tile`` each, a 1-D grid, one program per row, one step;
- ``loop``: rows of ``chunk`` bytes (256 KiB), one program per row looping in ``block`` (16 KiB) steps.

``piece_table`` pairs a transfer's src and dst runs into its pieces (numpy; ``batches`` groups them).
Every variant: ``chunk_table`` cuts pieces into rows on the host (numpy: a few vector operations however
many pieces); ``word_bytes`` picks the widest word (8, 4, 2 or 1 bytes) dividing every offset, length and
both tensors' addresses, and ``vector`` whether they are 16-byte aligned too (then each thread moves 16
bytes per load and store). ``Runs`` (one per receiver) keeps between launches
the word views of both pools; ``Runs.prepare`` makes a transfer's table and uploads it ahead of time (while
the sender's forward still runs), leaving the launch alone (``Launch``) for when the source is ready.

No host synchronisation: the caller fences (``CudaOps.copy`` synchronises its stream once per batch).
``copy_runs_foreach`` is the same copy through ``torch._foreach_copy_`` (multi-tensor apply: a few
launches for hundreds of runs) for a device without Triton. On a CPU the kernel runs only under Triton's
interpreter (``TRITON_INTERPRET=1``), which is what the unit tests use; ``why_unavailable`` says why it
cannot run. Triton is imported when a kernel is first built, never at import.
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from functools import lru_cache
from typing import Iterator, Protocol, Sequence

import numpy as np

VARIANTS = ("tiles", "flat", "loop")
DEFAULT_VARIANT = "tiles"
TILE_BYTES = 32 << 10  # tiles, flat: bytes per program, one step (8 warps: 128 bytes, 8 x 16-byte vectors, a thread)
SUB_BYTES = 1 << 20  # tiles: bytes per table row (32 tiles); 512 MiB: 512 rows, 16,384 programs
CHUNK_BYTES = 256 << 10  # loop: bytes per program: 2,048 programs for 512 MiB
BLOCK_BYTES = 16 << 10  # loop: bytes per step of a program (8 warps: 64 bytes, 4 x 16-byte vectors, per thread)
NUM_WARPS = 8
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension (tiles: rows per launch)

Piece = tuple[int, int, int]
FEW_RUNS = 16  # src + dst runs up to which ``piece_table`` walks them in Python


class Run(Protocol):
    """A run of bytes in a pool (``transfer.base.Region``)."""

    offset: int
    length: int


def piece_table(src: Sequence[Run], dst: Sequence[Run]) -> np.ndarray:
    """``[n, 3]`` int64, one row ``(src offset, dst offset, bytes)`` per overlap of a src run and a dst run
    (equal totals), in order: numpy over the runs' cumulative ends (tens of microseconds for hundreds of
    runs, where a Python walk took hundreds); a few runs are walked in Python (numpy's call overhead)."""
    if len(src) + len(dst) <= FEW_RUNS:
        return np.array(list(_walk(src, dst)), dtype=np.int64).reshape(-1, 3)
    s_off = np.array([r.offset for r in src], dtype=np.int64)
    d_off = np.array([r.offset for r in dst], dtype=np.int64)
    s_end = np.cumsum(np.array([r.length for r in src], dtype=np.int64))
    d_end = np.cumsum(np.array([r.length for r in dst], dtype=np.int64))
    ends = np.sort(np.concatenate((s_end, d_end)))  # both strictly increasing: drop the ends they share
    ends = ends[np.concatenate(((True,), ends[1:] != ends[:-1]))]
    starts = np.concatenate(((0,), ends[:-1]))
    si = np.searchsorted(s_end, starts, side="right")  # the runs each piece starts in
    di = np.searchsorted(d_end, starts, side="right")
    s_start, d_start = np.concatenate(((0,), s_end[:-1])), np.concatenate(((0,), d_end[:-1]))
    out = np.empty((len(ends), 3), dtype=np.int64)
    out[:, 0] = s_off[si] + starts - s_start[si]
    out[:, 1] = d_off[di] + starts - d_start[di]
    out[:, 2] = ends - starts
    return out


def _walk(src: Sequence[Run], dst: Sequence[Run]) -> Iterator[Piece]:
    si = di = s_off = d_off = 0
    while si < len(src):
        s, d = src[si], dst[di]
        n = min(s.length - s_off, d.length - d_off)
        yield s.offset + s_off, d.offset + d_off, n
        s_off += n
        d_off += n
        if s_off == s.length:
            si, s_off = si + 1, 0
        if d_off == d.length:
            di, d_off = di + 1, 0


def pieces(src: Sequence[Run], dst: Sequence[Run]) -> Iterator[Piece]:
    """Walk both region lists (equal totals) in step: one piece per overlap of a src run and a dst run."""
    return map(tuple, piece_table(src, dst).tolist())


def batches(src: Sequence[Run], dst: Sequence[Run], limit: int) -> Iterator[np.ndarray]:
    """The pieces (``piece_table`` rows) grouped, whole, into batches of at least ``limit`` bytes (the last
    may hold fewer)."""
    table = piece_table(src, dst)
    if len(table) == 1:  # (one piece, the contiguous case: no numpy calls)
        yield table
        return
    ends = np.cumsum(table[:, 2])
    first, base = 0, 0
    while first < len(table):
        last = min(int(np.searchsorted(ends, base + limit, side="left")), len(table) - 1)
        yield table[first: last + 1]
        first, base = last + 1, int(ends[last])


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


def _power_of_two(name: str, v: int) -> None:
    if type(v) is not int or v < 8 or v & (v - 1):
        raise ValueError(f"{name} must be a power of two >= 8, got {v!r}")


class Launch:
    """One prepared copy (``Runs.prepare``): the table checked and on the device, the word views made; calling
    it launches the kernel on the current stream (the host work left for when the source is ready)."""

    __slots__ = ("runs", "src", "dst", "rows", "n", "w", "vec", "across", "table")

    def __init__(self, runs: "Runs", src, dst, rows, table: np.ndarray, w: int, vec: int) -> None:
        self.runs, self.src, self.dst, self.rows, self.table = runs, src, dst, rows, table
        self.n, self.w, self.vec = table.shape[1], w, vec
        self.across = -(-int(table[2].max()) // runs.tile) if self.n else 0

    def __call__(self) -> int:
        """Launch on the current stream, without waiting; the number of programs launched."""
        r, s, d, rows, n, w, vec = self.runs, self.src, self.dst, self.rows, self.n, self.w, self.vec
        interpret = _interpreting() or d.device.type == "cpu"
        if r.variant == "loop":
            _kernel("chunks", interpret)[(n,)](s, d, rows, CHUNK=r.chunk // w, BLOCK=r.block // w, VEC=vec,
                                               num_warps=NUM_WARPS)
            return n
        if r.variant == "flat":
            _kernel("tiles", interpret)[(n, 1)](s, d, rows, TILE=r.tile // w, VEC=vec, FLAT=True, num_warps=NUM_WARPS)
            return n
        kernel, programs = _kernel("tiles", interpret), 0
        for at in range(0, n, MAX_GRID_Y):
            m = min(MAX_GRID_Y, n - at)
            kernel[(self.across, m)](s, d, rows[at:], TILE=r.tile // w, VEC=vec, FLAT=False, num_warps=NUM_WARPS)
            programs += self.across * m
        return programs


class Runs:
    """``copy_runs`` with one launch geometry (``variant``, one of ``VARIANTS``), keeping the pools' word views
    between launches (a receiver's pools stay the same, so the per-transfer host work is the table and the
    launch). ``prepare`` does the table (checked, cut into rows, uploaded to the device on the current stream)
    ahead of time, so that what is left once the source is ready is the launch alone. Thread-safe: a
    receiver's reader threads (one per sending worker) share it; each prepared launch has a table of its own."""

    def __init__(self, variant: str = DEFAULT_VARIANT, *, tile: int = TILE_BYTES, sub: int = SUB_BYTES,
                 chunk: int = CHUNK_BYTES, block: int = BLOCK_BYTES) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        for name, v in (("tile", tile), ("sub", sub), ("chunk", chunk), ("block", block)):
            _power_of_two(name, v)
        if sub % tile or chunk % block:
            raise ValueError(f"tile must divide sub and block chunk, got {tile=}, {sub=}, {block=}, {chunk=}")
        self.variant, self.tile, self.sub, self.chunk, self.block = variant, tile, sub, chunk, block
        self.__name__ = f"copy_runs[{variant}]"
        self._views: dict[tuple[int, int], tuple] = {}  # (id(pool), word bytes) -> (weakref, view)
        self._lock = threading.Lock()  # the views

    def rows(self, pieces: Sequence[Piece]) -> np.ndarray:
        """The table ``[3, n]`` this variant launches over (``chunk_table`` at its row size)."""
        return chunk_table(pieces, {"tiles": self.sub, "flat": self.tile, "loop": self.chunk}[self.variant])

    def prepare(self, dst, src, pieces: Sequence[Piece]) -> Launch:
        """Everything the copy of each piece ``src[s:s+n] -> dst[d:d+n]`` (flat uint8 tensors on one device)
        needs but the launch: its table on the device (uploaded on the current stream, which the launch must
        use too, or follow)."""
        import torch

        table = self.rows(pieces)
        _check(dst, src, table)
        w = word_bytes(table, dst.data_ptr(), src.data_ptr())
        vec = 16 // w if w == 8 and vector(table, dst.data_ptr(), src.data_ptr()) else 1
        words = np.ascontiguousarray(table.T // w)  # [n, 3] row-major: a program reads its row's 24 bytes
        rows = torch.from_numpy(words)
        if dst.device.type == "cuda":
            rows = rows.to(dst.device, non_blocking=True)  # (pageable: staged before this returns)
        with self._lock:
            s, d = self._words(torch, src, w), self._words(torch, dst, w)
        return Launch(self, s, d, rows, table, w, vec)

    def __call__(self, dst, src, pieces: Sequence[Piece]) -> int:
        """Copy each piece ``src[s:s+n] -> dst[d:d+n]`` (flat uint8 tensors on one device) on the current
        stream, without waiting for it; the number of programs launched."""
        return self.prepare(dst, src, pieces)()

    def _words(self, torch, t, w: int):
        """``t``'s word view, made once per pool tensor (by identity): an entry lives only as long as its
        tensor (a view holds the memory, and a peer's pool, opened from its handle, must be let go when
        its connection drops it)."""
        for key in [k for k, (ref, _) in self._views.items() if ref() is None]:
            del self._views[key]
        entry = self._views.get((id(t), w))
        if entry is None or entry[0]() is not t:
            entry = self._views[(id(t), w)] = (weakref.ref(t), _words(t, w, getattr(torch, _DTYPES[w])))
        return entry[1]


def copy_runs(dst, src, pieces: Sequence[Piece], variant: str = DEFAULT_VARIANT, **geometry) -> int:
    """Copy each piece ``src[s:s+n] -> dst[d:d+n]`` (flat uint8 tensors on one device) in one launch, on the
    current stream, without waiting for it; the number of programs launched. ``geometry``: ``Runs``'
    sizes (bytes: ``tile``, ``sub``, ``chunk``, ``block``; powers of two >= 8). A receiver keeps a ``Runs``."""
    return Runs(variant, **geometry)(dst, src, pieces)


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


@lru_cache(maxsize=4)
def _kernel(name: str, interpret: bool):
    """The kernel ``name`` ("tiles" or "chunks"), compiled for the GPU or wrapped for the interpreter:
    Triton picks the mode when a function is decorated, so it is decorated here, once per mode. ``table``
    holds one row ``(src, dst, length)`` in words per table row (``chunk_table``), row-major."""
    import triton
    import triton.language as tl

    def copy_tiles(src, dst, table, TILE: tl.constexpr, VEC: tl.constexpr, FLAT: tl.constexpr):
        if FLAT:  # one tile per row, rows along the grid's x
            row, start = tl.program_id(0), 0
        else:  # x: the tile within the row, y: the row
            row, start = tl.program_id(1), tl.program_id(0) * TILE
        row = row.to(tl.int64) * 3
        s = tl.load(table + row)  # the row's three loads together: one memory latency, not two in a row
        d = tl.load(table + row + 1)
        length = tl.load(table + row + 2)
        if start < length:
            s = tl.multiple_of(s, VEC)
            d = tl.multiple_of(d, VEC)
            offs = start + tl.arange(0, TILE)
            if start + TILE <= length:  # a whole tile: no mask
                tl.store(dst + d + offs, tl.load(src + s + offs))
            else:
                mask = offs < tl.multiple_of(length, VEC)
                tl.store(dst + d + offs, tl.load(src + s + offs, mask=mask), mask=mask)

    def copy_chunks(src, dst, table, CHUNK: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * 3
        s = tl.multiple_of(tl.load(table + row), VEC)
        d = tl.multiple_of(tl.load(table + row + 1), VEC)
        length = tl.multiple_of(tl.load(table + row + 2), VEC)
        offs = tl.arange(0, BLOCK)
        for start in range(0, CHUNK, BLOCK):
            idx = start + offs
            mask = idx < length
            tl.store(dst + d + idx, tl.load(src + s + idx, mask=mask), mask=mask)

    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = interpret
        return triton.jit({"tiles": copy_tiles, "chunks": copy_chunks}[name])
