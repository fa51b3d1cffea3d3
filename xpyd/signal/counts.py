"""Signal-plane messages counted by direction and kind (the wire tag: ``heartbeat``, ``lookup_all``...).

One ``MessageCounts`` per socket owner (the prefill worker's ROUTER thread, the decode engine thread that
owns the DEALERs): only that thread counts, any thread reads a ``snapshot``. The worker's metrics export it
(``xpyd_signal_messages_total``). Kinds are the message tags and ``invalid`` (a frame that did not decode),
so the label set stays bounded whatever a peer sends. ZMTP's own PINGs (libzmq, every second on each
connection) are below this layer and not counted here.
"""

from __future__ import annotations

DIRECTIONS = ("sent", "received")
INVALID = "invalid"  # a received frame that is not a valid message


class MessageCounts:
    __slots__ = ("_n",)

    def __init__(self) -> None:
        self._n: dict[tuple[str, str], int] = {}

    def sent(self, kind: str) -> None:
        key = ("sent", kind)
        self._n[key] = self._n.get(key, 0) + 1

    def received(self, kind: str) -> None:
        key = ("received", kind)
        self._n[key] = self._n.get(key, 0) + 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        """(direction, kind) -> messages so far (a copy; safe from any thread)."""
        return dict(self._n)  # (one C call under the GIL: never sees a half-updated dict)

    def total(self, direction: str) -> int:
        return sum(n for (d, _), n in self.snapshot().items() if d == direction)
