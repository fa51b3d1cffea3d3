"""The decode engine's signal client, reduced to what a step calls (engines stepped by hand in unit tests)."""

from __future__ import annotations

from types import SimpleNamespace

from xpyd.signal.client import PeerState


class FakeSignal:
    """``replies`` go out with the next poll; the poll timeouts asked for and the released ids are recorded;
    every prefill peer is connected."""

    def __init__(self) -> None:
        self.replies: list = []
        self.timeouts: list[int] = []
        self.released: list[str] = []

    def poll(self, timeout_ms: int):
        self.timeouts.append(timeout_ms)
        replies, self.replies = self.replies, []
        return replies, []

    def heartbeat(self, interval: float) -> None:
        pass

    def peer(self, addr: str):
        return SimpleNamespace(state=PeerState.READY)

    def get(self, addr: str):
        return None

    def peers(self) -> list:
        return []

    def pending_requests(self) -> int:
        return 0

    def send_release(self, addr: str, request_ids: list[str]) -> None:
        self.released += request_ids

    def close(self) -> None:
        pass
