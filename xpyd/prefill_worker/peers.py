"""The decode workers a prefill worker serves, as its engine keeps track of them.

Who shook hands and when each was last heard from (any message counts, heartbeats included), the KV pool
each registered (``kv_map_init``), and which left the cluster (discovery). A decode worker is known by its
address, as its signal session's authenticated hello names it (``xpyd.signal.server``: one open session
per address); when that session ends, the worker is forgotten (``close``) and shakes hands again on its
next session. At most ``max_peers`` are remembered; beyond that the least recently heard from is
forgotten (it shakes hands again). Not thread-safe: the engine's lock guards it.
"""

from __future__ import annotations

from collections import OrderedDict

from xpyd.worker.kv_connector_send import PeerMap  # noqa: F401 (a decode worker's pool, as the KV connector took it)

MAX_PEERS = 1024


class DecodePeers:
    def __init__(self, max_peers: int = MAX_PEERS) -> None:
        self._max = max_peers
        self._seen: OrderedDict[str, float] = OrderedDict()  # handshaken -> last heard from, least recent first
        self._maps: dict[str, PeerMap] = {}
        self._left: dict[str, float] = {}  # left the cluster -> when

    def accept(self, identity: str, now: float) -> None:
        """A handshake was accepted (again, after a restart on the same address: it is back)."""
        self._seen[identity] = now
        self._seen.move_to_end(identity)
        self._left.pop(identity, None)
        while len(self._seen) > self._max:
            old, _ = self._seen.popitem(last=False)
            self._maps.pop(old, None)

    def heard_from(self, identity: str, now: float) -> bool:
        """A message from ``identity``: True (and noted) if it has shaken hands."""
        if identity not in self._seen:
            return False
        self._seen[identity] = now
        self._seen.move_to_end(identity)
        return True

    def close(self, identity: str) -> bool:
        """Its signal session ended: forget its handshake and its pool (True if it had shaken hands)."""
        self._maps.pop(identity, None)
        return self._seen.pop(identity, None) is not None

    def last_heard(self, identity: str) -> float | None:
        return self._seen.get(identity)

    def register(self, identity: str, pool: PeerMap) -> None:
        self._maps[identity] = pool

    def pool(self, identity: str) -> PeerMap | None:
        return self._maps.get(identity)

    def leave(self, identity: str, now: float) -> PeerMap | None:
        """Discovery says it left; its registered pool (to close transfer connections to), if any."""
        self._left[identity] = now
        return self._maps.get(identity)

    def joined(self, identity: str) -> None:
        """Discovery lists it (again: its registration came back, e.g. after an etcd outage of its own)."""
        self._left.pop(identity, None)

    def left_at(self, identity: str) -> float | None:
        return self._left.get(identity)

    def forget_left(self, before: float) -> None:
        """Stop remembering departures older than ``before``."""
        self._left = {a: t for a, t in self._left.items() if t > before}

    def live(self) -> int:
        """Decode workers with an open signal session and not gone from the cluster. (A session stays open while
        its connection answers the server's ZMTP heartbeats, which the decode worker's libzmq I/O thread does
        however busy its engine thread is: how recently it last spoke says nothing more.)"""
        return sum(1 for a in self._seen if a not in self._left)

    @property
    def num_handshaken(self) -> int:
        return len(self._seen)

    @property
    def num_registered(self) -> int:
        return len(self._maps)

