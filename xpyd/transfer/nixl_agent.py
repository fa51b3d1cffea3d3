"""One NIXL agent (UCX backend, no progress thread) as the nixl transfer backend uses it, and READ planning.

``load()`` imports NIXL or raises an ``ImportError`` that says how to install it; nothing here imports
NIXL at module import time, so ``xpyd.transfer.nixl_backend`` imports everywhere.

The agent is created with ``enable_prog_thread=False``: NIXL's progress thread polls UCX in a loop and
takes a whole core. UCX then progresses only inside our own calls: ``transfer`` / ``check_xfer_state``
on the side that reads, ``get_new_notifs`` on the side being read; ``progress`` makes both (who calls
it and when is ``nixl_progress``'s policy). The agent is not thread-safe in this mode
(``NIXL_THREAD_SYNC_NONE``), so every call goes through ``Agent``'s lock; ``progress(block=False)``
is the one call that never waits for it.

A posted READ is a ``Read``: its handle and last seen state, kept in the agent's set of posted READs
until ``release``, so that whoever makes progress also checks it and wakes the thread waiting on it.

``plan`` splits a transfer's ``src``/``dst`` regions into READ requests of at most ``chunk`` bytes,
each a list of ``(src offset, dst offset, length)`` pieces (pure; unit-tested without NIXL).

Loading a remote agent's metadata (``add_peer``) makes UCX endpoints to addresses its worker listed
when that agent started: one per network interface it had then (the list never changes). If UCX picks
one whose interface is gone since (UCX prefers the fastest, e.g. a 10 Gbit/s veth) and cannot connect,
the load fails with NIXL_ERR_BACKEND, and fails again at every attempt until that agent is remade
(``PeerUnreachable`` says so; retrying does not help). ``UCX_NET_DEVICES`` limits the interfaces UCX
uses, and so lists.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Sequence

import numpy as np

from xpyd.transfer.base import Region

log = logging.getLogger(__name__)

MISSING = ("the nixl KV backend needs NVIDIA NIXL, which is not installed: pip install 'xpyd[nixl]' "
           "(or, without pulling CUDA packages, pip install --no-deps nixl nixl-cu13); "
           "or use --kv-backend auto, tcp or shm")

Piece = tuple[int, int, int]  # (src offset, dst offset, length)
# Where a registered pool lives, as NIXL names it: (memory type, device id). Host memory is ("DRAM", 0);
# a pool in GPU memory is ("VRAM", CUDA device index): NIXL/UCX then READs device to device (never run on a GPU).
Memory = tuple[str, int]
HOST: Memory = ("DRAM", 0)
MEM_TYPES = ("DRAM", "VRAM")
PROC, DONE = "PROC", "DONE"  # NIXL's transfer states; anything else is "ERR ..." (ours) or NIXL's error


class PeerUnreachable(RuntimeError):
    """UCX could make no endpoint to a remote agent from its metadata (NIXL_ERR_BACKEND; see the module docstring)."""


def load():
    """The ``nixl._api`` module, or ``ImportError(MISSING)``. Quiets NIXL's INFO logging (it prints to stdout)."""
    try:
        from nixl import _api
    except ImportError as e:
        raise ImportError(f"{MISSING} ({e})") from None
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return _api


def plan(src: Sequence[Region], dst: Sequence[Region], chunk: int) -> list[list[Piece]]:
    """Walk ``src`` and ``dst`` (equal totals) in step; group the pieces into requests of <= ``chunk`` bytes."""
    if chunk <= 0:
        raise ValueError(f"chunk must be > 0, got {chunk}")
    if sum(r.length for r in src) != sum(r.length for r in dst):
        raise ValueError("src and dst regions hold different byte counts")
    requests: list[list[Piece]] = []
    current: list[Piece] = []
    room = chunk
    si = di = s_off = d_off = 0
    while si < len(src):
        s, d = src[si], dst[di]
        n = min(s.length - s_off, d.length - d_off, room)
        current.append((s.offset + s_off, d.offset + d_off, n))
        room -= n
        if room == 0:
            requests.append(current)
            current, room = [], chunk
        s_off += n
        d_off += n
        if s_off == s.length:
            si, s_off = si + 1, 0
        if d_off == d.length:
            di, d_off = di + 1, 0
    if current:
        requests.append(current)
    return requests


def memory_of(kind: str, device_index: int) -> Memory:
    """NIXL's name for a pool's memory: ``kind`` "cpu" (host) or "cuda" (GPU ``device_index``)."""
    if kind == "cpu":
        return HOST
    if kind == "cuda":
        return ("VRAM", device_index)
    raise ValueError(f"NIXL cannot register {kind!r} memory (host or CUDA only)")


def descs(pieces: Sequence[Piece], which: int, base: int, device: int = 0) -> np.ndarray:
    """NIXL descriptors ``(address, length, device id)`` of one side (``which``: 0 src, 1 dst) of ``pieces``."""
    out = np.zeros((len(pieces), 3), dtype=np.uint64)
    for i, p in enumerate(pieces):
        out[i, 0] = base + p[which]
        out[i, 1] = p[2]
    out[:, 2] = device
    return out


class Read:
    """One posted READ request. ``state`` is PROC until it ended (DONE or an error); ``wake`` is set when
    it ended or when a waiter is asked to check it itself (``kicked``: an abort waits for it)."""

    __slots__ = ("handle", "state", "wake", "kicked")

    def __init__(self, handle, state: str) -> None:
        self.handle = handle
        self.state = state
        self.wake = threading.Event()
        self.kicked = False


class Agent:
    """A NIXL agent with one registered buffer (host or GPU memory); every call is serialized by one lock."""

    def __init__(self, name: str) -> None:
        api = load()
        self._lock = threading.Lock()
        # READs in progress. Added and removed under both locks (so a holder of ``_lock`` never sees a
        # released handle); ``_posted_lock`` alone is enough to read it (``kick`` never waits for NIXL).
        self._posted: set[Read] = set()
        self._posted_lock = threading.Lock()
        config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
        self._agent = api.nixl_agent(name, config)
        if "UCX" not in self._agent.backends:
            raise RuntimeError("NIXL has no UCX backend plugin here; the nixl KV backend needs it")
        self.name = name
        # NIXL's error when its backend (UCX) fails, e.g. cannot connect to the address it chose
        self._backend_error = getattr(getattr(api, "nixlBind", None), "nixlBackendError", ())
        self._reg = None
        self._peers: dict[str, int] = {}  # loaded remote agent -> connections using it

    def _live(self):
        """The NIXL agent (caller holds the lock); raises once ``close()`` dropped it."""
        if self._agent is None:
            raise RuntimeError("the NIXL agent is closed")
        return self._agent

    def register(self, addr: int, size: int, memory: Memory = HOST) -> None:
        mem_type, device = memory
        with self._lock:
            self._reg = self._live().register_memory([(addr, size, device, "")], mem_type)

    def metadata(self) -> bytes:
        with self._lock:
            return self._live().get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        """Load a remote agent's metadata (once per agent, counted per connection); its name. Raises
        ``PeerUnreachable`` if UCX can make no endpoint to it, NIXL's error if NIXL refuses the metadata."""
        with self._lock:
            try:
                name = self._live().add_remote_agent(metadata)
            except self._backend_error as e:
                raise PeerUnreachable(
                    f"{e}: UCX could not connect to the agent; an address its metadata lists (one per network "
                    f"interface it had when it started) may be gone (UCX_NET_DEVICES limits the interfaces "
                    f"UCX uses)") from e
            name = name.decode() if isinstance(name, bytes) else name
            self._peers[name] = self._peers.get(name, 0) + 1
            return name

    def drop_peer(self, name: str) -> None:
        """Forget a remote agent when its last connection closed (also closes its UCX endpoints)."""
        with self._lock:
            left = self._peers.get(name, 0) - 1
            if left > 0:
                self._peers[name] = left
                return
            self._peers.pop(name, None)
            if self._agent is None:
                return
            try:
                self._agent.remove_remote_agent(name)
            except Exception as e:  # a dead peer's endpoint may already be gone
                log.debug("removing NIXL agent %s: %s", name, e)

    def read(self, peer: str, pieces: Sequence[Piece], src_base: int, dst_base: int,
             src_memory: Memory = HOST, dst_memory: Memory = HOST) -> Read:
        """Post one READ of ``pieces`` from ``peer``'s memory into ours (on one host UCX's cma often
        finishes it inside this call). ``release`` it once it ended or is given up."""
        with self._lock:
            agent = self._live()
            local = agent.get_xfer_descs(descs(pieces, 1, dst_base, dst_memory[1]), dst_memory[0])
            remote = agent.get_xfer_descs(descs(pieces, 0, src_base, src_memory[1]), src_memory[0])
            try:
                handle = agent.initialize_xfer("READ", local, remote, peer, b"")
            except Exception as e:
                return Read(None, f"ERR cannot create the READ: {e or type(e).__name__}")
            try:
                read = Read(handle, agent.transfer(handle))
            except Exception as e:
                read = Read(handle, f"ERR {e or type(e).__name__}")
            if read.state == PROC:
                with self._posted_lock:
                    self._posted.add(read)
            return read

    def check(self, read: Read) -> str:
        """Check one READ now (waits for the lock; also makes UCX progress); its state."""
        with self._lock:
            self._check(read)
        return read.state

    def progress(self, block: bool) -> bool:
        """Make UCX progress: pump the agent, check every posted READ and wake the waiter of each that
        ended. Without ``block``, False at once if another thread holds the agent (it is inside NIXL,
        so UCX is progressing anyway)."""
        if not self._lock.acquire(blocking=block):
            return False
        try:
            if self._agent is None:
                return True
            try:
                self._agent.get_new_notifs()
            except Exception as e:  # (e.g. a peer that died); its READs fail on their own check
                log.debug("NIXL get_new_notifs: %s", e)
            with self._posted_lock:
                posted = list(self._posted)
            for read in posted:
                self._check(read)
            return True
        finally:
            self._lock.release()

    def kick(self) -> None:
        """Ask every thread waiting on a posted READ to check it itself from now on (never waits for NIXL)."""
        with self._posted_lock:
            posted = list(self._posted)
        for read in posted:
            read.kicked = True
            read.wake.set()

    def release(self, read: Read) -> None:
        """Forget a READ and free its handle (NIXL cancels it if still active; if it cannot, NIXL keeps
        it until the agent goes)."""
        with self._lock:
            with self._posted_lock:
                self._posted.discard(read)
            if self._agent is None or read.handle is None:  # (dropped with the agent)
                return
            try:
                read.handle.release()
            except Exception as e:
                log.warning("releasing a NIXL transfer handle: %s", e)
            read.handle = None

    def _check(self, read: Read) -> None:
        """Update a posted READ's state (caller holds ``_lock``); an ended one leaves the posted set."""
        if read.state != PROC or read.handle is None:
            return
        try:
            read.state = self._live().check_xfer_state(read.handle)
        except Exception as e:  # e.g. nixlRemoteDisconnectError when the peer died
            read.state = f"ERR {e or type(e).__name__}"
        if read.state != PROC:
            with self._posted_lock:
                self._posted.discard(read)
            read.wake.set()

    def close(self) -> None:
        """Forget every peer, deregister the buffer, drop the agent (its UCX worker goes with it)."""
        with self._lock:
            if self._agent is None:
                return
            for name in list(self._peers):
                try:
                    self._agent.remove_remote_agent(name)
                except Exception as e:
                    log.debug("removing NIXL agent %s: %s", name, e)
            self._peers.clear()
            if self._reg is not None:
                try:
                    self._agent.deregister_memory(self._reg)
                except Exception as e:
                    log.warning("deregistering the KV pool from NIXL: %s", e)
                self._reg = None
            self._agent = None
            with self._posted_lock:
                posted, self._posted = self._posted, set()
        for read in posted:  # (their handles went with the agent)
            read.handle, read.state = None, "ERR the NIXL agent is closed"
            read.wake.set()
