"""What a decode worker asks and tells its prefill workers, and when (used by the engine thread alone).

Three kinds of lookup entries go to a prefill worker, and releases:

- a *pull* (a destination for the KV) for each request the scheduler gave blocks to: all of them, kept
  until the prefill worker's connection is ready;
- a *claim* (no destination) for each new request, at once: the prefill worker pushes ``notify`` when it
  is ready or ended there;
- a safety *re-ask* (no destination) about a claimed request the prefill worker has not given its last
  word on (not ready yet, or its KV still coming), ``SAFETY_REASK`` seconds after the last news of it: a
  notify lost on the way (a ROUTER at its high-water mark drops it) costs that long, not the request;
- a *release* (the request ended here: its KV there can go), at once, or, while the connection to that
  prefill worker is still being made (a request aborted as soon as it came), as soon as it is ready: a
  release lost would keep the KV there until its kv_ttl.

Claims and re-asks wait while a lookup to that prefill worker is in flight (one at a time), at most
``m.MAX_ENTRIES`` per lookup. Each prefill worker's entries go in as many lookups as the signal plane's
limits need (``lookup_frames``).
"""

from __future__ import annotations

from collections import Counter

from xpyd.decode_worker.scheduler import DecodeScheduler
from xpyd.decode_worker.seq import DecodeSeq
from xpyd.signal import messages as m
from xpyd.signal.client import PeerState, PrefillPeer, SignalClient

SAFETY_REASK = 5.0  # seconds a claimed request waits without news before it is asked about again
# Bytes of encoded pull entries in one lookup: well under the signal plane's frame cap, with room for the
# envelope (a msgpack int takes at most 5 bytes; an entry's id, secret and fields at most ENTRY_BYTES more).
FRAME_BUDGET = m.MAX_FRAME_BYTES // 2
ENTRY_BYTES = 64


class Lookups:
    """The pulls and releases still to send, by prefill worker, and when each claimed request was last asked
    about or heard of (with how many claims and re-asks went out, for stats)."""

    def __init__(self) -> None:
        self._pulls: dict[str, list[m.LookupEntry]] = {}  # prefill worker -> pulls not sent yet
        self._releases: dict[str, list[str]] = {}  # prefill worker (connecting) -> ids to release once ready
        self._asked: dict[str, float] = {}  # claimed request id -> when it was last asked about or heard of
        self.claims = 0  # requests claimed at their prefill worker
        self.status_polls = 0  # safety re-asks about claimed requests (no news for SAFETY_REASK)

    @property
    def pending_pulls(self) -> int:
        return sum(len(entries) for entries in self._pulls.values())

    def pull(self, addr: str, entry: m.LookupEntry) -> None:
        """Send this pull to prefill worker ``addr`` (at the next ``send`` its connection is ready for)."""
        self._pulls.setdefault(addr, []).append(entry)

    def drop(self, addr: str) -> None:
        """The connection to prefill worker ``addr`` failed or was closed: its pulls not sent yet are dropped
        (the engine fails their requests), and its releases (its session ended: what it claimed is freed
        there; the rest expires)."""
        self._pulls.pop(addr, None)
        self._releases.pop(addr, None)

    def release(self, signal: SignalClient, addr: str, request_ids: list[str]) -> None:
        """Tell prefill worker ``addr`` to drop these requests' KV: now, or once the connection to it that
        is being made is ready."""
        peer = signal.get(addr)
        if peer is not None and peer.state not in (PeerState.READY, PeerState.FAILED):
            self._releases.setdefault(addr, []).extend(request_ids)
        else:
            signal.send_release(addr, request_ids)  # (no connection, or a failed one: nothing there to tell)

    def heard(self, request_id: str, now: float) -> None:
        """News of a claimed request (an answer or a notify): its next re-ask waits SAFETY_REASK from now."""
        if request_id in self._asked:
            self._asked[request_id] = now

    def send(self, signal: SignalClient, sched: DecodeScheduler, now: float) -> None:
        """Releases held back for a connection that is now ready; pulls for requests given a slot, all of
        them; claims for new requests; a re-ask about every claimed request its prefill worker has not given
        its last word on, after SAFETY_REASK without news."""
        for addr in list(self._releases):
            if _ready_peer(signal, addr) is not None:
                ids = self._releases.pop(addr)
                for i in range(0, len(ids), m.MAX_ENTRIES):
                    signal.send_release(addr, ids[i : i + m.MAX_ENTRIES])
        out: dict[str, list[m.LookupEntry]] = {}
        for addr in list(self._pulls):
            if _ready_peer(signal, addr) is not None:  # (else they wait until it is)
                out[addr] = self._pulls.pop(addr)
                for e in out[addr]:
                    self._asked[e.request_id] = now  # (the pull's answer is news of it)
        asks: Counter[str] = Counter()
        for seq in _unanswered(sched):
            addr, asked = seq.prefill_addr, self._asked.get(seq.request_id)
            if asked is not None and now - asked < SAFETY_REASK:
                continue
            peer = _ready_peer(signal, addr)
            # Claims and re-asks wait for the previous answer (one lookup in flight); past MAX_ENTRIES, next time.
            if peer is None or peer.lookup_in_flight or asks[addr] == m.MAX_ENTRIES:
                continue
            asks[addr] += 1
            if asked is None:
                self.claims += 1
            else:
                self.status_polls += 1
            self._asked[seq.request_id] = now
            out.setdefault(addr, []).append(m.LookupEntry(seq.request_id, None))
        for addr, entries in out.items():
            for frame in lookup_frames(entries):
                signal.send_lookup(addr, frame)
        if len(self._asked) > sched.num_waiting + sched.num_transferring:  # forget those that left
            live = {seq.request_id for seq in sched.waiting() + sched.transferring()}
            self._asked = {rid: t for rid, t in self._asked.items() if rid in live}


def _ready_peer(signal: SignalClient, addr: str) -> PrefillPeer | None:
    peer = signal.get(addr)
    return peer if peer is not None and peer.state is PeerState.READY else None


def _unanswered(sched: DecodeScheduler) -> list[DecodeSeq]:
    """Claimed requests still waiting on word from their prefill worker: not ready yet (READY, pushed once,
    may be lost on the way), or with their KV still coming (a send that failed there is told by a notify
    alone)."""
    return [s for s in sched.waiting() if not s.ready] + sched.transferring()


def lookup_frames(entries: list[m.LookupEntry]) -> list[list[m.LookupEntry]]:
    """``entries`` in order, cut into lookups of at most ``m.MAX_ENTRIES`` entries and FRAME_BUDGET bytes."""
    frames: list[list[m.LookupEntry]] = []
    frame: list[m.LookupEntry] = []
    size = 0
    for e in entries:
        cost = ENTRY_BYTES + len(e.request_id.encode()) + 5 * len(e.dest_blocks or ())
        if frame and (len(frame) == m.MAX_ENTRIES or size + cost > FRAME_BUDGET):
            frames.append(frame)
            frame, size = [], 0
        frame.append(e)
        size += cost
    if frame:
        frames.append(frame)
    return frames
