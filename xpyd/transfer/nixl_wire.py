"""Control messages of the nixl transfer backend (the payload moves by NIXL READ, never over this socket).

Per connection (sender -> receiver, over TCP, framed as in ``tcp_wire``: u32 length + msgpack)::

    Hello  {v, agent, md, addr, size,    -> Reply {ok, error}   the receiver loads the sender's NIXL agent
            mem, dev}                                           metadata (``md``: bytes from
                                                                ``get_agent_metadata``) and learns where the
                                                                sender's registered pool starts (``addr``)
                                                                and in which memory (``mem`` "DRAM" or
                                                                "VRAM", ``dev`` its device id)
    per transfer, frames of ``shm_wire`` (but no abort board: nixl confirms by a second round trip):
    Offer  {id, src, dst}                -> Reply {ok, error}   the receiver READ src -> dst (or why not)
    Commit {id, ok}                      -> Reply {ok, error}   ok=False: the sender aborted meanwhile;
                                                                the receiver marks DONE only on ok

The agent metadata is opaque bytes produced by NIXL; it is carried as a msgpack ``bin``, capped at
``MAX_METADATA``, and only ever handed to NIXL's own parser (``add_remote_agent``), never unpickled.
"""

from __future__ import annotations

from dataclasses import dataclass

from xpyd.transfer.nixl_agent import HOST, MEM_TYPES, Memory
from xpyd.transfer.shm_wire import MAX_FRAME, Commit, Offer, Reply  # noqa: F401  (re-exported)
from xpyd.transfer.tcp_wire import ProtocolError, pack_frame

MAX_METADATA = 256 << 10  # a UCX agent's metadata is ~0.5 KiB over shared memory/TCP, a few KiB with RDMA
MAX_AGENT_NAME = 256
MAX_DEVICE = 1 << 16


@dataclass(frozen=True, slots=True)
class Hello:
    version: int
    agent: str  # the sender's NIXL agent name
    metadata: bytes  # the sender's NIXL agent metadata
    addr: int  # address of the sender's registered buffer (NIXL descriptors are absolute addresses)
    size: int  # bytes of that buffer
    memory: Memory = HOST  # where that buffer lives, as NIXL names it: ("DRAM", 0) or ("VRAM", device)

    def pack(self) -> bytes:
        return pack_frame({"t": "hello", "v": self.version, "agent": self.agent, "md": self.metadata,
                           "addr": self.addr, "size": self.size, "mem": self.memory[0], "dev": self.memory[1]})

    @classmethod
    def parse(cls, d: dict) -> "Hello":
        if d.get("t") != "hello" or type(d.get("v")) is not int:
            raise ProtocolError("expected a hello frame with an int version")
        agent, md, addr, size = d.get("agent"), d.get("md"), d.get("addr"), d.get("size")
        if not isinstance(agent, str) or not 0 < len(agent) <= MAX_AGENT_NAME:
            raise ProtocolError(f"hello agent must be a str of 1..{MAX_AGENT_NAME} chars")
        if not isinstance(md, bytes) or not 0 < len(md) <= MAX_METADATA:
            raise ProtocolError(f"hello md must be 1..{MAX_METADATA} bytes")
        if type(addr) is not int or addr <= 0 or type(size) is not int or size <= 0 or addr + size >= 1 << 64:
            raise ProtocolError("hello addr/size invalid")
        mem, dev = d.get("mem"), d.get("dev")
        if mem not in MEM_TYPES or type(dev) is not int or not 0 <= dev < MAX_DEVICE:
            raise ProtocolError(f"hello mem must be one of {MEM_TYPES} with an int dev in 0..{MAX_DEVICE - 1}")
        return cls(d["v"], agent, md, addr, size, (mem, dev))
