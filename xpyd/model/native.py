"""Native CPU kernels: C sources shipped in `xpyd/model/csrc`, compiled once per machine, called via ctypes.

The decode step's attention reads each request's K/V in place from the paged KV pool, through the request's
block table (`decode_attention.c`): torch has no kernel for one query token over a strided, scattered cache
that does not first gather it. The pool holds bfloat16 K/V (`DecodeAttention.__call__`), fp8 codes with a
power-of-two scale per layer and KV head (`.fp8`), or int8 rows: head_dim signed codes followed by the row's
own scale as a little-endian float16 (`.int8`; rows of head_dim + 2 bytes); the codes are converted as they
are read, never copied out as floats.
RMSNorm and the rotary step run as one call each (`pointwise.c`) instead of 5-8 small torch ops.
A prompt's attention in prefill (`prefill_attention.c`) multiplies with AVX512-BF16 dot products where the CPU has
them: torch's CPU flash attention reaches a fraction of the rate of its own bfloat16 GEMMs there.

Built with the machine's C compiler (`$CC`, else `cc`) for this CPU (`-march=native`) into
`<cache>/kernels/<key>.so`, where the key covers the source, the compiler, the flags and the CPU, so a
copied cache or a changed machine never loads code built for another CPU. Parallel over torch's own
OpenMP runtime: the library links `libgomp.so.1`, which the dynamic linker resolves to the copy torch
has already loaded, so the kernel's threads are torch's threads (one team per process).

No compiler, or a failed build: `load_decode_attention()` returns None with the reason in
`unavailable_reason()`, and callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from xpyd.model.kv_layout import ROW_SCALE_BYTES
from xpyd.model.loader import cache_dir

ABI_VERSION = 5  # decode_attention.c (2: paged pool, block tables; 3: fp8 pools; 4: int8 pools, a scale per row;
# 5: int8 rows stored rotated)
POINTWISE_ABI_VERSION = 1  # pointwise.c
PREFILL_ABI_VERSION = 2  # prefill_attention.c (2: the prefix read in place from the paged pool)
BUILD_TIMEOUT_S = 120.0
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-std=c11")

_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ARGTYPES = [_P, _I64, _P, _I64, _P, _I64,  # q, k_new, v_new with row strides
             _P, _I64, _I64, _I64, _I64,  # pool, block and head strides, the layer's K and V offsets
             _I64, _I64, _P, _I64, _P,  # token (row) stride, block size, block tables and their row stride, lens
             _INT, _INT, _INT, _INT, _F32, _P, _INT]  # sizes, scale, out, threads
_ARGTYPES_FP8 = [*_ARGTYPES, _INT, _P, _P]  # + the fp8 format, the layer's K and V scales [kv_heads]
_ARGTYPES_INT8 = [*_ARGTYPES, _P]  # + the rotation the rows are stored in (NULL: none)
_FP8_FORMATS = {"fp8_e4m3": 1, "fp8_e5m2": 2}  # decode_attention.c's numbers for them (fp8.h)

_lock = threading.Lock()
_loaded: dict[str, object] = {}
_reason: dict[str, str] = {}


class NativeBuildError(RuntimeError):
    pass


def _sources(name: str) -> dict[str, bytes]:
    """`csrc/<name>` and the headers beside it (all of them go into the build key)."""
    folder = resources.files("xpyd.model").joinpath("csrc")
    files = {name: folder.joinpath(name).read_bytes()}
    files.update({f.name: f.read_bytes() for f in folder.iterdir() if f.name.endswith(".h")})
    return files


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            keep = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        keep = []
    return platform.machine() + "|" + "".join(keep)


def _compiler() -> str:
    cc = os.environ.get("CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        raise NativeBuildError(f"no C compiler ({cc!r} not found; set CC)")
    return path


def build(name: str) -> Path:
    """Compile `csrc/<name>` for this machine, once; returns the shared library's path."""
    sources = _sources(name)
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeBuildError(f"{cc} --version failed: {e}") from e
    parts = [n.encode() + b"\0" + data for n, data in sorted(sources.items())]
    parts += [version.encode(), " ".join(_FLAGS).encode(), _cpu_id().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    folder = cache_dir() / "kernels"
    target = folder / f"{Path(name).stem}-{key}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        for file, data in sources.items():
            (Path(tmp) / file).write_bytes(data)
        src = Path(tmp) / name
        out = Path(tmp) / target.name
        try:
            done = subprocess.run([cc, *_FLAGS, str(src), "-o", str(out), "-lm"], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NativeBuildError(f"compiling {name} failed: {e}") from e
        if done.returncode != 0:
            raise NativeBuildError(f"compiling {name} failed ({cc}): {done.stderr.strip()[-2000:]}")
        os.replace(out, target)  # atomic: concurrent builders (several workers) each land a whole file
    return target


def _open(path: Path, abi_symbol: str, abi: int, functions: dict[str, list]) -> list:
    """Load the library, check its ABI version, and type its `functions` (name -> argtypes; int result)."""
    lib = ctypes.CDLL(str(path))
    found = getattr(lib, abi_symbol)()
    if found != abi:
        raise NativeBuildError(f"{path}: ABI {found}, expected {abi}")
    typed = []
    for name, argtypes in functions.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, _INT
        typed.append(fn)
    return typed


def _convert(fn, name: str, x: torch.Tensor, src: torch.dtype, dst: torch.dtype, *flags: int) -> torch.Tensor:
    """One of the kernels' element conversions (for the tests): contiguous CPU ``x`` of ``src`` -> ``dst``."""
    if x.dtype != src or not x.is_contiguous() or not x.is_cpu:
        raise ValueError(f"{name}: contiguous {src} on the CPU")
    out = torch.empty(x.shape, dtype=dst)
    if fn(x.data_ptr(), x.numel(), *flags, out.data_ptr()) != 0:
        raise RuntimeError(f"native conversion failed ({name})")
    return out


class DecodeAttention:
    """`decode_attention.c` loaded: attention for one new token per request over the paged KV pool, the
    step's K/V written in place."""

    def __init__(self, path: Path) -> None:
        self._fn, self._fn_fp8, self._fn_int8, self._to_f32, self._f16_to_f32, self._f32_to_f16 = _open(
            path, "xpyd_abi_version", ABI_VERSION, {
                "xpyd_decode_attention_bf16": _ARGTYPES, "xpyd_decode_attention_fp8": _ARGTYPES_FP8,
                "xpyd_decode_attention_int8": _ARGTYPES_INT8, "xpyd_fp8_to_f32": [_P, _I64, _INT, _INT, _P],
                "xpyd_f16_to_f32": [_P, _I64, _INT, _P], "xpyd_f32_to_f16": [_P, _I64, _INT, _P]})
        self.path = path

    def __call__(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, pool: torch.Tensor,
                 layer: int, tables: torch.Tensor, lens: torch.Tensor, scale: float, out: torch.Tensor,
                 tables_checked: bool = False) -> torch.Tensor:
        """q [B, heads, hd], k_new/v_new [B, kv_heads, hd] (rows may be strided), pool
        [blocks, kv_heads, layers, 2, block_size, hd] (any strides, the last contiguous), all bfloat16 on the
        CPU; tables int64 [B, max_blocks] (request b's token t in block tables[b, t // block_size], row
        t % block_size; entries past a request's ceil(lens[b] / block_size) blocks are ignored); lens int64 [B]
        (tokens attended over, the new one at lens-1 included); out [B, heads, hd] contiguous.

        The new K/V go to row lens[b]-1 of each request; two requests of one call must not share that block
        row. Every block id the kernel would touch is checked against the pool first (ValueError: nothing
        written), unless ``tables_checked``: the caller ran `check_tables` on these very tensors for this pool
        (once per decode step, instead of once per layer)."""
        return self._run(self._fn, torch.bfloat16, 0, torch.bfloat16, (), q, k_new, v_new, pool, layer, tables, lens,
                         scale, out, tables_checked)

    def fp8(self, q: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor, pool: torch.Tensor, layer: int,
            tables: torch.Tensor, lens: torch.Tensor, scale: float, out: torch.Tensor, fmt: str,
            k_scales: torch.Tensor, v_scales: torch.Tensor, tables_checked: bool = False) -> torch.Tensor:
        """The same over an fp8 pool (uint8 codes of format ``fmt``, "fp8_e4m3" or "fp8_e5m2": `kv_quant`):
        k_codes/v_codes [B, kv_heads, hd] uint8 are the step's K/V already quantized (written as they are);
        each code read is its value (`to_float`) times the layer's scale of its KV head
        (``k_scales``/``v_scales``: float32 [kv_heads]). q and out stay bfloat16."""
        kv_heads = k_codes.shape[1] if k_codes.dim() == 3 else -1
        if fmt not in _FP8_FORMATS:
            raise ValueError(f"decode attention (fp8): format must be one of {sorted(_FP8_FORMATS)}, not {fmt!r}")
        for t in (k_scales, v_scales):
            if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() or t.shape != (kv_heads,):
                raise ValueError("decode attention (fp8): scales float32 [kv_heads] on the CPU")
        return self._run(self._fn_fp8, torch.uint8, 0, torch.uint8,
                         (_FP8_FORMATS[fmt], k_scales.data_ptr(), v_scales.data_ptr()),
                         q, k_codes, v_codes, pool, layer, tables, lens, scale, out, tables_checked)

    def int8(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, pool: torch.Tensor, layer: int,
             tables: torch.Tensor, lens: torch.Tensor, scale: float, out: torch.Tensor,
             tables_checked: bool = False, rotation: torch.Tensor | None = None) -> torch.Tensor:
        """The same over an int8 pool (uint8 [blocks, kv_heads, layers, 2, block_size, hd + 2]: `kv_int8`):
        each row is hd signed codes (two's complement bytes) and then its scale, a little-endian float16; element
        i is code_i * scale in float32. k_new/v_new [B, kv_heads, hd] bfloat16 are the step's K/V values: the
        kernel encodes them into their rows (`kv_int8.encode_rows`' format; without a rotation its bytes exactly).
        No per-head scales: each row carries its own. q and out stay bfloat16 [B, heads, hd]. ``rotation``
        (float32 [2, hd, hd], contiguous: R and R^T; `kv_rotation.both`): rows hold the codes of x R (the step's
        too, turned in float32), q is turned by R and the output by R^T inside the kernel, in float32 (no
        rounding added)."""
        hd = q.shape[-1]
        if rotation is not None and (rotation.dtype != torch.float32 or rotation.shape != (2, hd, hd)
                                     or not rotation.is_contiguous() or not rotation.is_cpu):
            raise ValueError("decode attention (int8): the rotation is float32 [2, head_dim, head_dim] (R, R^T), "
                             "contiguous")
        return self._run(self._fn_int8, torch.uint8, ROW_SCALE_BYTES, torch.bfloat16,
                         (None if rotation is None else rotation.data_ptr(),),
                         q, k_new, v_new, pool, layer, tables, lens, scale, out, tables_checked)

    def to_half(self, values: torch.Tensor, vector: bool = True) -> torch.Tensor:
        """The kernel's own float32 -> float16 conversion (the int8 rows' scales it encodes) of contiguous float32
        ``values`` (for the tests): F16C's (``vector``, where the CPU has it) or bit arithmetic (csrc/int8.h)."""
        return _convert(self._f32_to_f16, "to_half", values, torch.float32, torch.float16, int(vector))

    def to_float(self, codes: torch.Tensor, fmt: str, vector: bool = True) -> torch.Tensor:
        """The kernel's own fp8 -> float32 conversion of contiguous uint8 ``codes`` (for the tests): its row
        conversion (``vector``: SIMD where the CPU has it), or the per-code one (csrc/fp8.h)."""
        if fmt not in _FP8_FORMATS:
            raise ValueError("to_float: contiguous uint8 codes of an fp8 format")
        return _convert(self._to_f32, "to_float", codes, torch.uint8, torch.float32, _FP8_FORMATS[fmt], int(vector))

    def half_to_float(self, halves: torch.Tensor, vector: bool = True) -> torch.Tensor:
        """The kernel's own float16 -> float32 conversion of int8 rows' scales, over contiguous float16
        ``halves`` (for the tests): F16C's (``vector``, where the CPU has it) or bit arithmetic (csrc/int8.h)."""
        return _convert(self._f16_to_f32, "half_to_float", halves, torch.float16, torch.float32, int(vector))

    def _run(self, fn, kv_dtype, row_extra, new_dtype, extra, q, k_new, v_new, pool, layer, tables, lens, scale,
             out, tables_checked):
        """The checks and the call common to the entries; a pool row is hd + ``row_extra`` elements of
        ``kv_dtype``; the step's K/V rows are ``new_dtype``, as wide as the pool's when that is the pool's type
        (copied in), else hd values (encoded by the kernel)."""
        batch, heads, hd = q.shape
        kv_heads = k_new.shape[1]
        row = hd + row_extra
        new = row if new_dtype == kv_dtype else hd
        bf16 = torch.bfloat16
        if q.dtype != bf16 or k_new.dtype != new_dtype or v_new.dtype != new_dtype or q.stride(2) != 1 \
                or q.stride(1) != hd or k_new.stride()[1:] != (new, 1) or v_new.stride()[1:] != (new, 1):
            raise ValueError(f"decode attention wants bfloat16 q and {new_dtype} K/V rows of contiguous heads")
        if pool.dim() != 6 or k_new.shape != (batch, kv_heads, new) or v_new.shape != (batch, kv_heads, new) or \
                pool.shape[1] != kv_heads or pool.shape[3] != 2 or pool.shape[5] != row or \
                not 0 <= layer < pool.shape[2]:
            raise ValueError("decode attention: q, k_new, v_new and the pool's shapes disagree")
        if pool.dtype != kv_dtype or pool.stride(5) != 1 or not pool.is_cpu or out.dtype != bf16 \
                or out.shape != q.shape or not out.is_contiguous() or tables.dtype != torch.int64 \
                or lens.dtype != torch.int64:
            raise ValueError("decode attention: bad pool strides, output or index dtypes")
        if tables.dim() != 2 or tables.shape[0] != batch or tables.stride(1) != 1 or lens.shape != (batch,) or \
                lens.stride(0) != 1 or not tables.is_cpu or not lens.is_cpu:
            raise ValueError("decode attention: tables [B, max_blocks] and lens [B], CPU tensors with contiguous rows")
        block_size = pool.shape[4]
        if not tables_checked:
            check_tables(tables, lens, pool.shape[0], block_size)
        stride = pool.stride()
        k_off = stride[2] * layer
        rc = fn(q.data_ptr(), q.stride(0), k_new.data_ptr(), k_new.stride(0), v_new.data_ptr(), v_new.stride(0),
                pool.data_ptr(), stride[0], stride[1], k_off, k_off + stride[3], stride[4], block_size,
                tables.data_ptr(), tables.stride(0), lens.data_ptr(), batch, heads, kv_heads, hd, scale,
                out.data_ptr(), torch.get_num_threads(), *extra)
        if rc != 0:
            raise RuntimeError(f"native decode attention failed (code {rc})")
        return out


def check_tables(tables: torch.Tensor, lens: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """ValueError unless each request's first ceil(lens[b] / block_size) table entries are block ids in
    [0, num_blocks). (lens <= 0 is the kernel's to refuse.) A few microseconds per call: one max over the
    used columns read as unsigned (a negative id is huge), and the exact per-row check only when that
    finds something out of range (padding past a request's blocks may hold anything)."""
    need = (max(lens.tolist(), default=0) + block_size - 1) // block_size
    if need <= 0:
        return
    if need > tables.shape[1]:
        raise ValueError(f"decode attention: lens need {need} blocks, the tables hold {tables.shape[1]}")
    ids = tables.numpy()[:, :need]
    if int(ids.view(np.uint64).max()) < num_blocks:
        return
    used = (lens.numpy() + (block_size - 1)) // block_size
    bad = ((ids < 0) | (ids >= num_blocks)) & (np.arange(need) < used[:, None])
    if bad.any():
        b, j = (int(i[0]) for i in np.nonzero(bad))
        raise ValueError(f"decode attention: request {b}'s block {j} is {int(ids[b, j])}, the pool has {num_blocks}")


class PrefillAttention:
    """`prefill_attention.c` loaded: a prompt's new tokens attending causally over its prefix and themselves,
    bfloat16, with AVX512-BF16 dot products (only where the CPU has them: `load_prefill_attention`)."""

    def __init__(self, path: Path) -> None:
        supported, self._fn = _open(path, "xpyd_prefill_abi_version", PREFILL_ABI_VERSION, {
            "xpyd_prefill_attention_supported": [],
            "xpyd_prefill_attention_bf16": [_P, _I64, _I64, _P, _I64, _I64, _P, _I64, _I64, _P, _I64, _I64, _P, _I64,
                                            _I64, _I64, _I64, _INT, _INT, _INT, _F32, _P, _I64, _I64, _INT,
                                            _P, _I64, _I64]})
        if supported() != 1:
            raise NativeBuildError("prefill attention needs AVX512-BF16 (this CPU, or this compiler, has not)")
        self.path = path

    def __call__(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scale: float,
                 k_prefix: torch.Tensor | None = None, v_prefix: torch.Tensor | None = None) -> torch.Tensor:
        """q [n, heads, hd] at positions [start, start + n); k_new, v_new [n, kv_heads, hd] at the same positions;
        k_prefix, v_prefix [kv_heads, start, hd] at [0, start) (None: start 0). All bfloat16 on the CPU, any
        strides with the last dimension contiguous. Each query attends to every prefix key and to the new keys
        up to its own position. Returns a new contiguous [n, heads, hd]."""
        if (k_prefix is None) != (v_prefix is None):
            raise ValueError("prefill attention: give both prefix K and V, or neither")
        start = 0 if k_prefix is None else k_prefix.shape[1]
        return self._call(q, k_new, v_new, scale, start, k_prefix, v_prefix, None)

    def paged(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scale: float, pool: torch.Tensor,
              layer: int, table: torch.Tensor, start: int) -> torch.Tensor:
        """The same with the prefix [0, start) read in place from a bfloat16 pool [blocks, kv_heads, layers, 2,
        block_size, hd] (any strides, the last contiguous): token t of it in block table[t // block_size] (int64,
        contiguous, at least ceil(start / block_size) entries, each checked against the pool's blocks), at
        ``layer``; no gathered copy. The same numbers as `__call__` over that prefix gathered."""
        if pool.dtype != torch.bfloat16 or pool.dim() != 6 or pool.stride(5) != 1 or not pool.is_cpu or \
                pool.shape[3] != 2 or not 0 <= layer < pool.shape[2]:
            raise ValueError("prefill attention (paged): a bfloat16 CPU pool [blocks, kv_heads, layers, 2, "
                             "block_size, hd] and a layer of it")
        block_size = pool.shape[4]
        need = -(-start // block_size)
        if table.dtype != torch.int64 or table.dim() != 1 or table.stride(0) != 1 or not table.is_cpu or \
                table.shape[0] < need or start < 0:
            raise ValueError("prefill attention (paged): an int64 table of the prefix's blocks")
        ids = table[:need]
        if need and (int(ids.min()) < 0 or int(ids.max()) >= pool.shape[0]):
            raise ValueError(f"prefill attention (paged): a block id outside the pool's {pool.shape[0]} blocks")
        return self._call(q, k_new, v_new, scale, start, pool[0, :, layer, 0].transpose(0, 1),
                          pool[0, :, layer, 1].transpose(0, 1), (table, block_size, pool.stride(0)))

    def _call(self, q, k_new, v_new, scale, start, k_prefix, v_prefix, paged) -> torch.Tensor:
        """The checks and the call; ``paged``: (table, block_size, block_stride) when the prefix tensors are the
        pool's first block's rows [block_size, kv_heads, hd] (token and head strides) and the table places the
        rest."""
        n, heads, hd = q.shape
        kv_heads = k_new.shape[1]
        tensors = [q, k_new, v_new] + ([] if k_prefix is None else [k_prefix, v_prefix])
        if any(t.dtype != torch.bfloat16 or not t.is_cpu or t.dim() != 3 or t.stride(2) != 1 for t in tensors):
            raise ValueError("prefill attention wants 3-d bfloat16 CPU tensors with contiguous last dimensions")
        prefix_shape = (paged[1], kv_heads, hd) if paged is not None else (kv_heads, start, hd)
        if k_new.shape != (n, kv_heads, hd) or v_new.shape != (n, kv_heads, hd) or n == 0 or heads % kv_heads or \
                (k_prefix is not None and (k_prefix.shape != prefix_shape or v_prefix.shape != prefix_shape)):
            raise ValueError("prefill attention: q, K and V shapes disagree")
        out = torch.empty((n, heads, hd), dtype=torch.bfloat16)
        kp, vp = (k_new, v_new) if k_prefix is None else (k_prefix, v_prefix)
        if paged is not None:  # (the pool's rows: [block_size, kv_heads, hd] per block)
            (kp_tok, kp_head), (vp_tok, vp_head) = kp.stride()[:2], vp.stride()[:2]
        else:
            kp_tok, kp_head = (0, 0) if k_prefix is None else (kp.stride(1), kp.stride(0))
            vp_tok, vp_head = (0, 0) if v_prefix is None else (vp.stride(1), vp.stride(0))
        table, block_size, block_stride = (None, 0, 0) if paged is None else (paged[0].data_ptr(), paged[1], paged[2])
        rc = self._fn(q.data_ptr(), q.stride(0), q.stride(1), kp.data_ptr(), kp_tok, kp_head, vp.data_ptr(), vp_tok,
                      vp_head, k_new.data_ptr(), k_new.stride(0), k_new.stride(1), v_new.data_ptr(), v_new.stride(0),
                      v_new.stride(1), start, n, heads, kv_heads, hd, scale, out.data_ptr(), heads * hd, hd,
                      torch.get_num_threads(), table, block_size, block_stride)
        if rc != 0:
            raise ValueError(f"native prefill attention refused its arguments (code {rc})" if rc == -1 else
                             f"native prefill attention failed (code {rc})")
        return out


class Pointwise:
    """`pointwise.c` loaded: transformers' RMSNorm and the lean forward's rotary step, bfloat16, one call each."""

    def __init__(self, path: Path) -> None:
        self._norm, self._rope = _open(path, "xpyd_pointwise_abi_version", POINTWISE_ABI_VERSION, {
            "xpyd_rms_norm_bf16": [_P, _I64, _P, _P, _I64, _I64, _INT, _F32, _INT],
            "xpyd_rope_bf16": [_P, _I64, _P, _P, _I64, _P, _I64, _I64, _INT, _INT, _INT]})
        self.path = path

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [rows, n] bfloat16 (rows may be strided), weight [n] -> a new [rows, n]."""
        rows, n = x.shape
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.stride(1) != 1 or \
                not weight.is_contiguous() or weight.shape != (n,):
            raise ValueError("rms_norm wants bfloat16 rows of contiguous elements and a matching weight")
        out = torch.empty((rows, n), dtype=torch.bfloat16)
        rc = self._norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), n, rows, n, eps,
                        torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"native rms_norm failed (code {rc})")
        return out

    def rope(self, qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qkv [rows, >= heads, hd]; cos/sin [rows, hd] (sin with rotate_half's sign folded in) -> a new
        [rows, heads, hd] of the rotated first `heads` head vectors."""
        rows, _, hd = qkv.shape
        for t in (qkv, cos, sin):
            if t.dtype != torch.bfloat16 or t.stride(-1) != 1:
                raise ValueError("rope wants bfloat16 tensors with contiguous last dimensions")
        if qkv.stride(1) != hd or cos.shape != (rows, hd) or sin.shape != (rows, hd) or cos.stride(0) != sin.stride(0):
            raise ValueError("rope: qkv heads must be contiguous and cos/sin [rows, head_dim] alike")
        out = torch.empty((rows, heads, hd), dtype=torch.bfloat16)
        rc = self._rope(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), out.data_ptr(),
                        heads * hd, rows, heads, hd, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"native rope failed (code {rc})")
        return out


def _load(name: str, factory):
    """`factory(build(name))`, once per process; None (reason kept) when it cannot be built or loaded here.

    `XPYD_NATIVE_KERNELS=0` turns native kernels off."""
    with _lock:
        if name in _loaded or name in _reason:
            return _loaded.get(name)
        if os.environ.get("XPYD_NATIVE_KERNELS", "1") == "0":
            _reason[name] = "native kernels turned off (XPYD_NATIVE_KERNELS=0)"
            return None
        try:
            _loaded[name] = factory(build(name))
        except (NativeBuildError, OSError, AttributeError) as e:
            _reason[name] = str(e)
            return None
        return _loaded[name]


def load_decode_attention() -> DecodeAttention | None:
    """The attention kernel, built on first use; None (reason in `unavailable_reason`) when unavailable."""
    return _load("decode_attention.c", DecodeAttention)


def load_prefill_attention() -> PrefillAttention | None:
    """Prefill attention with AVX512-BF16 dot products, built on first use; None (reason in
    `unavailable_reason("prefill_attention.c")`) where the CPU lacks them or nothing can be built."""
    return _load("prefill_attention.c", PrefillAttention)


def load_pointwise() -> Pointwise | None:
    """RMSNorm and rotary kernels, built on first use; None (reason in `unavailable_reason`) when unavailable."""
    return _load("pointwise.c", Pointwise)


def unavailable_reason(name: str = "decode_attention.c") -> str | None:
    return _reason.get(name)
