"""Where a cuda_ipc transfer's time goes: the stages each side reached, and when, and the receiver's device time.

Off unless a caller sets ``backend.stamps = Stamps()`` (``scripts/gpu/transfer_bench.py`` does, on both
sides); then the backend calls it at each stage, the hot path paying one call, a lock and a dict store.
``time.perf_counter_ns`` is CLOCK_MONOTONIC on Linux, one clock for every process of a host, so the two
sides' stamps subtract.
"""

from __future__ import annotations

import threading
import time
from collections import deque

SENDER_STAGES = ("send", "offered", "done")  # in the order reached
RECEIVER_STAGES = ("claimed", "opened", "prepared", "ready", "launching", "enqueued", "synced", "done")


class Stamps:
    """Per transfer, when each stage was reached (``time.perf_counter_ns``), and the receiver's device time:

    sender: ``send`` (``send()`` called: the forward that wrote the KV is enqueued, maybe still running),
    ``offered`` (the Offer is written, with the handle of the event behind that forward), ``done`` (the
    receiver's Reply read; the token is DONE). Receiver: ``claimed`` (offer read, MAC checked, transfer
    claimed), ``opened`` (the sender's pool handle open: slow the first time only; its board mapped; the
    event's handle open), ``prepared`` (the copies' host work done: the kernel's table on the device),
    ``ready`` (the sender's event passed: the forward finished), ``launching`` (the last batch's stream set
    up: its wait for the decode engine's mark and its timing event enqueued; the copies are enqueued next),
    ``enqueued`` (every copy of the last batch enqueued), ``synced`` (the copy stream fenced), ``done``
    (the sender's board entry checked: the token is DONE, the Reply goes out next). ``device_s``: seconds of device time of
    the copies (all batches). Bounded: the last ``keep`` transfers."""

    def __init__(self, keep: int = 1024) -> None:
        self._lock = threading.Lock()
        self._order: deque[str] = deque()
        self._keep = keep
        self.stages: dict[str, dict[str, int]] = {}
        self.device_s: dict[str, float] = {}

    def __call__(self, transfer_id: str, stage: str, ns: int | None = None) -> None:
        ns = time.perf_counter_ns() if ns is None else ns
        with self._lock:
            row = self.stages.get(transfer_id)
            if row is None:
                row = self.stages[transfer_id] = {}
                self._order.append(transfer_id)
                if len(self._order) > self._keep:
                    old = self._order.popleft()
                    self.stages.pop(old, None)
                    self.device_s.pop(old, None)
            row[stage] = ns

    def add_device(self, transfer_id: str, seconds: float) -> None:
        with self._lock:
            self.device_s[transfer_id] = self.device_s.get(transfer_id, 0.0) + seconds

    def take(self, transfer_id: str) -> tuple[dict[str, int], float | None]:
        """The transfer's stages and device seconds (None if it copied nothing here), forgotten."""
        with self._lock:
            if transfer_id in self._order:
                self._order.remove(transfer_id)
            return self.stages.pop(transfer_id, {}), self.device_s.pop(transfer_id, None)
