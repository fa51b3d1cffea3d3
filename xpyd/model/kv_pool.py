"""The preallocated KV cache of one worker, in fixed-size blocks (paged): a request holds a list of blocks.

Shape `[num_blocks, num_kv_heads, num_layers, 2 (K/V), block_size, head_dim]`. Token t of a request lives in
block `blocks[t // block_size]` at row `t % block_size`. Inside a block the KV heads are outermost, so
the bytes of one head slice of a block (what a decode worker with a larger tensor-parallel degree
needs) are one contiguous run, and for one (head, layer, K or V) the block's rows are contiguous, which
is what the decode attention reads. A block is one contiguous byte range of the pool; adjacent
blocks coalesce into one region for the transfer engine (`byte_ranges`), which sends or receives them
straight from/into the pool (`buffer()`), no staging.

Which blocks are free, referenced or cached (prefix caching) is the `BlockAllocator`'s business
(`pool.blocks`); the pool only holds the memory and names its byte ranges.

The pool lives on a torch device (CPU by default). A pool on another device (a GPU) is not host memory:
its `buffer()` is the host staging copy that `xpyd.worker.kv_staging` attaches (same offsets), and the
staging transfer wrapper copies each request's region between the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from xpyd.model.kv_blocks import BlockAllocator, PoolFull

__all__ = ["LAYOUT_NAME", "ByteRange", "KVLayout", "KVPool", "PoolFull", "block_ranges", "dtype_name"]

LAYOUT_NAME = "block-head-major/1"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}; expected one of {sorted(_DTYPES)}")


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_blocks: int
    block_size: int

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; expected one of {sorted(_DTYPES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "num_blocks", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_blocks, self.num_kv_heads, self.num_layers, 2, self.block_size, self.head_dim)

    @property
    def token_bytes(self) -> int:
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem

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
        return {
            "layout": LAYOUT_NAME,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "block_size": self.block_size,
        }


class ByteRange(NamedTuple):
    """A contiguous byte range of the pool's ``buffer()`` (the worker turns it into a transfer region)."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


class KVPool:
    def __init__(self, layout: KVLayout, buffer: memoryview | None = None,
                 device: torch.device | str | None = None, caching: bool = True) -> None:
        """``buffer``: optional writable memory of exactly ``layout.total_bytes`` to hold the pool (e.g. a
        shared-memory segment from the shm transfer backend); it is zeroed here and must outlive the pool.
        ``device``: where the pool lives (default CPU); ``buffer`` is host memory, so CPU only.
        ``caching``: keep the blocks of ended requests for prefix reuse (``blocks``)."""
        self.layout = layout
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.staging = None  # kv_staging.HostStaging: the host copy a non-CPU pool's transfers go through
        if self.device.type != "cpu":
            if buffer is not None:
                raise ValueError(f"a KVPool on {self.device} cannot live in a host buffer (it stages through "
                                 "one instead: xpyd.worker.kv_staging)")
            self.tensor = torch.zeros(layout.shape, dtype=layout.torch_dtype, device=self.device)
        elif buffer is None:
            self.tensor = torch.zeros(layout.shape, dtype=layout.torch_dtype)
        else:
            if not isinstance(buffer, memoryview) or buffer.readonly or not buffer.c_contiguous:
                raise ValueError("KVPool buffer must be a writable, C-contiguous memoryview")
            if buffer.nbytes != layout.total_bytes:
                raise ValueError(f"KVPool buffer holds {buffer.nbytes} bytes, the layout needs {layout.total_bytes}")
            flat = torch.frombuffer(buffer.cast("B") if buffer.format != "B" else buffer, dtype=torch.uint8)
            self.tensor = flat.view(layout.torch_dtype).view(layout.shape)
            self.tensor.zero_()
        self.blocks = BlockAllocator(layout.num_blocks, caching=caching)

    def buffer(self) -> memoryview:
        """Writable uint8 view of the whole pool, sharing its memory (for the transfer engine).

        With a staging copy attached (a pool on a GPU), the view of that host copy instead."""
        if self.staging is not None:
            return self.staging.buffer()
        if self.device.type != "cpu":
            raise ValueError(f"the KV pool on {self.device} is not host memory: attach a host staging copy "
                             "first (the worker's kv_staging.stage_pool)")
        flat = self.tensor.view(-1).view(torch.uint8).numpy()  # numpy keeps the tensor alive
        return memoryview(flat)

    @property
    def num_used(self) -> int:
        """Blocks some request holds."""
        return self.blocks.num_referenced

    def used_bytes(self) -> int:
        return self.blocks.num_referenced * self.layout.block_bytes

    def byte_ranges(self, blocks: Sequence[int]) -> list[ByteRange]:
        """The bytes of ``blocks`` in order, runs of consecutive block ids coalesced into one range each."""
        return block_ranges(blocks, self.layout.block_bytes, self.layout.num_blocks)


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
