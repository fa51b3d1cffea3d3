"""Pure bookkeeping for the neuron transfer backend (no torch-neuronx needed; unit-tested here).

The Neuron runtime moves bytes between *device tensors*: one call queues a list of
``(tensor, offset, length)`` pieces, each with the peer's and our Neuron core and the communicator
id for that core pair, plus a completion token. This module turns the backend interface's byte
``Region``s (of the KV pool seen as its device tensors laid end to end) into those lists, keeps the
communicator table, and tracks completion tokens. ``neuron.py`` feeds the lists to the runtime.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Sequence

from xpyd.transfer.base import CompletionToken, Region, TransferState

MAX_PIECES = 1 << 16  # pieces per queued transfer; more is a caller bug (regions far too fragmented)


@dataclass(frozen=True, slots=True)
class DeviceTensor:
    """One KV tensor on a Neuron core, as ``nbytes`` bytes of the pool's byte space."""

    core: int  # local Neuron core that holds it
    nbytes: int

    def __post_init__(self) -> None:
        if type(self.core) is not int or self.core < 0 or type(self.nbytes) is not int or self.nbytes <= 0:
            raise ValueError(f"invalid device tensor core={self.core!r} nbytes={self.nbytes!r}")


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """Arguments of one ``queue_transfer_with_token`` call (tensors as indexes into the registered list)."""

    tensors: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    local_cores: tuple[int, ...]
    peer_cores: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def __len__(self) -> int:
        return len(self.tensors)


class TensorMap:
    """The registered device tensors laid end to end: pool byte offset -> (tensor, offset in it)."""

    def __init__(self, tensors: Sequence[DeviceTensor]) -> None:
        if not tensors:
            raise ValueError("no device tensors")
        self.tensors = tuple(tensors)
        self.starts: list[int] = []
        pos = 0
        for t in self.tensors:
            self.starts.append(pos)
            pos += t.nbytes
        self.nbytes = pos

    def split(self, region: Region) -> list[tuple[int, int, int]]:
        """``region`` as (tensor index, offset in tensor, length) pieces, in order."""
        if region.end > self.nbytes:
            raise ValueError(f"region [{region.offset}, {region.end}) outside the {self.nbytes}-byte tensors")
        out, pos = [], region.offset
        i = bisect.bisect_right(self.starts, pos) - 1
        while pos < region.end:
            t_end = self.starts[i] + self.tensors[i].nbytes
            n = min(region.end, t_end) - pos
            out.append((i, pos - self.starts[i], n))
            pos += n
            i += 1
        return out


def plan(local: TensorMap, regions: Sequence[Region], peer: TensorMap, peer_regions: Sequence[Region]) -> TransferPlan:
    """Pair our ``regions`` with the peer's ``peer_regions`` byte for byte.

    Each piece lies within one local tensor and one peer tensor, so the runtime moves it in one
    descriptor; offsets/lengths are *local* (the runtime addresses the peer's copy of the same piece
    through the communicator of the core pair). Both sides must hold the same layout at the same
    places, so the peer offset of each piece must equal the local one: a layout mismatch raises.
    """
    ours = [p for r in regions for p in local.split(r)]
    theirs = [p for r in peer_regions for p in peer.split(r)]
    if sum(p[2] for p in ours) != sum(p[2] for p in theirs):
        raise ValueError("local and peer regions hold different byte counts")
    tensors, offsets, lengths, lcores, pcores = [], [], [], [], []
    qi = qo = pi = po = 0
    while qi < len(ours):
        lt, loff, llen = ours[qi]
        pt, poff, plen = theirs[pi]
        n = min(llen - qo, plen - po)
        if lt != pt or loff + qo != poff + po:
            raise ValueError(f"local piece (tensor {lt}, offset {loff + qo}) does not match the peer's "
                             f"(tensor {pt}, offset {poff + po}); both pools must share one layout")
        tensors.append(lt)
        offsets.append(loff + qo)
        lengths.append(n)
        lcores.append(local.tensors[lt].core)
        pcores.append(peer.tensors[pt].core)
        qo += n
        po += n
        if qo == llen:
            qi, qo = qi + 1, 0
        if po == plen:
            pi, po = pi + 1, 0
        if len(tensors) > MAX_PIECES:
            raise ValueError(f"transfer needs more than {MAX_PIECES} pieces")
    return TransferPlan(tuple(tensors), tuple(offsets), tuple(lengths), tuple(lcores), tuple(pcores))


# -- communicators ------------------------------------------------------------------------


class CommState(Enum):
    CONNECTING = "connecting"
    READY = "ready"
    FAILED = "failed"


_COMM_NEXT = {CommState.CONNECTING: {CommState.READY, CommState.FAILED}, CommState.READY: {CommState.FAILED},
              CommState.FAILED: set()}


@dataclass(slots=True)
class Comm:
    key: tuple[str, str, int, int]  # (direction "send"|"recv", peer ip, peer core, local core)
    comm_id: int
    started: float
    state: CommState = CommState.CONNECTING
    error: str | None = None

    def move(self, state: CommState, error: str | None = None) -> None:
        if state not in _COMM_NEXT[self.state]:
            raise ValueError(f"illegal communicator transition {self.state.name} -> {state.name}")
        self.state, self.error = state, error


@dataclass
class CommTable:
    """Communicators per (direction, peer ip, peer core, local core), created once and polled until ready.

    ``create(key) -> comm id`` and ``test(comm id) -> bool`` are the runtime's calls; a communicator not
    ready within ``timeout`` seconds fails (and a later ``get`` creates a new one).
    """

    create: Callable[[tuple[str, str, int, int]], int]
    test: Callable[[int], bool]
    timeout: float = 30.0
    clock: Callable[[], float] = time.monotonic
    comms: dict[tuple[str, str, int, int], Comm] = field(default_factory=dict)

    def get(self, direction: str, peer_ip: str, peer_core: int, local_core: int) -> Comm:
        if direction not in ("send", "recv"):
            raise ValueError(f"direction must be send or recv, not {direction!r}")
        key = (direction, peer_ip, peer_core, local_core)
        comm = self.comms.get(key)
        if comm is None or comm.state is CommState.FAILED:
            comm = self.comms[key] = Comm(key, self.create(key), self.clock())
        return comm

    def poll(self) -> None:
        for comm in self.comms.values():
            if comm.state is not CommState.CONNECTING:
                continue
            if self.test(comm.comm_id):
                comm.move(CommState.READY)
            elif self.clock() - comm.started > self.timeout:
                comm.move(CommState.FAILED, f"communicator {comm.key} not ready within {self.timeout:g}s")

    def forget(self, peer_ip: str) -> list[Comm]:
        gone = [k for k in self.comms if k[1] == peer_ip]
        return [self.comms.pop(k) for k in gone]


# -- completion tracking --------------------------------------------------------------------


@dataclass(slots=True)
class Pending:
    token: CompletionToken
    plan: TransferPlan
    comm_keys: tuple[tuple[str, str, int, int], ...]
    native: object | None = None  # the runtime's completion token once queued (has is_done())
    deadline: float = 0.0


class Tracker:
    """Our CompletionTokens, advanced from the runtime's tokens on ``poll()`` (the engine's step)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.pending: dict[str, Pending] = {}

    def add(self, transfer_id: str, p: Pending) -> None:
        if transfer_id in self.pending:
            raise ValueError(f"transfer {transfer_id!r} is already outstanding")
        self.pending[transfer_id] = p

    def queued(self, transfer_id: str, native: object, timeout: float) -> None:
        p = self.pending[transfer_id]
        p.native, p.deadline = native, self.clock() + timeout
        p.token._advance(TransferState.TRANSFERRING)

    def poll(self) -> list[str]:
        """Advance finished/timed-out transfers; the ids that finished."""
        done = []
        for tid, p in list(self.pending.items()):
            if CompletionToken.finished(p.token):  # (not the subclass: it would poll again)
                del self.pending[tid]
                done.append(tid)
            elif p.native is not None and p.native.is_done():
                p.token._advance(TransferState.DONE)
                del self.pending[tid]
                done.append(tid)
            elif p.native is not None and self.clock() > p.deadline:
                p.token._fail("neuron transfer timed out")
                del self.pending[tid]
                done.append(tid)
        return done

    def fail(self, transfer_id: str, error: str) -> None:
        p = self.pending.pop(transfer_id, None)
        if p is not None:
            p.token._fail(error)
