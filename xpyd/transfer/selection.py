"""Which transfer backend a prefill/decode worker runs (``--kv-backend``), and where its KV pool lives.

- ``tcp``: sockets, any host. ``shm``: shared memory, both workers on one host (the prefill pool
  lives in a /dev/shm segment). ``neuron``: needs torch-neuronx and a pool in Neuron device memory
  (never run on Neuron hardware; refuses to start). ``nixl``: NVIDIA NIXL over UCX, any host (needs ``pip install
  xpyd[nixl]``; without it the worker refuses to start and says so). ``cuda_ipc``: both workers' pools on
  one GPU (``--device cuda[:N]`` on both), the receiver copies device to device through a CUDA IPC handle of
  the sender's pool; refuses to start on a CPU pool or without CUDA.
- ``auto`` (default): tcp plus shm. The worker's descriptor is its tcp one and also offers shm with
  its host key; the *sending* (prefill) side picks shm when the receiver offers it on the same host,
  tcp otherwise. If no segment can be created (no /dev/shm, too small), ``auto`` runs tcp only.

Peers must agree on the descriptor's backend name: ``auto`` and ``tcp`` workers interoperate (both
advertise ``tcp``); an ``shm``-only worker talks only to ``shm`` workers, likewise nixl / neuron.
"""

from __future__ import annotations

import os

from xpyd.transfer import make_backend

KV_BACKENDS = ("auto", "tcp", "shm", "nixl", "neuron", "cuda_ipc")


def check_kv_backend(name: str) -> str:
    if name not in KV_BACKENDS:
        raise ValueError(f"--kv-backend must be one of {', '.join(KV_BACKENDS)}, not {name!r}")
    return name


def kv_copy_threads(requested: int, engine_threads: int, device: str, cpus: int | None = None) -> int:
    """Threads that copy one large shm transfer into a worker's pool (``--kv-copy-threads``; 0 = auto).

    Auto: 2 when a core is left beside the engine's threads (or the model runs on a GPU, so the cores are
    free), else 1. On a 2-core host with the decode engine on both cores, a second copy thread cost
    3-4% output tokens/s and ~1 ms of ITL p50 in the prefill-stall benchmark (docs/transfer.md), while
    with a spare core it halves a 16 MiB copy."""
    if requested:
        return requested
    if cpus is None:
        cpus = len(os.sched_getaffinity(0))
    return 2 if device != "cpu" or cpus > engine_threads else 1


def make_worker_backend(name: str, host: str, port: int, advertise_host: str | None, copy_threads: int = 1,
                        cluster_token: str | None = None, stall_timeout: float | None = None,
                        device: str | None = None, lanes: int = 1, accepted_tokens: tuple[str, ...] = ()):
    """The backend a worker runs for ``--kv-backend name``, listening on ``host:port`` (``copy_threads``:
    shm's receiving copy, see ``kv_copy_threads``; ``cluster_token``: keys the transfers' MACs, see
    ``auth``; ``accepted_tokens``: transfers MACed with these are received too (a rotation window);
    ``stall_timeout``: tcp (and nixl control) connections whose peer acknowledges nothing for this
    long fail, see ``tcp.fail_when_stalled``; None: the backend's default; ``device``: the worker's
    ``--device``, which cuda_ipc checks before the model loads; ``lanes``: tcp and shm's transfers moving to one
    peer at once, ``--kv-lanes``, see ``sender``)."""
    check_kv_backend(name)
    common = {"host": host, "port": port, "advertise_host": advertise_host, "cluster_token": cluster_token,
              "accepted_tokens": accepted_tokens}
    stall = {} if stall_timeout is None else {"stall_timeout": stall_timeout}  # (tcp/nixl: shm is one host)
    tag = str(port) if port else None  # shm's segment is named xpyd-kv-<pid>-<kv port> when the port is fixed
    if name == "tcp":
        return make_backend(name, **common, **stall, lanes=lanes)
    if name == "nixl":  # (an ImportError naming the pip command when NIXL is missing)
        return make_backend(name, **common, **stall)
    if name == "shm":
        return make_backend(name, **common, tag=tag, copy_threads=copy_threads, lanes=lanes)
    if name == "cuda_ipc":  # (loopback control connections: no stall timeout, as shm)
        if device is not None and not device.startswith("cuda"):
            raise ValueError(f"--kv-backend cuda_ipc copies between pools on one GPU: it needs --device cuda[:N] "
                             f"on both workers, not --device {device}")
        return make_backend(name, **common)
    if name == "auto":
        return make_backend(name, **common, tag=tag, copy_threads=copy_threads, **stall, lanes=lanes)
    if name == "neuron":
        import xpyd.transfer.neuron  # noqa: F401  (a clear ImportError without torch-neuronx)

        raise NotImplementedError("--kv-backend neuron needs the KV pool in Neuron device memory, which the "
                                  "workers do not allocate yet (device-agnostic engine); see docs/transfer.md")
    raise ValueError(f"unhandled --kv-backend {name!r}")
