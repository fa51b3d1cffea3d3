"""Transfer engine: move KV-pool byte regions between workers (see base.py for the interface).

Backends are chosen by name; each is imported only when asked for, so an optional
backend's dependencies are never needed by a worker that does not use it.

May import: pyzmq, msgpack, numpy, the optional backends' libraries (NIXL, torch-neuronx), the standard
library and the leaf modules; no model, no worker, no role.
"""

from __future__ import annotations

import importlib

from xpyd.transfer.base import (
    BackendDescriptor,
    CompletionToken,
    DeviceMemory,
    Region,
    TransferBackend,
    TransferError,
    TransferState,
)

# name -> (module, class)
_BACKENDS = {
    "tcp": ("xpyd.transfer.tcp", "TcpTransferBackend"),
    "fake": ("xpyd.transfer.fake", "FakeTransferBackend"),
    "shm": ("xpyd.transfer.shm", "ShmTransferBackend"),
    "auto": ("xpyd.transfer.auto", "make_auto_backend"),
    "neuron": ("xpyd.transfer.neuron", "make_neuron_backend"),  # needs torch-neuronx; never run on Neuron hardware
    "nixl": ("xpyd.transfer.nixl_backend", "NixlTransferBackend"),  # needs NIXL (pip install xpyd[nixl])
    "cuda_ipc": ("xpyd.transfer.cuda_ipc", "CudaIpcTransferBackend"),  # needs torch with CUDA; one GPU, one host
}


def make_backend(name: str, **kw) -> TransferBackend:
    """Build the backend registered under ``name`` with its constructor keywords."""
    try:
        module, cls = _BACKENDS[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(_BACKENDS))
        raise ValueError(f"unknown transfer backend {name!r}; known: {known}") from None
    return getattr(importlib.import_module(module), cls)(**kw)


__all__ = [
    "BackendDescriptor",
    "CompletionToken",
    "DeviceMemory",
    "Region",
    "TransferBackend",
    "TransferError",
    "TransferState",
    "make_backend",
]
