"""The neuron KV transfer backend on real hardware: torch-neuronx's runtime behind ``neuron_backend``.

UNTESTED: torch-neuronx cannot be installed on the development and CI machines, so this module refuses to import
without it (a clear ImportError). Everything that can run without hardware (region planning into
tensors/offsets/lengths, communicator bookkeeping, completion tracking, the backend's state machine)
lives in ``neuron_plan`` / ``neuron_backend`` and is unit-tested with a fake runtime.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Sequence

ENV_FLAG = "NEURON_RT_ASYNC_SENDRECV_EXPERIMENTAL_ENABLED"
MISSING = ("the neuron KV backend needs torch-neuronx (AWS Neuron SDK) on a Trainium/Inferentia host; it is not "
           "installed here. Use --kv-backend tcp, shm or auto.")

if importlib.util.find_spec("torch_neuronx") is None:
    raise ImportError(MISSING)

from xpyd.transfer.neuron_backend import NeuronTransferBackend  # noqa: E402


class TorchNeuronRuntime:
    """The real runtime through torch-neuronx (import-guarded; never run on Neuron hardware)."""

    def __init__(self, core: int) -> None:
        if os.environ.get(ENV_FLAG) != "1":
            raise RuntimeError(f"the neuron KV backend needs {ENV_FLAG}=1 in the environment")
        import torch
        import torch_neuronx  # noqa: F401  (registers torch.ops.neuron / torch.classes.neuron)

        self._ops, self._classes = torch.ops.neuron, torch.classes.neuron
        self._engine = self._classes.NeuronTransferEngine(core)

    def init_core(self, core: int) -> None:
        self._ops._nrt_async_init_neuron(core)

    def create_comm(self, direction: str, remote_ip: str, peer_core: int, local_core: int) -> int:
        fn = self._ops._nrt_create_send_communicator if direction == "send" else \
            self._ops._nrt_create_recv_communicator
        return int(fn(remote_ip, peer_core, local_core))

    def test_comm(self, comm_id: int) -> bool:
        return bool(self._ops._nrt_test_communicator(comm_id))

    def new_token(self) -> object:
        return self._classes.CompletionToken()

    def queue(self, tensors, offsets, lengths, peer_devices, local_devices, comm_ids, completion_count, token,
              timeout) -> None:
        self._engine.queue_transfer_with_token(tensors, offsets, lengths, peer_devices, local_devices, comm_ids,
                                               completion_count, token, True, timeout)


def make_neuron_backend(tensors: Sequence[object], cores: Sequence[int], host: str, port: int,
                        **kw) -> NeuronTransferBackend:
    """The neuron backend over ``tensors`` (the KV pool's device tensors, ``cores[i]`` holding tensors[i])."""
    return NeuronTransferBackend(tensors, cores, host, port, runtime=TorchNeuronRuntime(int(cores[0])), **kw)
