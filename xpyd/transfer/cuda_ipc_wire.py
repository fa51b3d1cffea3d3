"""Control messages of the cuda_ipc transfer backend (the payload is one device copy per run, never on this socket).

Per connection (sender -> receiver, over TCP loopback, framed as in ``tcp_wire``: u32 length + msgpack)::

    Hello  {v, host, gpu, dev, h, size,   -> Reply {ok, error}  the receiver checks that the sender is on this
            soff, ref, roff, ev, sync,                          host (``host``: shm's host key) and on its own
            base, n, bseg}                                      GPU (``gpu``: the device's UUID), and keeps the
                                                                sender's pool handle (``Export``) and the name
                                                                of its abort board's segment for later
    per transfer, frames of ``shm_wire``:
    Offer  {id, src, dst, board, mac, ev} -> Reply {ok, error,  sent at once (not when the forward is done):
                                                    bye}        the receiver checks the MAC, opens the pool's
                                                                handle and maps the board (at the
                                                                connection's first offer that checks out),
                                                                prepares the copy, waits for the event ``ev``
                                                                (the forward that wrote src), copies src ->
                                                                dst on the device, and checks the board entry
                                                                (the sender did not abort meanwhile)

The handle fields are opaque bytes produced by torch (``_share_cuda_``), carried as msgpack ``bin``, capped
at ``MAX_HANDLE`` each, and only ever handed to torch's own opener (``_new_shared_cuda``), never unpickled.
"""

from __future__ import annotations

from dataclasses import dataclass

from xpyd.transfer.cuda_ipc_device import MAX_HANDLE, Export
from xpyd.transfer.shm_segment import SegmentError, check_name
from xpyd.transfer.shm_wire import MAX_FRAME, Offer, Reply  # noqa: F401  (re-exported)
from xpyd.transfer.tcp_wire import ProtocolError, pack_frame

MAX_TEXT = 512  # host key, device UUID


@dataclass(frozen=True, slots=True)
class Hello:
    version: int
    host: str  # shm_segment.host_key(): same host, same namespaces
    gpu: str  # UUID of the device the sender's pool is on
    export: Export
    board: str  # the shm segment that holds the sender's abort board (``shm_board``), alone

    def pack(self) -> bytes:
        e = self.export
        return pack_frame({"t": "hello", "v": self.version, "host": self.host, "gpu": self.gpu, "dev": e.device,
                           "h": e.handle, "size": e.storage_size, "soff": e.storage_offset, "ref": e.ref_handle,
                           "roff": e.ref_offset, "ev": e.event_handle, "sync": e.event_sync, "base": e.base,
                           "n": e.nbytes, "bseg": self.board})

    @classmethod
    def parse(cls, d: dict) -> "Hello":
        if d.get("t") != "hello" or type(d.get("v")) is not int:
            raise ProtocolError("expected a hello frame with an int version")
        for key in ("host", "gpu"):
            if not isinstance(d.get(key), str) or not 0 < len(d[key]) <= MAX_TEXT:
                raise ProtocolError(f"hello {key} must be a str of 1..{MAX_TEXT} chars")
        for key in ("h", "ref", "ev"):
            if type(d.get(key)) is not bytes or len(d[key]) > MAX_HANDLE:
                raise ProtocolError(f"hello {key} must be at most {MAX_HANDLE} bytes")
        try:
            export = Export(d.get("dev"), d["h"], d.get("size"), d.get("soff"), d["ref"], d.get("roff"), d["ev"],
                            d.get("sync"), d.get("base"), d.get("n"))
        except ValueError as e:
            raise ProtocolError(f"hello: {e}") from None
        if not export.handle:
            raise ProtocolError("hello carries no memory handle")
        try:
            board = check_name(d.get("bseg"))
        except SegmentError as e:
            raise ProtocolError(f"hello abort board: {e}") from None
        return cls(d["v"], d["host"], d["gpu"], export, board)
