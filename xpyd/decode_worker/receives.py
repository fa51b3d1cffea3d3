"""The KV a decode worker receives, as its engine keeps track of it (the engine thread alone).

The bytes are the KV connector's (``xpyd.worker.kv_connector``: it turns blocks into the receive, says what
the pull tells prefill, and reports the receives that ended); this keeps what the engine counts of them: pulls
started by prefill worker, prompt blocks its prefix cache already held (not pulled), and when each receive
began and how many bytes it moves, for the transfer metrics when it ends.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Sequence

from xpyd.decode_worker.seq import DecodeSeq
from xpyd.worker.kv_connector import KVReceiver, PullOrder
from xpyd.worker.metrics import WorkerMetrics


class Receives:
    def __init__(self, connector: KVReceiver, metrics: WorkerMetrics, block_bytes: int) -> None:
        self.connector = connector
        self._metrics = metrics
        self._block_bytes = block_bytes
        self.pulls: Counter[str] = Counter()  # KV pulls started, by prefill worker
        self.reused_blocks = 0  # prompt blocks found in this worker's prefix cache (not pulled)
        self._started: dict[str, tuple[float, int]] = {}  # request id -> (monotonic start, bytes)

    def reused(self, blocks: int) -> None:
        """A request's first ``blocks`` prompt blocks were in this worker's prefix cache."""
        self.reused_blocks += blocks
        self._metrics.kv_reused(blocks * self._block_bytes)

    def start(self, seq: DecodeSeq, blocks: Sequence[int], part_blocks: int) -> PullOrder:
        """``seq``'s KV lands in ``blocks`` (in parts of ``part_blocks`` blocks; 0: one part)."""
        order = self.connector.receive(seq.request_id, blocks, part_blocks)
        seq.transfer_ids = list(order.transfer_ids)
        self._started[seq.request_id] = (time.monotonic(), order.nbytes)
        self.pulls[seq.prefill_addr] += 1
        return order

    def ended(self, seq: DecodeSeq, ok: bool) -> None:
        """``seq``'s receive ended (landed, or failed): counted in the transfer metrics."""
        started = self._started.pop(seq.request_id, None)
        if started is not None:
            self._metrics.transfer_done("recv", started[1], time.monotonic() - started[0], ok)

    def fail(self, seq: DecodeSeq) -> None:
        """``seq`` failed while receiving: counted as a failed receive, and cancelled."""
        self.ended(seq, ok=False)
        self.cancel(seq)

    def cancel(self, seq: DecodeSeq) -> None:
        """Cancel ``seq``'s receive (neither landed nor failed): once this returns, no byte of it lands."""
        self._started.pop(seq.request_id, None)
        if seq.transfer_ids:
            self.connector.abort(seq.request_id)
