"""The preallocated KV cache of one worker as a torch tensor, in fixed-size blocks (paged): a request holds a
list of blocks. The layout, byte ranges and the allocator are `kv_layout`'s (torch-free); this pool adds the
tensor the forward passes read and write: a view of host memory on the CPU, or a tensor on another device.

A pool on another device (a GPU) is not host memory: its `buffer()` is the host staging copy that
`xpyd.worker.kv_staging` attaches (same offsets), and the staging transfer wrapper copies each request's
region between the two.
"""

from __future__ import annotations

import torch

from xpyd.model.kv_blocks import BlockAllocator
from xpyd.model.kv_layout import (ELEMENT_BYTES, LAYOUT_NAME, QUANTIZED, ROW_SCALED, ByteRange, HostKVPool, KVLayout,
                                  PoolFull, _checked, block_ranges)

__all__ = ["LAYOUT_NAME", "ByteRange", "KVLayout", "KVPool", "PoolFull", "block_ranges", "dtype_name",
           "torch_dtype"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# an fp8 pool holds its codes as bytes (kv_quant reads them as torch's float8 types: a view, no copy); an int8
# pool its rows of codes and scale (kv_int8)
_STORED = {**_DTYPES, **{name: torch.uint8 for name in (*QUANTIZED, *ROW_SCALED)}}
assert set(_STORED) == set(ELEMENT_BYTES)


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}; expected one of {sorted(_DTYPES)}")


def torch_dtype(layout: KVLayout) -> torch.dtype:
    """The pool tensor's element type (uint8 for fp8 codes and int8 rows)."""
    return _STORED[layout.dtype]


class KVPool(HostKVPool):
    def __init__(self, layout: KVLayout, buffer: memoryview | None = None,
                 device: torch.device | str | None = None, caching: bool = True, zeroed: bool = False) -> None:
        """``buffer``: optional writable memory of exactly ``layout.total_bytes`` to hold the pool (e.g. a
        shared-memory segment from the shm transfer backend); it is zeroed here and must outlive the pool.
        ``device``: where the pool lives (default CPU); ``buffer`` is host memory, so CPU only.
        ``caching``: keep the blocks of ended requests for prefix reuse (``blocks``). ``zeroed``: ``buffer`` is
        known to hold zeros (a segment just created): not written again here."""
        self.layout = layout
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.staging = None  # kv_staging.HostStaging: the host copy a non-CPU pool's transfers go through
        dtype = torch_dtype(layout)
        if self.device.type != "cpu":
            if buffer is not None:
                raise ValueError(f"a KVPool on {self.device} cannot live in a host buffer (it stages through "
                                 "one instead: xpyd.worker.kv_staging)")
            self.tensor = torch.zeros(layout.shape, dtype=dtype, device=self.device)
        elif buffer is None:
            self.tensor = torch.zeros(layout.shape, dtype=dtype)
        else:
            flat = torch.frombuffer(_checked(buffer, layout), dtype=torch.uint8)
            self.tensor = flat.view(dtype).view(layout.shape)
            if not zeroed:
                self.tensor.zero_()
        self._memory = None
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
