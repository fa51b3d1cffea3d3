"""The decode engine's signal client, reduced to what a step calls (engines stepped by hand in unit tests)."""

from __future__ import annotations

from types import SimpleNamespace

from xpyd.signal import messages as m
from xpyd.signal.client import PeerState


def ready(request_id: str, first_token: int, num_tokens: int, block_size: int = 4,
          status: m.LookupStatus = m.LookupStatus.READY) -> m.LookupResult:
    """A prefill worker's "ready" for a prompt of ``num_tokens``: block hashes for its full blocks (made up,
    distinct) and the tokens after them, as a real prefill worker names them."""
    full = num_tokens // block_size
    return m.LookupResult(request_id, status, first_token, num_tokens,
                          block_hashes=m.pack_hashes([1000 + i for i in range(full)]),
                          tail=tuple(range(num_tokens - full * block_size)))


class FakeSignal:
    """``replies`` go out with the next poll; the poll timeouts asked for and the released ids are recorded;
    every prefill peer is connected."""

    def __init__(self) -> None:
        self.replies: list = []
        self.timeouts: list[int] = []
        self.released: list[str] = []
        self.lookups: list = []  # (address, entries) sent to peers ``get`` returns
        self.proved: dict[str, str] = {}  # prefill address -> the token its handshake proved (default: none recorded)

    def poll(self, timeout_ms: int):
        self.timeouts.append(timeout_ms)
        replies, self.replies = self.replies, []
        return replies, []

    def heartbeat(self, interval: float, busy) -> None:
        pass

    def close_idle(self, idle_after: float, busy) -> list[str]:
        return []

    def peer(self, addr: str):
        return SimpleNamespace(state=PeerState.READY)

    def get(self, addr: str):
        if addr not in self.proved:
            return None
        return SimpleNamespace(state=PeerState.READY, proved=self.proved[addr], lookup_in_flight=False)

    def send_lookup(self, addr: str, entries: list) -> None:
        self.lookups.append((addr, entries))

    def peers(self) -> list:
        return []

    def pending_requests(self) -> int:
        return 0

    def send_release(self, addr: str, request_ids: list[str]) -> None:
        self.released += request_ids

    def close(self) -> None:
        pass
