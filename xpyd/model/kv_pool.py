"""The preallocated KV cache of one worker, in slots of `max_seq_len` tokens (one request per slot).

Shape `[num_slots, max_seq_len, num_layers, 2 (K/V), num_kv_heads, head_dim]`: token-major inside a
slot, so a request's KV for its first n tokens is ONE contiguous byte range of the pool. The transfer
engine sends or receives that range straight from/into the pool (`buffer()` + `byte_range()`), no staging.

The pool lives on a torch device (CPU by default). A pool on another device (a GPU) is not host memory:
its `buffer()` is the host staging copy that `xpyd.worker.kv_staging` attaches (same offsets), and the
staging transfer wrapper copies each request's region between the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

LAYOUT_NAME = "slot-token-major/1"

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
    num_slots: int
    max_seq_len: int

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; expected one of {sorted(_DTYPES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "num_slots", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_slots, self.max_seq_len, self.num_layers, 2, self.num_kv_heads, self.head_dim)

    @property
    def token_bytes(self) -> int:
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem

    @property
    def slot_bytes(self) -> int:
        return self.max_seq_len * self.token_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def compat(self) -> dict:
        """What must match between a prefill and a decode worker for KV bytes to mean the same thing."""
        return {
            "layout": LAYOUT_NAME,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
        }


class ByteRange(NamedTuple):
    """A contiguous byte range of the pool's ``buffer()`` (the worker turns it into a transfer region)."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


class PoolFull(Exception):
    """No free slot: the caller should wait until a request finishes."""


class KVPool:
    def __init__(self, layout: KVLayout, buffer: memoryview | None = None,
                 device: torch.device | str | None = None) -> None:
        """``buffer``: optional writable memory of exactly ``layout.total_bytes`` to hold the pool (e.g. a
        shared-memory segment from the shm transfer backend); it is zeroed here and must outlive the pool.
        ``device``: where the pool lives (default CPU); ``buffer`` is host memory, so CPU only."""
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
        self._free = list(range(layout.num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._tokens: dict[int, int] = {}  # allocated slot -> tokens held

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
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._tokens)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise PoolFull(f"all {self.layout.num_slots} KV slots are in use")
        slot = self._free.pop()
        self._tokens[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self._check_allocated(slot)
        del self._tokens[slot]
        self._free.append(slot)

    def set_num_tokens(self, slot: int, n: int) -> None:
        self._check_allocated(slot)
        if not 0 <= n <= self.layout.max_seq_len:
            raise ValueError(f"slot {slot}: {n} tokens outside [0, {self.layout.max_seq_len}]")
        self._tokens[slot] = n

    def num_tokens(self, slot: int) -> int:
        self._check_allocated(slot)
        return self._tokens[slot]

    def used_bytes(self) -> int:
        return sum(self._tokens.values()) * self.layout.token_bytes

    def byte_range(self, slot: int, num_tokens: int) -> ByteRange:
        """The bytes of the KV for positions [0, num_tokens) of `slot`: one contiguous region."""
        self._check_allocated(slot)
        if not 1 <= num_tokens <= self.layout.max_seq_len:
            raise ValueError(f"region of {num_tokens} tokens outside [1, {self.layout.max_seq_len}]")
        return ByteRange(slot * self.layout.slot_bytes, num_tokens * self.layout.token_bytes)

    def _check_allocated(self, slot: int) -> None:
        if slot not in self._tokens:
            if isinstance(slot, int) and 0 <= slot < self.layout.num_slots:
                raise ValueError(f"KV slot {slot} is not allocated (double free?)")
            raise ValueError(f"KV slot {slot!r} does not exist (pool has {self.layout.num_slots})")
