"""The KV pool's layout and byte ranges, and a pool in plain host memory: nothing here needs torch.

Shape `[num_blocks, num_kv_heads, num_layers, 2 (K/V), block_size, head_dim]`. Token t of a request lives in
block `blocks[t // block_size]` at row `t % block_size`. Inside a block the KV heads are outermost, so
the bytes of one head slice of a block (what a decode worker with a larger tensor-parallel degree
needs) are one contiguous run, and for one (head, layer, K or V) the block's rows are contiguous, which
is what the decode attention reads. A block is one contiguous byte range of the pool; adjacent
blocks coalesce into one region for the transfer engine (`byte_ranges`), which sends or receives them
straight from/into the pool (`buffer()`), no staging.

Which blocks are free, referenced or cached (prefix caching) is the `BlockAllocator`'s business
(`pool.blocks`); the pool only holds the memory and names its byte ranges. The torch pool (`kv_pool`) is
this one with a tensor view over its memory, or a tensor on another device.

An fp8 layout ("fp8_e4m3", "fp8_e5m2": `--kv-cache-dtype`) holds one-byte codes, which mean numbers only with
the per-(layer, KV head) scales they were quantized with (`kv_quant`): the layout names the scales by their
digest (``scales``), and `compat()` carries it, so two workers with other scales refuse each other at the
handshake and their prefix-cache hashes differ (the bytes of one mean something else to the other).

An int8 layout ("int8") holds, for each token, KV head, layer and K or V, a row of ``head_dim`` signed one-byte
codes followed by that row's own scale (a float16, ``ROW_SCALE_BYTES``): the pool's rows are ``row_dim`` =
``head_dim + 2`` bytes wide, so blocks, transfers and the prefix cache carry each row's scale with its codes
and nothing is calibrated (`kv_quant`). The codes are of the row turned by a fixed rotation (`kv_rotation`),
which `compat()` names (``ROW_ROTATION``): a worker storing rows in another basis is refused at the handshake.

A latent layout (``kind="latent"``: multi-head latent attention, DeepSeek-V2) keeps one vector per token and
layer instead of a K and a V per KV head: shape `[num_blocks, 1, num_layers, 1, block_size, head_dim]`, its
``head_dim`` the latent's size (the compressed KV and the rotary key part). Blocks, byte ranges, transfers and
the allocator see only bytes and are the same; `compat` names the latent layout, so a handshake between a
latent and a per-head worker, or latents of other sizes, is refused. (A latent layout is not quantized: the
fp8 codec scales K and V per head.)
"""

from __future__ import annotations

import dataclasses
import mmap
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from xpyd.model.kv_blocks import BlockAllocator, PoolFull

__all__ = ["ELEMENT_BYTES", "KINDS", "KV_CACHE_DTYPES", "LATENT_LAYOUT_NAME", "LAYOUT_NAME", "QUANTIZED", "ROW_SCALED",
           "ROW_ROTATION", "ROW_SCALE_BYTES", "ByteRange",
           "HostKVPool", "KVLayout", "PoolFull", "block_ranges"]

LAYOUT_NAME = "block-head-major/1"
LATENT_LAYOUT_NAME = "block-latent/1"  # (a latent layout's name in `compat`)
KINDS = ("kv", "latent")  # a K and a V per KV head; one latent per token (num_kv_heads 1)

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}  # KV dtypes
QUANTIZED = ("fp8_e4m3", "fp8_e5m2")  # one-byte codes scaled per (layer, KV head): vLLM's names
ROW_SCALED = ("int8",)  # one-byte codes with a scale per row (token, KV head, layer, K or V) stored in the row
ROW_SCALE_BYTES = 2  # a row-scaled row's scale: float16, after its head_dim codes
ROW_ROTATION = "hadamard-signed/1"  # the basis a per-head row-scaled row is quantized in (`kv_rotation`)
KV_CACHE_DTYPES = ("auto", *QUANTIZED, *ROW_SCALED)  # `--kv-cache-dtype`: auto = the model's dtype


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_blocks: int
    block_size: int
    scales: str | None = None  # a quantized dtype's: the digest of its scales (`kv_quant.KVScales.digest`)
    kind: str = "kv"  # one of KINDS; "latent": head_dim is the latent's size, num_kv_heads 1

    def __post_init__(self) -> None:
        if self.dtype not in ELEMENT_BYTES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; expected one of {sorted(ELEMENT_BYTES)}")
        if (self.dtype in QUANTIZED) != (self.scales is not None):
            raise ValueError(f"a KV layout names scales exactly when its dtype is one of {QUANTIZED} "
                             f"(dtype {self.dtype!r}, scales {self.scales!r})")
        for name in ("num_layers", "num_kv_heads", "head_dim", "num_blocks", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.kind not in KINDS:
            raise ValueError(f"KVLayout.kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "latent" and self.num_kv_heads != 1:
            raise ValueError(f"a latent KV layout has one latent per token (num_kv_heads 1), not {self.num_kv_heads}")
        if self.kind == "latent" and self.dtype in QUANTIZED:
            raise ValueError("a latent KV layout is not fp8 (its scales are per KV head; int8, a scale per row, "
                             "is)")

    @property
    def planes(self) -> int:
        """Vectors per token, KV head and layer: 2 (K and V), or 1 (a latent)."""
        return 1 if self.kind == "latent" else 2

    @property
    def row_dim(self) -> int:
        """Elements in one row of the pool: ``head_dim``, and a row-scaled (int8) row's scale bytes after it."""
        return self.head_dim + (ROW_SCALE_BYTES if self.dtype in ROW_SCALED else 0)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_blocks, self.num_kv_heads, self.num_layers, self.planes, self.block_size, self.row_dim)

    @property
    def token_bytes(self) -> int:
        return self.num_layers * self.planes * self.num_kv_heads * self.row_dim * ELEMENT_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.token_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def num_tokens(self) -> int:
        """Tokens the whole pool holds."""
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens (the last one possibly partly filled)."""
        return -(-num_tokens // self.block_size)

    def compat(self) -> dict:
        """What must match between a prefill and a decode worker for KV bytes to mean the same thing."""
        if self.kind == "latent":
            return {"layout": LATENT_LAYOUT_NAME, "num_layers": self.num_layers, "latent_dim": self.head_dim,
                    "dtype": self.dtype, "block_size": self.block_size}
        return {
            "layout": LAYOUT_NAME,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "block_size": self.block_size,
            **({"kv_scales": self.scales} if self.scales is not None else {}),
            **({"row_rotation": ROW_ROTATION} if self.dtype in ROW_SCALED else {}),
        }

    def with_blocks(self, num_blocks: int) -> "KVLayout":
        """This layout with ``num_blocks`` blocks."""
        return dataclasses.replace(self, num_blocks=num_blocks)


class ByteRange(NamedTuple):
    """A contiguous byte range of the pool's ``buffer()`` (the worker turns it into a transfer region)."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


class HostKVPool:
    """A pool in host memory, as plain bytes (no torch): the simulated engine's, and the base of the torch
    pool (`kv_pool.KVPool`). ``buffer``: optional writable memory of exactly ``layout.total_bytes`` (e.g. a
    shared-memory segment from the shm transfer backend), zeroed here, which must outlive the pool; without
    one, anonymous memory is mapped (its pages cost nothing until written). ``caching``: keep the blocks of
    ended requests for prefix reuse (``blocks``). ``zeroed``: the buffer is known to hold zeros (a segment
    just created), so it is not written again here."""

    def __init__(self, layout: KVLayout, buffer: memoryview | None = None, caching: bool = True,
                 zeroed: bool = False) -> None:
        self.layout = layout
        self.staging = None  # a non-host pool's host copy (kv_staging); a host pool needs none
        if buffer is None:
            self._map = mmap.mmap(-1, layout.total_bytes)  # zero-filled, untouched pages take no memory
            self._memory = memoryview(self._map)
        else:
            self._memory = _checked(buffer, layout)
            if not zeroed:
                _zero(self._memory)
        self.blocks = BlockAllocator(layout.num_blocks, caching=caching)

    def buffer(self) -> memoryview:
        """Writable uint8 view of the whole pool, sharing its memory (for the transfer engine)."""
        return self._memory

    @property
    def num_used(self) -> int:
        """Blocks some request holds."""
        return self.blocks.num_referenced

    def used_bytes(self) -> int:
        return self.blocks.num_referenced * self.layout.block_bytes

    def byte_ranges(self, blocks: Sequence[int]) -> list[ByteRange]:
        """The bytes of ``blocks`` in order, runs of consecutive block ids coalesced into one range each."""
        return block_ranges(blocks, self.layout.block_bytes, self.layout.num_blocks)


def _checked(buffer: memoryview, layout: KVLayout) -> memoryview:
    if not isinstance(buffer, memoryview) or buffer.readonly or not buffer.c_contiguous:
        raise ValueError("KVPool buffer must be a writable, C-contiguous memoryview")
    if buffer.nbytes != layout.total_bytes:
        raise ValueError(f"KVPool buffer holds {buffer.nbytes} bytes, the layout needs {layout.total_bytes}")
    return buffer.cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer


def _zero(memory: memoryview, chunk: int = 1 << 24) -> None:
    zeros = bytes(min(chunk, memory.nbytes))
    for start in range(0, memory.nbytes, chunk):
        end = min(start + chunk, memory.nbytes)
        memory[start:end] = zeros[: end - start]


def block_ranges(blocks: Sequence[int], block_bytes: int, num_blocks: int) -> list[ByteRange]:
    """The byte ranges of ``blocks`` of a pool of ``num_blocks`` blocks of ``block_bytes`` bytes, in order,
    runs of consecutive ids coalesced (ValueError for an id outside the pool)."""
    out: list[ByteRange] = []
    run_start = prev = -2
    for b in blocks:
        if type(b) is not int or not 0 <= b < num_blocks:
            raise ValueError(f"KV block {b!r} does not exist (pool has {num_blocks})")
        if b != prev + 1:
            if run_start >= 0:
                out.append(ByteRange(run_start * block_bytes, (prev + 1 - run_start) * block_bytes))
            run_start = b
        prev = b
    if run_start >= 0:
        out.append(ByteRange(run_start * block_bytes, (prev + 1 - run_start) * block_bytes))
    return out
