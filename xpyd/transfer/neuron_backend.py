"""Neuron transfer backend logic, runtime injected (``neuron.py`` plugs in the real torch-neuronx runtime).

UNTESTED: torch-neuronx cannot be installed on the development and CI machines. The runtime calls below follow the
reference implementation; the bookkeeping around them (regions -> tensors/offsets/lengths,
communicators, completion tracking) lives in ``neuron_plan`` and is unit-tested, and this class is
tested against a fake runtime. The real runtime needs ``NEURON_RT_ASYNC_SENDRECV_EXPERIMENTAL_ENABLED=1``.

Runtime calls (``neuron.TorchNeuronRuntime``)::

    torch.ops.neuron._nrt_async_init_neuron(core)
    torch.ops.neuron._nrt_create_send_communicator(remote_ip, peer_core, local_core) -> comm id
    torch.ops.neuron._nrt_create_recv_communicator(remote_ip, peer_core, local_core) -> comm id
    torch.ops.neuron._nrt_test_communicator(comm id) -> ready?
    torch.classes.neuron.NeuronTransferEngine(core).queue_transfer_with_token(
        tensors, offsets, lengths, peer_devices, local_devices, comm_ids,
        completion_count, completion_token, use_queue, timeout)
    torch.classes.neuron.CompletionToken().is_done()

Both sides queue: the sender with send communicators, the receiver with receive communicators to
the sender, so a receive needs the sender (``expect_from``). Nothing runs in a thread: transfers
wait for their communicators and complete on ``poll()``, which every token poll and
``outstanding()`` call drives (the engine's loop).

Transfer secrets (``auth``) are taken and checked for shape like every backend's, but not used: the
runtime's communicators carry no proof of the sender we could add one to. A receive names its sender's
IP and cores, which is all the runtime lets us bind; see docs/transfer.md, "Who may write into a pool".
"""

from __future__ import annotations

import hashlib
import threading
from typing import Protocol, Sequence

from xpyd.transfer.auth import check_secret
from xpyd.transfer.base import (
    BackendDescriptor,
    CompletionToken,
    DerivedToken,
    Region,
    TransferError,
    check_buffer,
    check_regions,
    check_transfer_id,
)
from xpyd.transfer.neuron_plan import CommState, CommTable, DeviceTensor, Pending, TensorMap, Tracker, plan
from xpyd.transfer.tcp_wire import format_address, parse_address

CORES_OFFER = "neuron-cores"
LAYOUT_OFFER = "neuron-layout"
QUEUE_TIMEOUT = 30.0


class NeuronRuntime(Protocol):
    def init_core(self, core: int) -> None: ...
    def create_comm(self, direction: str, remote_ip: str, peer_core: int, local_core: int) -> int: ...
    def test_comm(self, comm_id: int) -> bool: ...
    def new_token(self) -> object: ...
    def queue(self, tensors: list, offsets: list[int], lengths: list[int], peer_devices: list[int],
              local_devices: list[int], comm_ids: list[int], completion_count: int, token: object,
              timeout: float) -> None: ...


def layout_hash(tensors: Sequence[DeviceTensor]) -> str:
    return hashlib.sha256(",".join(str(t.nbytes) for t in tensors).encode()).hexdigest()[:16]


class _PolledToken(DerivedToken):
    """A token that drives its backend's ``poll()`` whenever it is read."""

    __slots__ = ("_owner",)

    def __init__(self, transfer_id: str, owner: "NeuronTransferBackend") -> None:
        super().__init__(transfer_id)
        self._owner = owner

    def _sync(self) -> None:
        if not CompletionToken.finished(self):
            self._owner.poll()

    def _followed(self) -> list[CompletionToken]:
        return []  # polled (the backend's progress_tick), nothing to follow

    def wait(self, timeout: float) -> bool:
        import time

        deadline = time.monotonic() + timeout
        while not self.finished() and time.monotonic() < deadline:
            time.sleep(0.001)
        return self.finished()


class NeuronTransferBackend:
    name = "neuron"

    def same_host(self, peer: BackendDescriptor) -> bool:
        return False

    def __init__(self, tensors: Sequence[object], cores: Sequence[int], host: str, port: int,
                 runtime: NeuronRuntime, comm_timeout: float = 30.0,
                 queue_timeout: float = QUEUE_TIMEOUT) -> None:
        """``tensors``: the KV pool's device tensors in pool byte order; ``cores[i]``: the core of tensors[i]."""
        if len(tensors) != len(cores) or not tensors:
            raise ValueError("need one core per device tensor, and at least one tensor")
        self._tensors = list(tensors)
        self._map = TensorMap([DeviceTensor(int(c), _nbytes(t)) for t, c in zip(tensors, cores)])
        self.address = format_address(host, port)
        self.host = host
        self._runtime = runtime
        for core in sorted(set(int(c) for c in cores)):
            self._runtime.init_core(core)
        self._comms = CommTable(lambda k: self._runtime.create_comm(*k), self._runtime.test_comm, comm_timeout)
        self._tracker = Tracker()
        self._queue_timeout = queue_timeout
        self._lock = threading.RLock()
        self._descriptor: BackendDescriptor | None = None
        self._closed = False

    def register(self, buffer: memoryview) -> BackendDescriptor:
        """``buffer`` is the host view of the pool; its size must equal the device tensors' total."""
        buffer = check_buffer(buffer)
        if buffer.nbytes != self._map.nbytes:
            raise TransferError(f"pool holds {buffer.nbytes} bytes but the device tensors {self._map.nbytes}")
        with self._lock:
            if self._closed or self._descriptor is not None:
                raise TransferError("backend is closed or already registered")
            cores = ",".join(str(t.core) for t in self._map.tensors)
            offers = ((CORES_OFFER, cores[:512]), (LAYOUT_OFFER, layout_hash(self._map.tensors)))
            self._descriptor = BackendDescriptor(self.name, self.address, self._map.nbytes, offers=offers)
        return self._descriptor

    @property
    def descriptor(self) -> BackendDescriptor | None:
        return self._descriptor

    def _peer_map(self, peer: BackendDescriptor) -> tuple[str, TensorMap]:
        if not isinstance(peer, BackendDescriptor) or peer.backend != self.name:
            raise ValueError(f"peer must be a neuron BackendDescriptor, got {peer!r:.200}")
        if peer.offer(LAYOUT_OFFER) != layout_hash(self._map.tensors):
            raise ValueError("peer's device tensors are laid out differently (layout hash mismatch)")
        try:
            cores = [int(c) for c in (peer.offer(CORES_OFFER) or "").split(",")]
        except ValueError:
            raise ValueError("peer descriptor has a malformed neuron-cores offer") from None
        if len(cores) != len(self._map.tensors):
            raise ValueError("peer's core list does not match its tensors")
        ip, _ = parse_address(peer.address)
        return ip, TensorMap([DeviceTensor(c, t.nbytes) for c, t in zip(cores, self._map.tensors)])

    def _start(self, direction: str, transfer_id: str, regions: Sequence[Region], peer: BackendDescriptor,
               peer_regions: Sequence[Region]) -> CompletionToken:
        check_transfer_id(transfer_id)
        if self._descriptor is None:
            raise TransferError("register() a buffer first")
        ip, peer_map = self._peer_map(peer)
        regions, _ = check_regions(regions, self._map.nbytes, "local")
        peer_regions, _ = check_regions(peer_regions, peer.buffer_size, "peer")
        p = plan(self._map, regions, peer_map, peer_regions)
        with self._lock:
            if self._closed:
                raise TransferError("backend is closed")
            pairs = sorted(set(zip(p.peer_cores, p.local_cores)))
            keys = tuple(self._comms.get(direction, ip, pc, lc).key for pc, lc in pairs)
            token = _PolledToken(transfer_id, self)
            self._tracker.add(transfer_id, Pending(token, p, keys))
        self.poll()
        return token

    def send(self, transfer_id: str, src: Sequence[Region], peer: BackendDescriptor,
             dst: Sequence[Region], *, secret: bytes) -> CompletionToken:
        check_secret(secret)  # (not used: see the module docstring)
        return self._start("send", transfer_id, src, peer, dst)

    def expect_from(self, transfer_id: str, dst: Sequence[Region], peer: BackendDescriptor,
                    src: Sequence[Region], *, secret: bytes) -> CompletionToken:
        """Queue a receive of the peer's ``src`` into our ``dst`` (a Neuron receive names its sender)."""
        check_secret(secret)
        return self._start("recv", transfer_id, dst, peer, src)

    def expect(self, transfer_id: str, dst: Sequence[Region], *, secret: bytes) -> CompletionToken:
        raise TransferError("a neuron receive must name its sender: use expect_from(id, dst, peer, src)")

    def poll(self) -> None:
        """Move transfers along: communicators ready -> queue; runtime token done -> DONE."""
        with self._lock:
            self._comms.poll()
            for tid, pend in list(self._tracker.pending.items()):
                if pend.native is not None or CompletionToken.finished(pend.token):
                    continue
                comms = [self._comms.comms.get(k) for k in pend.comm_keys]
                failed = next((c for c in comms if c is None or c.state is CommState.FAILED), None)
                if failed is not None:
                    self._tracker.fail(tid, failed.error if failed else "communicator dropped")
                    continue
                if any(c.state is not CommState.READY for c in comms):
                    continue
                by_pair = {c.key[2:]: c.comm_id for c in comms}
                p = pend.plan
                native = self._runtime.new_token()
                try:
                    self._runtime.queue([self._tensors[i] for i in p.tensors], list(p.offsets), list(p.lengths),
                                        list(p.peer_cores), list(p.local_cores),
                                        [by_pair[(pc, lc)] for pc, lc in zip(p.peer_cores, p.local_cores)],
                                        len(p), native, self._queue_timeout)
                except Exception as e:  # the runtime refused: fail this transfer only
                    self._tracker.fail(tid, f"neuron queue_transfer_with_token failed: {e}")
                    continue
                self._tracker.queued(tid, native, self._queue_timeout)
            self._tracker.poll()

    progress_tick = 0.001  # completions are learned by polling the runtime

    def progress(self) -> None:
        """The engine's loop moves transfers along (what polling a token or ``outstanding()`` does too)."""
        self.poll()

    def abort(self, transfer_id: str) -> None:
        """Fail the token. A transfer the runtime already queued cannot be recalled; its bytes may still land."""
        with self._lock:
            self._tracker.fail(transfer_id, "aborted")

    def outstanding(self) -> set[str]:
        self.poll()
        with self._lock:
            return set(self._tracker.pending)

    def forget_peer(self, address: str) -> None:
        ip, _ = parse_address(address)
        with self._lock:
            self._comms.forget(ip)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for tid in list(self._tracker.pending):
                self._tracker.fail(tid, "backend closed")


def _nbytes(tensor: object) -> int:
    if hasattr(tensor, "untyped_storage") and hasattr(tensor, "element_size"):
        return int(tensor.numel() * tensor.element_size())
    return int(getattr(tensor, "nbytes"))
