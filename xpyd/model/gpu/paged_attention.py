"""Paged decode attention and the KV store as Triton kernels, over the pool in place.

The pool is `[num_blocks, kv_heads, layers, 2 (K/V), block_size, head_dim]` (kv_layout.py); a request's
token t is in block `table[t // block_size]`, row `t % block_size`. `store_kv` writes one step's K/V
rows into place; `paged_decode_attention` reads them where they are (no gather) for one query token per
request. Both are safe to capture in a CUDA graph: no host reads of device values, no allocation, the grid
depends only on shapes, and everything that depends on a request's length is computed in the kernels.

Attention is split-K (flash-decoding): one program per (batch row, KV head, split) loads the query heads
of its GQA group together, so each K/V byte is read once per KV head, walks its share of the request's
tokens in tiles of `tile_tokens` (each token's block looked up in the table), with an online softmax in
float32, and leaves a partial output and log-sum-exp per query head in the `DecodeWorkspace`; a small
kernel combines the splits. A split past a request's end writes log-sum-exp -inf. With one split the
attention kernel writes the output itself. float32 inputs are computed in float32 throughout (no TF32);
bfloat16/float16 use tensor-core dots with float32 accumulation (the softmax weights rounded to the input
dtype for the second dot).

Triton is imported here if present; `why_unavailable` says why the kernels cannot run on a device. On the
CPU they run only under Triton's interpreter (`TRITON_INTERPRET=1`), which is what the unit tests use.
"""

import math
import os
from functools import lru_cache

import torch

try:
    import triton
    import triton.language as tl
except ImportError as _exc:  # a CPU install without Triton: the module imports, the kernels say why not
    triton = tl = None
    _TRITON_MISSING = f"triton is not importable ({_exc})"
else:
    _TRITON_MISSING = None

__all__ = ["DecodeWorkspace", "default_splits", "paged_decode_attention", "store_kv", "why_unavailable"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOG2E = 1.4426950408889634
_NUM_WARPS = 4


def why_unavailable(device: torch.device) -> str | None:
    """None when the kernels can run on ``device``; otherwise why not (Triton missing, no CUDA, a CPU
    without the interpreter, another device type)."""
    device = torch.device(device)
    if _TRITON_MISSING is not None:
        return _TRITON_MISSING
    if device.type == "cuda":
        return None if torch.cuda.is_available() else "CUDA is not available to this torch"
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
            return None
        return "on the CPU the Triton kernels run only under Triton's interpreter (TRITON_INTERPRET=1)"
    return f"Triton has no backend for device type {device.type!r} here"


def default_splits(batch: int, kv_heads: int, sm_count: int, max_splits: int = 64) -> int:
    """Splits per (row, KV head) so that the attention grid fills about two waves of ``sm_count`` SMs:
    many for batch 1, one once batch * kv_heads alone does."""
    if batch <= 0 or kv_heads <= 0 or sm_count <= 0:
        raise ValueError(f"default_splits needs positive sizes, got {batch=}, {kv_heads=}, {sm_count=}")
    return max(1, min(max_splits, -(-2 * sm_count // (batch * kv_heads))))


class DecodeWorkspace:
    """Preallocated float32 scratch of split-K attention for up to ``max_batch`` rows: each split's
    partial output `[max_batch, num_heads, num_splits, head_dim]` and log-sum-exp (base 2)
    `[max_batch, num_heads, num_splits]`. It fixes the number of splits, ``tile_tokens`` (tokens per
    inner-loop tile, a power of two >= 16) and ``num_warps`` of the attention kernel (None: 8 for tiles of
    64 x 128 elements or more, where 4 warps would need ~200 registers a thread, else 4); one workspace
    serves every layer of a step."""

    def __init__(self, max_batch: int, num_heads: int, head_dim: int, num_splits: int, device,
                 tile_tokens: int = 64, num_warps: int | None = None) -> None:
        for name, value in (("max_batch", max_batch), ("num_heads", num_heads), ("head_dim", head_dim),
                            ("num_splits", num_splits)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"DecodeWorkspace.{name} must be a positive int, got {value!r}")
        if tile_tokens < 16 or tile_tokens & (tile_tokens - 1):
            raise ValueError(f"DecodeWorkspace.tile_tokens must be a power of two >= 16, got {tile_tokens}")
        self.max_batch, self.num_heads, self.head_dim = max_batch, num_heads, head_dim
        if num_warps is None:
            num_warps = 8 if tile_tokens * _next_power_of_2(head_dim) >= 64 * 128 else 4
        if num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"DecodeWorkspace.num_warps must be a power of two up to 16, got {num_warps}")
        self.num_splits, self.tile_tokens, self.num_warps = num_splits, tile_tokens, num_warps
        size = (max_batch, num_heads, num_splits)
        self.partial = torch.empty(*size, head_dim, dtype=torch.float32, device=device)
        self.lse = torch.empty(*size, dtype=torch.float32, device=device)


def store_kv(pool: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_blocks: torch.Tensor,
             slot_rows: torch.Tensor) -> None:
    """Write k, v `[B, kv_heads, head_dim]` into ``layer``'s rows (`slot_blocks[b]`, `slot_rows[b]`), int32
    `[B]`; a row whose block is negative is padding and writes nothing."""
    _check_pool(pool, layer)
    batch = k.shape[0]
    kv_heads, head_dim = pool.shape[1], pool.shape[5]
    for name, t in (("k", k), ("v", v)):
        if t.shape != (batch, kv_heads, head_dim) or t.dtype != pool.dtype or t.device != pool.device:
            raise ValueError(f"store_kv: {name} is {tuple(t.shape)} {t.dtype} on {t.device}, expected "
                             f"({batch}, {kv_heads}, {head_dim}) {pool.dtype} on {pool.device}")
    for name, t in (("slot_blocks", slot_blocks), ("slot_rows", slot_rows)):
        _check_index(name, t, (batch,), pool.device)
    if batch == 0:
        return
    kern = _kernels(pool.device.type == "cpu")
    s = pool.stride()
    kern.store[(batch,)](
        pool, k, v, slot_blocks, slot_rows,
        s[0], s[1], s[3], s[4], layer * s[2],
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        kv_heads, head_dim,
        BLOCK_H=_next_power_of_2(kv_heads), BLOCK_D=_next_power_of_2(head_dim), num_warps=_NUM_WARPS)


def paged_decode_attention(q: torch.Tensor, pool: torch.Tensor, layer: int, tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
                           workspace: DecodeWorkspace) -> torch.Tensor:
    """Attention of one query token per request over its first `seq_lens[b]` positions of ``layer``
    (its own K/V already stored): q `[B, H, D]`, tables int32 `[B, max_blocks]`, seq_lens int32 `[B]`
    (0: a padding row, its output zeros). Query head h reads KV head `h // (H // kv_heads)`. Writes
    ``out`` `[B, H, D]` (q's dtype) and returns it."""
    _check_pool(pool, layer)
    batch, heads, head_dim = q.shape
    kv_heads = pool.shape[1]
    if q.dtype != pool.dtype or q.device != pool.device or head_dim != pool.shape[5] or q.stride(2) != 1:
        raise ValueError(f"paged_decode_attention: q is {tuple(q.shape)} {q.dtype} on {q.device}, the pool "
                         f"holds head_dim {pool.shape[5]} {pool.dtype} on {pool.device} (q's last dim must be dense)")
    if heads % kv_heads:
        raise ValueError(f"paged_decode_attention: {heads} query heads are not a multiple of {kv_heads} KV heads")
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(2) != 1:
        raise ValueError(f"paged_decode_attention: out is {tuple(out.shape)} {out.dtype} on {out.device}, "
                         f"expected {tuple(q.shape)} {q.dtype} on {q.device} with a dense last dim")
    _check_index("seq_lens", seq_lens, (batch,), pool.device)
    _check_index("tables", tables, (batch, -1), pool.device)
    if tables.stride(1) != 1:
        raise ValueError("paged_decode_attention: tables must be dense along a row")
    ws = workspace
    if batch > ws.max_batch or heads != ws.num_heads or head_dim != ws.head_dim or ws.partial.device != q.device:
        raise ValueError(f"paged_decode_attention: a workspace for {ws.max_batch} rows x {ws.num_heads} heads x "
                         f"{ws.head_dim} on {ws.partial.device} cannot serve {batch} x {heads} x {head_dim} "
                         f"on {q.device}")
    if batch == 0:
        return out
    kern = _kernels(pool.device.type == "cpu")
    group = heads // kv_heads
    splits = ws.num_splits
    block_d = max(16, _next_power_of_2(head_dim))
    s = pool.stride()
    kern.decode[(batch, kv_heads, splits)](
        q, pool, tables, seq_lens, out, ws.partial, ws.lse,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        s[0], s[1], s[3], s[4], layer * s[2],
        ws.partial.stride(0), ws.partial.stride(1), ws.partial.stride(2), ws.lse.stride(0), ws.lse.stride(1),
        float(scale) * _LOG2E, group, head_dim,
        NUM_SPLITS=splits, BLOCK_SIZE=pool.shape[4], BLOCK_N=ws.tile_tokens,
        BLOCK_G=max(16, _next_power_of_2(group)), BLOCK_D=block_d,
        IEEE=q.dtype == torch.float32, num_warps=ws.num_warps)
    if splits > 1:
        kern.combine[(batch, heads)](
            ws.partial, ws.lse, out,
            ws.partial.stride(0), ws.partial.stride(1), ws.partial.stride(2), ws.lse.stride(0), ws.lse.stride(1),
            out.stride(0), out.stride(1), head_dim,
            NUM_SPLITS=splits, BLOCK_S=_next_power_of_2(splits), BLOCK_D=block_d, num_warps=_NUM_WARPS)
    return out


def _next_power_of_2(n: int) -> int:
    """triton.next_power_of_2, also where Triton is missing (a workspace is plain torch)."""
    return 1 << max(n - 1, 0).bit_length()


def _check_pool(pool: torch.Tensor, layer: int) -> None:
    reason = why_unavailable(pool.device)
    if reason is not None:
        raise RuntimeError(f"paged attention kernels cannot run on {pool.device}: {reason}")
    if pool.dim() != 6 or pool.shape[3] != 2 or not pool.is_contiguous() or pool.dtype not in _DTYPES:
        raise ValueError(f"the KV pool must be a contiguous [blocks, kv_heads, layers, 2, block_size, head_dim] "
                         f"tensor of {', '.join(map(str, _DTYPES))}, got {tuple(pool.shape)} {pool.dtype}")
    block_size = pool.shape[4]
    if block_size & (block_size - 1):
        raise ValueError(f"the pool's block size must be a power of two, got {block_size}")
    if not 0 <= layer < pool.shape[2]:
        raise ValueError(f"layer {layer} is not one of the pool's {pool.shape[2]}")


def _check_index(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if t.dtype != torch.int32 or t.device != device or t.dim() != len(shape) or any(
            want not in (-1, got) for want, got in zip(shape, t.shape)):
        raise ValueError(f"{name} must be int32 {shape} on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}")


class _Kernels:
    def __init__(self, store, decode, combine) -> None:
        self.store, self.decode, self.combine = store, decode, combine


@lru_cache(maxsize=2)
def _kernels(interpret: bool) -> _Kernels:
    """The kernels, compiled for the GPU or wrapped for Triton's interpreter (CPU tensors). Triton picks the
    mode when a function is decorated, so it is decorated here, once per mode, not at import."""
    if interpret:
        _fix_interpreter()
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = interpret
        return _Kernels(triton.jit(_store_kv_kernel), triton.jit(_decode_kernel), triton.jit(_combine_kernel))


def _fix_interpreter() -> None:
    """Make Triton's (3.6) interpreter run these kernels whenever triton was imported. Two gaps, both only in
    the interpreter (the CPU tests); compiled kernels never run this:
    - the standard library's jit functions (`tl.sum`, `tl.max`, `tl.cdiv`, `tl.zeros`) are interpretable only
      if TRITON_INTERPRET was set before triton was first imported: each kernel run now swaps in interpreted
      copies of them, as that import would have made;
    - a tensor used as a loop bound becomes an int through `int(array)`, which NumPy >= 2.4 refuses for the
      interpreter's one-element scalars (triton-lang/triton#9171): squeeze first."""
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    original = interpreter._patch_lang
    if getattr(original, "xpyd_fixed", False):
        return
    interpreted = {name: interpreter.InterpretedFunction(value.fn) for name, value in vars(tl).items()
                   if isinstance(value, JITFunction)}

    def patch_lang(fn):
        scope = original(fn)
        for name, value in interpreted.items():
            scope.set_attr(tl, name, value)
        scope.set_attr(tl.tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        return scope

    patch_lang.xpyd_fixed = True
    interpreter._patch_lang = patch_lang


if triton is not None:

    def _store_kv_kernel(pool_ptr, k_ptr, v_ptr, blocks_ptr, rows_ptr,
                         s_blk, s_head, s_kv, s_row, layer_off,
                         sk_b, sk_h, sk_d, sv_b, sv_h, sv_d,
                         KVH, D, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        b = tl.program_id(0)
        blk = tl.load(blocks_ptr + b).to(tl.int64)
        row = tl.load(rows_ptr + b).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < KVH) & (d[None, :] < D) & (blk >= 0)
        k = tl.load(k_ptr + b * sk_b + h[:, None] * sk_h + d[None, :] * sk_d, mask=mask)
        v = tl.load(v_ptr + b * sv_b + h[:, None] * sv_h + d[None, :] * sv_d, mask=mask)
        dst = pool_ptr + tl.maximum(blk, 0) * s_blk + layer_off + row * s_row + h[:, None] * s_head + d[None, :]
        tl.store(dst, k, mask=mask)
        tl.store(dst + s_kv, v, mask=mask)

    def _decode_kernel(q_ptr, pool_ptr, tables_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr,
                       sq_b, sq_h, so_b, so_h, st_b,
                       s_blk, s_head, s_kv, s_row, layer_off,
                       sp_b, sp_h, sp_s, sl_b, sl_h,
                       scale_log2, GROUP, D,
                       NUM_SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(lens_ptr + b)
        tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
        lo = split * tiles_per_split * BLOCK_N
        hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len)

        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        heads = kvh * GROUP + g
        gmask = g < GROUP
        dmask = d < D
        q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=gmask[:, None] & dmask[None, :],
                    other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        kv_base = pool_ptr + kvh * s_head + layer_off
        table_row = tables_ptr + b.to(tl.int64) * st_b
        for start in range(lo, hi, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            tmask = offs < hi
            phys = tl.load(table_row + offs // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
            rows = offs % BLOCK_SIZE
            kptr = kv_base + phys[:, None] * s_blk + rows[:, None] * s_row + d[None, :]
            kvmask = tmask[:, None] & dmask[None, :]
            k = tl.load(kptr, mask=kvmask, other=0.0)
            v = tl.load(kptr + s_kv, mask=kvmask, other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(tmask[None, :], scores * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        filled = l_i > 0.0
        result = tl.where(filled[:, None], acc / tl.where(filled, l_i, 1.0)[:, None], 0.0)
        omask = gmask[:, None] & dmask[None, :]
        if NUM_SPLITS == 1:
            tl.store(out_ptr + b * so_b + heads[:, None] * so_h + d[None, :],
                     result.to(out_ptr.dtype.element_ty), mask=omask)
        else:
            part = part_ptr + b * sp_b + heads[:, None] * sp_h + split * sp_s + d[None, :]
            tl.store(part, result, mask=omask)
            lse = tl.where(filled, m_i + tl.log2(tl.where(filled, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + b * sl_b + heads * sl_h + split, lse, mask=gmask)

    def _combine_kernel(part_ptr, lse_ptr, out_ptr, sp_b, sp_h, sp_s, sl_b, sl_h, so_b, so_h, D,
                        NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        smask = s < NUM_SPLITS
        dmask = d < D
        lse = tl.load(lse_ptr + b * sl_b + h * sl_h + s, mask=smask, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m)
        parts = tl.load(part_ptr + b * sp_b + h * sp_h + s[:, None] * sp_s + d[None, :],
                        mask=smask[:, None] & dmask[None, :], other=0.0)
        total = tl.sum(w, 0)
        o = tl.sum(w[:, None] * parts, 0) / tl.where(total > 0.0, total, 1.0)
        tl.store(out_ptr + b * so_b + h * so_h + d, o.to(out_ptr.dtype.element_ty), mask=dmask)
