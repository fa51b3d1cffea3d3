"""One NIXL agent (UCX backend, no progress thread) as the nixl transfer backend uses it, and READ planning.

``load()`` imports NIXL or raises an ``ImportError`` that says how to install it; nothing here imports
NIXL at module import time, so ``xpyd.transfer.nixl_backend`` imports everywhere.

The agent is created with ``enable_prog_thread=False``: NIXL's progress thread polls UCX in a loop and
takes a whole core. UCX then progresses only inside our own calls (``transfer`` / ``check_xfer_state``
on the side that reads, ``get_new_notifs`` in ``pump`` on the side being read), which the backend
makes while a transfer of its own is in flight. The agent is not thread-safe in this mode
(``NIXL_THREAD_SYNC_NONE``), so every call goes through ``Agent``'s lock.

``plan`` splits a transfer's ``src``/``dst`` regions into READ requests of at most ``chunk`` bytes,
each a list of ``(src offset, dst offset, length)`` pieces (pure; unit-tested without NIXL).
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


def _descs(pieces: Sequence[Piece], which: int, base: int) -> np.ndarray:
    out = np.zeros((len(pieces), 3), dtype=np.uint64)  # (address, length, device id 0 = host memory)
    for i, p in enumerate(pieces):
        out[i, 0] = base + p[which]
        out[i, 1] = p[2]
    return out


class Agent:
    """A NIXL agent with one registered host buffer; every call is serialized by one lock."""

    def __init__(self, name: str) -> None:
        api = load()
        self._lock = threading.Lock()
        config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
        self._agent = api.nixl_agent(name, config)
        if "UCX" not in self._agent.backends:
            raise RuntimeError("NIXL has no UCX backend plugin here; the nixl KV backend needs it")
        self.name = name
        self._reg = None
        self._peers: dict[str, int] = {}  # loaded remote agent -> connections using it

    def _live(self):
        """The NIXL agent (caller holds the lock); raises once ``close()`` dropped it."""
        if self._agent is None:
            raise RuntimeError("the NIXL agent is closed")
        return self._agent

    def register(self, addr: int, size: int) -> None:
        with self._lock:
            self._reg = self._live().register_memory([(addr, size, 0, "")], "DRAM")

    def metadata(self) -> bytes:
        with self._lock:
            return self._live().get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        """Load a remote agent's metadata (once per agent, counted per connection); its name."""
        with self._lock:
            name = self._live().add_remote_agent(metadata)
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

    def read(self, peer: str, pieces: Sequence[Piece], src_base: int, dst_base: int):
        """Post one READ of ``pieces`` from ``peer``'s memory into ours; (handle, "DONE"|"PROC"|"ERR ...")."""
        with self._lock:
            agent = self._live()
            local = agent.get_xfer_descs(_descs(pieces, 1, dst_base), "DRAM")
            remote = agent.get_xfer_descs(_descs(pieces, 0, src_base), "DRAM")
            try:
                handle = agent.initialize_xfer("READ", local, remote, peer, b"")
            except Exception as e:
                return None, f"ERR cannot create the READ: {e or type(e).__name__}"
            try:
                return handle, agent.transfer(handle)
            except Exception as e:
                return handle, f"ERR {e or type(e).__name__}"

    def state(self, handle) -> str:
        """"DONE", "PROC" or "ERR ..." of a posted READ (also makes UCX progress)."""
        with self._lock:
            try:
                return self._live().check_xfer_state(handle)
            except Exception as e:  # e.g. nixlRemoteDisconnectError when the peer died
                return f"ERR {e or type(e).__name__}"

    def release(self, handle) -> None:
        """Free a READ handle (NIXL cancels it if still active; if it cannot, NIXL keeps it until the agent goes)."""
        with self._lock:
            if self._agent is None:  # (dropped with the agent)
                return
            try:
                handle.release()
            except Exception as e:
                log.warning("releasing a NIXL transfer handle: %s", e)

    def pump(self) -> None:
        """Make UCX progress for transfers others run against our memory (connection set-up, emulated RMA)."""
        with self._lock:
            if self._agent is not None:
                self._agent.get_new_notifs()

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
