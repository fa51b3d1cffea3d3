"""CUDA IPC transfer backend: KV moves device to device between two processes on one GPU, no host staging.

Both pools are CUDA tensors on one GPU. The sender connects to the receiver's listener (TCP loopback,
``cuda_ipc_wire``) and says Hello: host key, GPU UUID, its pool's CUDA IPC handle (``cuda_ipc_device``) and
its abort board's segment (``shm_board``); a sender on another host or GPU is refused. ``send()`` (on the
prefill engine's thread, right after the forward that writes ``src`` was enqueued) records an interprocess
event behind that forward, and the sender thread offers at once: ``src``, the MAC (``auth``), a board entry,
the event's handle. The receiver checks the MAC, claims what it ``expect``ed, opens the pool handle and maps
the board (at the connection's first offer that checks out: a stranger's handle is never opened), opens the
event and prepares the copy, all while the forward runs; then its connection's copier (``cuda_ipc_copier``)
sleeps on the event, copies the pieces on a stream of its own (after a mark ``expect()`` recorded on the
decode engine's stream), in batches of about ``COPY_BATCH`` bytes, each under the transfer's lock and fenced
(once ``abort()`` returns no more bytes land), checks the board (the sender had not aborted: its source was
valid) and marks DONE; the Reply tells the sender. One round trip, no byte through host memory. The reader
thread gives up on a wait that outlives the receiver's interest, the sender's connection or ``io_timeout``
(a wait on the event of a dead process never ends). The sender keeps an offered event alive until its
reply (one that never came: until ``close``). docs/transfer.md "cuda_ipc" has the whole story.

``backend.stamps = Stamps()`` notes each stage's ``time.perf_counter_ns()`` on both sides
(``cuda_ipc_stamps``; ``scripts/gpu/transfer_bench.py`` prints them); off by default.
Threads (daemon; shared with shm and nixl through ``endpoint``): an acceptor, one reader per inbound
connection and its copier, one sender per peer.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from collections import deque
from queue import SimpleQueue
from typing import Sequence

from xpyd import PROTOCOL_VERSION
from xpyd.cluster_tokens import check_accepted_tokens
from xpyd.netaddr import listen_tcp
from xpyd.transfer import auth, shm_board, shm_segment
from xpyd.transfer.base import (
    BackendDescriptor,
    CompletionToken,
    Region,
    TransferError,
    check_send_regions,
    check_transfer_id,
)
from xpyd.transfer.cuda_ipc_copier import PeerPool
from xpyd.transfer.cuda_ipc_device import CudaOps, DeviceError, DeviceOps
from xpyd.transfer.cuda_ipc_kernel import FEW_RUNS, batches, piece_table, pieces  # noqa: F401  (re-exported)
from xpyd.transfer.cuda_ipc_receive import COPY_BATCH, Receive  # noqa: F401  (COPY_BATCH re-exported)
from xpyd.transfer.cuda_ipc_stamps import Stamps
from xpyd.transfer.cuda_ipc_wire import MAX_FRAME, Hello, Offer, Reply
from xpyd.transfer.endpoint import Endpoint
from xpyd.transfer.listener import Door
from xpyd.transfer.pull import offer_on_board, serve_offers
from xpyd.transfer.shm_board import Board
from xpyd.transfer.sender import connect, send_loop
from xpyd.transfer.table import Transfer
from xpyd.transfer.tcp_wire import Closing, Conn, ProtocolError, Unproven, format_address, parse_address

log = logging.getLogger(__name__)

HOST_OFFER = "cuda_ipc-host"  # descriptor offers: the host key ...
GPU_OFFER = "cuda_ipc-gpu"  # ... and the GPU's UUID (a sender refuses a peer on another GPU before connecting)
MAX_INBOUND = 256
HELD_MARKS = 1024  # offered events whose reply never came, kept alive (a receiver may still wait on them)
_boards = itertools.count()


def _setup(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class CudaIpcTransferBackend:
    name = "cuda_ipc"
    # The pool is registered as it is (a CUDA tensor), never staged through host memory (kv_staging).
    registers_device_memory = True
    registers_tensor = True

    def same_host(self, peer: BackendDescriptor) -> bool:
        return True

    def __init__(self, host: str = "127.0.0.1", port: int = 0, connect_timeout: float = 5.0,
                 io_timeout: float = 30.0, advertise_host: str | None = None, cluster_token: str | None = None,
                 accepted_tokens: tuple[str, ...] = (),
                 ops: DeviceOps | None = None) -> None:
        """``ops``: the device operations (default ``CudaOps``: refuses without CUDA); ``cluster_token``: the
        workers' shared token, or None; it keys every transfer's MAC together with the transfer's secret."""
        if type(port) is not int or not 0 <= port < 65536:
            raise ValueError(f"port must be an int in 0..65535, got {port!r}")
        if not connect_timeout > 0 or not io_timeout > 0:
            raise ValueError("connect_timeout and io_timeout must be > 0")
        if advertise_host is None and host in ("", "0.0.0.0", "::"):
            raise ValueError(f"binding to {host!r} needs advertise_host (the address peers connect to)")
        self._ops = ops if ops is not None else _cuda_ops()
        self.host, self.port = host, port
        self.advertise_host = advertise_host or host
        self.connect_timeout, self.io_timeout = connect_timeout, io_timeout
        self.host_key = shm_segment.host_key()
        self._cluster_token = auth.check_cluster_token(cluster_token)
        self._accepted_tokens = check_accepted_tokens(accepted_tokens)  # (rotation)
        self._endpoint = Endpoint()
        self._door = Door()
        self._nbytes = 0  # of the registered pool; 0 until register()
        self._gpu = ""
        self._marks: dict[str, object] = {}  # expected transfer id -> the decode engine's mark at expect()
        self._sent_marks: dict[str, tuple] = {}  # transfer id being sent -> (the forward's shared mark, handle)
        self._held: deque = deque(maxlen=HELD_MARKS)  # offered marks whose reply never came
        self._marks_lock = threading.Lock()
        self._board_seg: shm_segment.Segment | None = None  # (sender) made at the first connection
        self._board: Board | None = None
        self._descriptor: BackendDescriptor | None = None
        self.stamps: Stamps | None = None  # where each transfer's time goes (``Stamps``), when set
        self._receive = Receive(self._ops, self, self._drop_mark)

    # -- public API -------------------------------------------------------
    def register(self, pool) -> BackendDescriptor:
        """Register the KV pool: the pool tensor on a CUDA device (``HostOps``: host memory)."""
        with self._endpoint.lock:
            self._endpoint.check_open()
            if self._nbytes:
                raise TransferError("a buffer is already registered with this backend")
            nbytes = self._ops.attach(pool)
            self._gpu = self._ops.uuid()
            listener = listen_tcp(self.host, self.port)
            self._endpoint.listen(listener)
            self._nbytes = nbytes
            address = format_address(self.advertise_host, listener.getsockname()[1])
            self._descriptor = BackendDescriptor(self.name, address, nbytes,
                                                 offers=((HOST_OFFER, self.host_key), (GPU_OFFER, self._gpu)))
            self._endpoint.start_acceptor(self.name, self._serve, _setup, MAX_INBOUND, log)
        log.info("cuda_ipc: KV pool of %d bytes on GPU %s registered (device-to-device copies)", nbytes, self._gpu)
        return self._descriptor

    @property
    def descriptor(self) -> BackendDescriptor | None:
        return self._descriptor

    def reaches(self, peer: BackendDescriptor) -> bool:
        """True if ``peer`` offers cuda_ipc on this host and this GPU."""
        return (peer.offer(self.name) is not None and peer.offer(HOST_OFFER) == self.host_key
                and peer.offer(GPU_OFFER) == self._gpu)

    def send(self, transfer_id: str, src: Sequence[Region], peer: BackendDescriptor,
             dst: Sequence[Region], *, secret: bytes) -> CompletionToken:
        """Queue a transfer; call it on the thread whose stream wrote ``src`` (its mark orders the copy)."""
        if self.stamps is not None:
            self.stamps(transfer_id, "send")
        check_transfer_id(transfer_id)
        key = auth.transfer_key(secret, self._cluster_token)
        if not isinstance(peer, BackendDescriptor) or peer.offer(self.name) is None:
            raise ValueError(f"peer must offer cuda_ipc, got {peer!r:.200}")
        if peer.offer(HOST_OFFER) != self.host_key:
            raise ValueError("peer is not on this host (another host or network namespace): cuda_ipc cannot "
                             "reach it; use nixl or tcp")
        nbytes = self._require_pool()
        if peer.offer(GPU_OFFER) != self._gpu:
            raise ValueError(f"peer's pool is on GPU {peer.offer(GPU_OFFER)!r:.80}, ours on {self._gpu!r}: "
                             "cuda_ipc copies within one GPU only; use nixl or tcp")
        address = peer.offer(self.name)
        parse_address(address)
        src, dst, total = check_send_regions(src, nbytes, dst, peer.buffer_size)
        job = Transfer(CompletionToken(transfer_id), src, total, dst, key=key)
        mark = self._ops.shared_mark()
        with self._marks_lock:
            self._sent_marks[transfer_id] = mark
        try:
            self._endpoint.send(job, address, self._start_sender)
        except BaseException:
            with self._marks_lock:
                self._sent_marks.pop(transfer_id, None)
            raise
        return job.token

    def expect(self, transfer_id: str, dst: Sequence[Region], *, secret: bytes) -> CompletionToken:
        check_transfer_id(transfer_id)
        key, accepted = auth.receive_keys(secret, self._cluster_token, self._accepted_tokens)
        mark = self._ops.mark()
        with self._marks_lock:
            self._marks[transfer_id] = mark
        try:
            return self._endpoint.expect(transfer_id, dst, self._require_pool(), key, accepted)
        except BaseException:
            self._drop_mark(transfer_id, mark)
            raise

    @property
    def refused(self) -> int:
        """Offers refused so far (no or a wrong MAC, an id not expected, ...)."""
        return self._endpoint.refused

    @property
    def unproven(self) -> int:
        """Inbound connections closed before they opened a transfer (``listener.Door``)."""
        return self._door.dropped

    @property
    def stuck_waits(self) -> int:
        """Waits on a sender's event given up before it passed (its process died, or a forward too long)."""
        return self._receive.stuck_waits

    def abort(self, transfer_id: str) -> None:
        self._endpoint.abort(transfer_id)  # (waits out an in-progress copy batch; none follows)
        if self._board is not None:  # after its token failed: a receiver that has not confirmed yet fails
            self._board.revoke(transfer_id)
        self._drop_mark(transfer_id)
        with self._marks_lock:
            self._sent_marks.pop(transfer_id, None)

    def outstanding(self) -> set[str]:
        return self._endpoint.outstanding()

    progress_tick = None  # the receiver's threads copy the bytes; tokens wake the engine when finished

    def progress(self) -> None:
        """Nothing to do: the receiver's reader threads copy the bytes."""

    def forget_peer(self, address: str) -> None:
        self._endpoint.forget_peer(address)

    def close(self) -> None:
        if self._endpoint.close(join_timeout=self.connect_timeout + 5):
            with self._marks_lock:
                self._marks.clear()
                self._sent_marks.clear()
                self._held.clear()
            self._ops.close()
        if self._board_seg is not None:
            self._board_seg.unlink()  # (its mapping stays valid until the process exits)

    # -- internals --------------------------------------------------------
    def _require_pool(self) -> int:
        if not self._nbytes:
            raise TransferError("register() a buffer first")
        return self._nbytes

    def _drop_mark(self, transfer_id: str, mark: object | None = None) -> object | None:
        with self._marks_lock:
            if mark is None or self._marks.get(transfer_id) is mark:
                return self._marks.pop(transfer_id, None)
        return None

    # -- receiver ---------------------------------------------------------
    def _serve(self, sock: socket.socket, addr) -> None:
        conn = self._door.enter(sock, addr, self._endpoint.wake[0], self.io_timeout, 2, log)
        peer = None
        try:
            hello = Hello.parse(conn.read_frame(MAX_FRAME, first_byte_timeout=self.io_timeout) or {})
            error = None
            if hello.version != PROTOCOL_VERSION:
                error = f"protocol version {hello.version} != {PROTOCOL_VERSION}"
            elif hello.host != self.host_key:
                error = "sender is not on this host (another host or network namespace)"
            elif hello.gpu != self._gpu:
                error = f"sender's pool is on GPU {hello.gpu}, ours on {self._gpu}: cuda_ipc copies within one GPU"
            conn.send_all([memoryview(Reply(error is None, error).pack())])
            if error is not None:
                log.warning("refused cuda_ipc peer %s: %s", addr, error)
                return
            peer = PeerPool(hello)  # opened at the first offer whose MAC checks out
            serve_offers(conn, self._endpoint, self.name, hello.export.nbytes, self._nbytes,
                         lambda rec, offer: self._receive.copy(rec, peer, offer, conn),
                         _confirmed, log, addr)
        except (Closing, Unproven):
            return
        except (ProtocolError, OSError) as e:
            log.warning("dropping cuda_ipc connection from %s: %s", addr, e)
        except Exception:
            log.exception("dropping cuda_ipc connection from %s", addr)
        finally:
            if peer is not None and peer.copier is not None:
                peer.copier.close(join_timeout=1.0)  # (before the process may exit with it mid-CUDA-call)
            conn.close()

    # -- sender -----------------------------------------------------------
    def _start_sender(self, address: str, queue: SimpleQueue) -> None:
        self._endpoint.threads.start(send_loop, f"xpyd-cuda_ipc-send-{address}", address, queue, self._connect,
                                     self._push, self._endpoint.sending, log)

    def _connect(self, address: str) -> Conn:
        board = self._board_name()
        conn = connect(address, self._endpoint.wake[0], _setup, self.connect_timeout, self.io_timeout)
        try:
            hello = Hello(PROTOCOL_VERSION, self.host_key, self._gpu, self._ops.export(), board)
            conn.send_all([memoryview(hello.pack())])
            reply = Reply.parse(conn.read_frame(MAX_FRAME))
            if not reply.ok:
                raise ConnectionError(f"refused: {reply.error}")
            log.info("cuda_ipc transfer: connected to %s; it copies from our pool on GPU %s", address, self._gpu)
            return conn
        except BaseException:
            conn.sock.close()
            raise

    def _board_name(self) -> str:
        """The abort board's segment, made at the first connection (a worker that never sends has none)."""
        with self._marks_lock:
            if self._board_seg is None:
                seg = shm_segment.create(shm_board.BYTES, f"cuda_ipc-board-{next(_boards)}")
                self._board, self._board_seg = Board(seg.mapping, 0), seg
            return self._board_seg.name

    def _push(self, conn: Conn, job: Transfer, address: str) -> None:
        tid, stamps = job.token.transfer_id, self.stamps
        with self._marks_lock:
            mark, handle = self._sent_marks.pop(tid, (None, None))  # (gone: aborted before it was offered)
        if handle is None:
            return
        # offered at once, the forward maybe still running: the receiver waits for its event
        offer_on_board(conn, job, self._board, lambda entry: Offer(
            tid, job.regions, job.dst, entry, auth.transfer_mac(job.key, self.name, tid, job.dst, job.regions),
            handle), address, _no_stamp if stamps is None else lambda stage: stamps(tid, stage),
            lambda: self._held.append(mark))  # (no reply: the receiver may still wait on its event)


def _no_stamp(stage: str) -> None:
    pass


def _confirmed(conn: Conn, rec: Transfer, offer: Offer) -> bool:
    """``serve_offers``' confirm: the copying thread checked the board and finished the token already."""
    return True


def _cuda_ops() -> DeviceOps:
    try:
        return CudaOps()
    except DeviceError as e:
        raise ValueError(f"--kv-backend cuda_ipc: {e}") from None
    except ImportError as e:
        raise ImportError(f"--kv-backend cuda_ipc needs torch with CUDA: {e}") from None
