"""NIXL transfer backend: the receiver READs a request's KV straight out of the sender's pool (one-sided).

Both sides register their whole KV pool with a NIXL agent (UCX backend, see ``nixl_agent``). A
transfer is pulled, with the same control channel as shm (``nixl_wire``, TCP, length-prefixed
msgpack): the sender connects to the receiver's listener (the descriptor's address) and says Hello
with its agent metadata and pool address; per transfer it offers its ``src`` regions with a MAC that
proves it holds the transfer's secret (``auth``), the *receiver* checks it, claims the transfer it
``expect``ed, loads the sender's agent metadata (at the connection's first offer that checks out: a
stranger's is never loaded) and posts NIXL READs from the sender's pool into its own ``dst``
regions (16 MiB per request, each under the transfer's lock, so once ``abort()`` returns no more bytes
land), replies, and the sender commits (its source stayed valid) before the receiver marks DONE.
UCX moves the bytes: over shared memory (cma) on one host, RDMA or TCP between hosts. A pool on a GPU is
registered as it is (``DeviceMemory`` -> NIXL ``VRAM``) and each side's Hello says where its pool lives, so
READs name both sides' memory. Ordering with the engines' CUDA streams, as cuda_ipc's: ``send()`` (called on
the prefill engine's thread right after the forward that wrote the KV) records a CUDA event on the current
stream, and the sender offers only once it completed, so the receiver never READs KV still being written;
``expect()`` records one on the decode engine's stream, and the receiver's first READ waits for it (the
destination blocks' earlier users are done with them). A host pool has no marks.

No NIXL progress thread (it spins a core). UCX progresses inside our own calls, and the engine's loop
makes them: ``progress()`` (every engine iteration while a transfer is in flight; never waits) pumps
the agent and checks the posted READs. The backend's threads block on their sockets and READs and step
in only when no ``progress()`` came for ``fallback_progress`` seconds, or when an ``abort``/``close``
waits for a READ (policy: ``nixl_progress``). Idle, nothing runs.

Threads (daemon, started by ``register``/first ``send``, joined by ``close``; shared with tcp and shm
through ``endpoint``): an acceptor, one reader per inbound connection, one sender per peer. A control
connection whose peer acknowledges nothing for ``stall_timeout`` (a cut link) fails in the kernel, as tcp's.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from functools import partial
from queue import SimpleQueue
from typing import Sequence

import numpy as np

from xpyd import PROTOCOL_VERSION
from xpyd.cluster_tokens import check_accepted_tokens
from xpyd.netaddr import listen_tcp
from xpyd.transfer import auth
from xpyd.transfer.base import (
    BackendDescriptor,
    CompletionToken,
    DeviceMemory,
    Region,
    TransferError,
    TransferState,
    check_buffer,
    check_send_regions,
    check_transfer_id,
)
from xpyd.transfer.endpoint import Endpoint
from xpyd.transfer.listener import Door
from xpyd.transfer.pull import commit_round_trip, offer_and_commit, serve_offers
from xpyd.transfer.nixl_agent import HOST, Agent, Memory, load, memory_of, plan
from xpyd.transfer.nixl_progress import FALLBACK, Progress
from xpyd.transfer.nixl_wire import MAX_FRAME, Hello, Offer, Reply
from xpyd.transfer.sender import connect, send_loop
from xpyd.transfer.table import Transfer
from xpyd.transfer.tcp import STALL_TIMEOUT, fail_when_stalled
from xpyd.transfer.tcp_wire import Closing, Conn, ProtocolError, Unproven, format_address, parse_address

log = logging.getLogger(__name__)

READ_CHUNK = 16 << 20  # bytes per NIXL READ request, i.e. per lock hold (abort latency vs. overhead)
MAX_INBOUND = 256


def _setup(sock: socket.socket, stall_timeout: float = STALL_TIMEOUT) -> None:
    """A control connection: offers and replies (the bytes move by NIXL READs). One whose peer went silent (a
    cut link) fails after ``stall_timeout``, as tcp's do (``tcp.fail_when_stalled``)."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    fail_when_stalled(sock, stall_timeout)


class NixlTransferBackend:
    name = "nixl"

    def same_host(self, peer: BackendDescriptor) -> bool:
        return False

    def __init__(self, host: str = "127.0.0.1", port: int = 0, connect_timeout: float = 5.0,
                 io_timeout: float = 30.0, advertise_host: str | None = None,
                 fallback_progress: float | None = FALLBACK, cluster_token: str | None = None,
                 accepted_tokens: tuple[str, ...] = (),
                 stall_timeout: float = STALL_TIMEOUT) -> None:
        """``fallback_progress``: seconds without a ``progress()`` call after which the backend's own
        threads make UCX progress (None: never; then only ``progress()`` and aborts do). ``cluster_token``:
        the workers' shared token, or None; it keys every transfer's MAC with the transfer's secret.
        ``stall_timeout``: a control connection whose peer acknowledges nothing this long fails."""
        load()  # a clear ImportError (how to install NIXL) before anything else
        if type(port) is not int or not 0 <= port < 65536:
            raise ValueError(f"port must be an int in 0..65535, got {port!r}")
        if not connect_timeout > 0 or not io_timeout > 0 or not stall_timeout > 0:
            raise ValueError("connect_timeout, io_timeout and stall_timeout must be > 0")
        if advertise_host is None and host in ("", "0.0.0.0", "::"):
            raise ValueError(f"binding to {host!r} needs advertise_host (the address peers connect to)")
        if fallback_progress is not None and not fallback_progress > 0:
            raise ValueError(f"fallback_progress must be > 0 seconds or None, got {fallback_progress!r}")
        self.host, self.port = host, port
        self.fallback_progress = fallback_progress
        self._cluster_token = auth.check_cluster_token(cluster_token)
        self._accepted_tokens = check_accepted_tokens(accepted_tokens)  # (rotation)
        self.advertise_host = advertise_host or host
        self.connect_timeout, self.io_timeout = connect_timeout, io_timeout
        self.stall_timeout = stall_timeout
        self._setup = partial(_setup, stall_timeout=stall_timeout)
        self._endpoint = Endpoint()
        self._door = Door()
        self._agent: Agent | None = None
        self._progress: Progress | None = None
        self._buffer: memoryview | DeviceMemory | None = None
        self._addr = 0  # address of the registered buffer
        self._memory: Memory = HOST  # where it lives, as NIXL names it
        self._descriptor: BackendDescriptor | None = None
        self._marker: _CudaMarks | None = None  # a pool on a GPU: stream order with the engine (docstring)
        self._marks: dict[tuple[str, str], object] = {}  # ("send"|"expect", transfer id) -> its CUDA event
        self._marks_lock = threading.Lock()

    # -- public API -------------------------------------------------------
    # A pool in GPU memory is registered as it is (NIXL VRAM), not staged through host memory.
    registers_device_memory = True

    def register(self, buffer: memoryview | DeviceMemory) -> BackendDescriptor:
        """Register the KV pool: host memory (a memoryview) or a CUDA pool (``DeviceMemory``; never run on a GPU)."""
        marker = None
        if isinstance(buffer, DeviceMemory):
            addr, memory = buffer.address, memory_of(buffer.kind, buffer.device_index)
            marker = _CudaMarks(buffer.device_index)
        else:
            buffer = check_buffer(buffer)
            addr, memory = np.frombuffer(buffer, dtype=np.uint8).ctypes.data, HOST
        with self._endpoint.lock:
            self._endpoint.check_open()
            if self._buffer is not None:
                raise TransferError("a buffer is already registered with this backend")
            agent = Agent(f"xpyd-{os.getpid()}-{secrets.token_hex(6)}")
            try:
                agent.register(addr, buffer.nbytes, memory)
                listener = listen_tcp(self.host, self.port)
            except BaseException:
                agent.close()
                raise
            self._endpoint.listen(listener)
            self._agent, self._buffer, self._addr, self._memory = agent, buffer, addr, memory
            self._marker = marker
            self._progress = Progress(agent, self.fallback_progress)
            address = format_address(self.advertise_host, listener.getsockname()[1])
            self._descriptor = BackendDescriptor(self.name, address, buffer.nbytes)
            self._endpoint.start_acceptor(self.name, self._serve, self._setup, MAX_INBOUND, log)
        return self._descriptor

    @property
    def descriptor(self) -> BackendDescriptor | None:
        return self._descriptor

    def send(self, transfer_id: str, src: Sequence[Region], peer: BackendDescriptor,
             dst: Sequence[Region], *, secret: bytes) -> CompletionToken:
        check_transfer_id(transfer_id)
        key = auth.transfer_key(secret, self._cluster_token)
        if not isinstance(peer, BackendDescriptor) or peer.offer(self.name) is None:
            raise ValueError(f"peer must offer nixl, got {peer!r:.200}")
        address = peer.offer(self.name)
        parse_address(address)
        buffer = self._require_buffer()
        src, dst, total = check_send_regions(src, buffer.nbytes, dst, peer.buffer_size)
        job = Transfer(CompletionToken(transfer_id), src, total, dst, key=key)
        mark = self._mark("send", transfer_id)
        try:
            self._endpoint.send(job, address, self._start_sender)
        except BaseException:
            self._take_mark("send", transfer_id, mark)
            raise
        self._forget_mark_when_finished("send", job.token)
        return job.token

    def expect(self, transfer_id: str, dst: Sequence[Region], *, secret: bytes) -> CompletionToken:
        check_transfer_id(transfer_id)
        key, accepted = auth.receive_keys(secret, self._cluster_token, self._accepted_tokens)
        size = self._require_buffer().nbytes
        mark = self._mark("expect", transfer_id)
        try:
            token = self._endpoint.expect(transfer_id, dst, size, key, accepted)
        except BaseException:
            self._take_mark("expect", transfer_id, mark)
            raise
        self._forget_mark_when_finished("expect", token)
        return token

    @property
    def refused(self) -> int:
        """Offers refused so far (no or a wrong MAC, an id not expected, ...)."""
        return self._endpoint.refused

    @property
    def unproven(self) -> int:
        """Inbound connections closed before they opened a transfer: no Hello and offer within the
        listener's deadline, or evicted by newer ones (``listener.Door``)."""
        return self._door.dropped

    def abort(self, transfer_id: str) -> None:
        if self._agent is not None:
            self._agent.kick()  # readers with a READ posted (one may hold this transfer's lock) check it now
        self._endpoint.abort(transfer_id)  # (waits out an in-progress READ request; none follows)

    progress_tick = 0.001  # UCX moves bytes inside progress(): the engine calls it this often

    def progress(self) -> None:
        """Make UCX progress for our transfers (the engine's loop); never waits for a backend thread."""
        if self._progress is not None:
            self._progress.tick()

    def outstanding(self) -> set[str]:
        return self._endpoint.outstanding()

    def forget_peer(self, address: str) -> None:
        self._endpoint.forget_peer(address)

    def close(self) -> None:
        if self._agent is not None:
            self._agent.kick()
        if self._endpoint.close(join_timeout=self.connect_timeout + 5) and self._agent is not None:
            self._agent.close()
        with self._marks_lock:
            self._marks.clear()

    # -- internals --------------------------------------------------------
    def _mark(self, side: str, transfer_id: str) -> object | None:
        """A pool on a GPU: record where the calling thread's stream is now (see the module docstring)."""
        if self._marker is None:
            return None
        mark = self._marker.mark()
        with self._marks_lock:
            self._marks[(side, transfer_id)] = mark
        return mark

    def _forget_mark_when_finished(self, side: str, token: CompletionToken) -> None:
        """Drop the transfer's mark once ``token`` finished (DONE, FAILED, aborted) if it was never waited for."""
        if self._marker is not None:
            token.on_finish(partial(self._take_mark, side, token.transfer_id))

    def _take_mark(self, side: str, transfer_id: str, mark: object | None = None) -> object | None:
        """Forget the transfer's mark (only if it is ``mark``, when given); the mark forgotten, or None."""
        with self._marks_lock:
            if mark is None or self._marks.get((side, transfer_id)) is mark:
                return self._marks.pop((side, transfer_id), None)
            return None

    def _wait_mark(self, side: str, transfer_id: str) -> None:
        """Wait until the engine's work before ``send()``/``expect()`` of ``transfer_id`` finished on the device."""
        mark = self._take_mark(side, transfer_id)
        if mark is not None:
            self._marker.wait(mark)

    def _require_buffer(self) -> memoryview | DeviceMemory:
        if self._buffer is None:
            raise TransferError("register() a buffer first")
        return self._buffer

    # -- receiver ---------------------------------------------------------
    def _serve(self, sock: socket.socket, addr) -> None:
        # A sender says Hello and offers its first transfer right after it connects: both must come
        # at once (``Door``); once an offer opened a transfer, the connection may wait for the next.
        conn = self._door.enter(sock, addr, self._endpoint.wake[0], self.io_timeout, 2, log)
        peer: _PeerAgent | None = None
        try:
            hello = Hello.parse(conn.read_frame(MAX_FRAME, first_byte_timeout=self.io_timeout) or {})
            error = None
            if hello.version != PROTOCOL_VERSION:
                error = f"protocol version {hello.version} != {PROTOCOL_VERSION}"
            conn.send_all([memoryview(Reply(error is None, error).pack())])
            if error is not None:
                log.warning("refused nixl peer %s: %s", addr, error)
                return
            peer = _PeerAgent(hello)  # loaded at the first offer whose MAC checks out
            serve_offers(conn, self._endpoint, self.name, hello.size, self._buffer.nbytes,
                         lambda rec, offer: self._read(rec, peer, offer), commit_round_trip, log, addr)
        except (Closing, Unproven):  # (the door counts and logs the unproven)
            return
        except (ProtocolError, OSError) as e:
            log.warning("dropping nixl connection from %s: %s", addr, e)
        except Exception:
            log.exception("dropping nixl connection from %s", addr)
        finally:
            if peer is not None and peer.name is not None:
                self._agent.drop_peer(peer.name)
            conn.close()

    def _read(self, rec: Transfer, peer: "_PeerAgent", offer: Offer) -> str | None:
        """READ the offer's src into the claimed transfer's dst, request by request; None or why it failed.
        The first call on a connection loads the sender's agent metadata."""
        if peer.name is None:
            try:
                peer.name = self._agent.add_peer(peer.hello.metadata)
            except Exception as e:  # NIXL rejects it, or UCX cannot reach the sender (PeerUnreachable)
                error = f"cannot load the sender's NIXL metadata: {e or type(e).__name__}"
                rec.token._fail(error)
                return error
        self._wait_mark("expect", offer.transfer_id)  # (the decode engine is done with the dst blocks)
        rec.token._advance(TransferState.TRANSFERRING)
        for pieces in plan(offer.src, rec.regions, READ_CHUNK):
            with rec.lock:
                if rec.token.finished():
                    return f"transfer {offer.transfer_id!r} aborted by the receiver"
                error = self._read_one(peer.name, pieces, peer.hello)
                if error is not None:
                    rec.token._fail(error)
                    return error
        return None

    def _read_one(self, peer: str, pieces, src: Hello) -> str | None:
        read = self._agent.read(peer, pieces, src.addr, self._addr, src.memory, self._memory)
        try:
            return self._progress.wait_read(read, self.io_timeout, lambda: self._endpoint.closed)
        finally:
            self._agent.release(read)

    # -- sender -----------------------------------------------------------
    def _start_sender(self, address: str, queue: SimpleQueue) -> None:
        self._endpoint.threads.start(send_loop, f"xpyd-nixl-send-{address}", address, queue, self._connect,
                                     self._push, self._endpoint.sending, log)

    def _reply(self, conn: Conn) -> Reply:
        """The peer's next reply (meanwhile it may be READing from us: see ``nixl_progress``)."""
        self._progress.wait_reply(conn, self.io_timeout)
        return Reply.parse(conn.read_frame(MAX_FRAME))

    def _connect(self, address: str) -> Conn:
        conn = connect(address, self._endpoint.wake[0], self._setup, self.connect_timeout, self.io_timeout)
        try:
            hello = Hello(PROTOCOL_VERSION, self._agent.name, self._agent.metadata(), self._addr,
                          self._buffer.nbytes, self._memory)
            conn.send_all([memoryview(hello.pack())])
            reply = self._reply(conn)
            if not reply.ok:
                raise ConnectionError(f"refused: {reply.error}")
            log.info("nixl transfer: connected to %s as NIXL agent %s", address, self._agent.name)
            return conn
        except BaseException:
            conn.sock.close()
            raise

    def _push(self, conn: Conn, job: Transfer, address: str) -> None:
        tid = job.token.transfer_id
        self._wait_mark("send", tid)  # (the forward that wrote the source finished on the device)
        if not job.token._advance(TransferState.TRANSFERRING):
            return
        mac = auth.transfer_mac(job.key, self.name, tid, job.dst, job.regions)
        offer_and_commit(conn, job, memoryview(Offer(tid, job.regions, job.dst, mac=mac).pack()), address,
                         self._reply)


class _CudaMarks:
    """CUDA events on a device's current stream: ``mark()`` on the engine's thread, ``wait()`` on a backend thread."""

    def __init__(self, device_index: int) -> None:
        import torch

        self._torch, self._device = torch, torch.device("cuda", device_index)

    def mark(self) -> object:
        event = self._torch.cuda.Event()
        event.record(self._torch.cuda.current_stream(self._device))
        return event

    def wait(self, mark) -> None:
        # (on a backend thread: also makes the pool's device current there, where NIXL/UCX then touch its memory)
        self._torch.cuda.set_device(self._device)
        mark.synchronize()


class _PeerAgent:
    """The sender's NIXL agent as its Hello describes it; ``name`` once loaded (``add_peer``), which the
    first offer that checks out does: a stranger's metadata is never handed to NIXL."""

    __slots__ = ("hello", "name")

    def __init__(self, hello: Hello) -> None:
        self.hello = hello
        self.name: str | None = None
