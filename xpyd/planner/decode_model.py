"""One decode worker in the fleet model: continuous batching, run a segment of steps at a time.

Queues: waiting (its KV arrived) -> running (in the batch, at most ``batch``) -> done. Requests join at a step
boundary when there is room. A step takes the profile's time at the batch's size and context (the sum over
the batch of each request's tokens so far, as the simulated engine counts it). Between two changes of the
batch (a request done, one admitted) the steps differ only in context, so the worker plans a whole segment at
once, with numpy: its steps' times until the first running request is done. A request that arrives while a
segment runs, with room in the batch, cuts the segment at the first step boundary after it.

Per request it records the time of its last token and the longest gap between two of its tokens (the first
gap: from the prefill's first token to this worker's first step that includes it); every gap also goes into a
weighted sample, for the fleet's ITL percentiles.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from xpyd.model.sim.profile import Table

__all__ = ["DecodeWorker", "StepTimes"]


class StepTimes:
    """Decode step seconds at a fixed batch for many contexts: exactly `Table.at`, vectorized."""

    def __init__(self, table: Table) -> None:
        self._table = table
        self._y = np.asarray(table.y, dtype=np.float64)
        self._rows: dict[int, np.ndarray] = {}

    def row(self, batch: int) -> np.ndarray:
        """The step time at ``batch`` on each point of the context axis (bilinear's first pass)."""
        r = self._rows.get(batch)
        if r is None:
            x, s = self._table.x, np.asarray(self._table.seconds, dtype=np.float64)
            if len(x) == 1:
                r = s[0]
            else:
                i = min(max(int(np.searchsorted(x, batch, side="right")) - 1, 0), len(x) - 2)
                tx = (batch - x[i]) / (x[i + 1] - x[i])
                r = (1 - tx) * s[i] + tx * s[i + 1]
            self._rows[batch] = r
        return r

    def at(self, batch: int, contexts: np.ndarray) -> np.ndarray:
        r, y = self.row(batch), self._y
        if len(y) == 1:
            return np.maximum(np.full(contexts.shape, r[0]), 0.0)
        j = np.clip(np.searchsorted(y, contexts, side="right") - 1, 0, len(y) - 2)
        ty = (contexts - y[j]) / (y[j + 1] - y[j])
        return np.maximum((1 - ty) * r[j] + ty * r[j + 1], 0.0)


@dataclass(eq=False, slots=True)
class Running:
    index: int
    remaining: int  # tokens still to generate here
    context: int  # tokens so far (prompt + generated, the prefill's first token included)
    last_token_s: float  # when its latest token came (the first: the prefill's)
    max_gap_s: float = 0.0


class DecodeWorker:
    def __init__(self, steps: StepTimes, batch: int) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.steps = steps
        self.batch = batch
        self.waiting: deque[Running] = deque()
        self.running: list[Running] = []
        self.assigned_tokens = 0  # the fleet's routing load: tokens of the requests sent here, not yet done
        self.version = 0  # bumped when the planned segment end moves
        self._times = np.empty(0)  # the planned segment's step seconds
        self._ends = np.empty(0)  # ... and when each step ends
        self._start = 0.0  # when the planned segment begins
        self._steps = 0  # steps of the segment that will run (<= len(_ends))
        self.gaps: list[tuple[np.ndarray, int]] = []  # (gaps, how many requests had each)
        self.first_gaps: list[float] = []  # one per request and segment: the gap before its segment's first step

    @property
    def idle(self) -> bool:
        return self._steps == 0

    def arrive(self, index: int, now: float, first_token_s: float, context: int, tokens: int) -> float | None:
        """A request's KV is here at ``now`` (its first token came at ``first_token_s``): it waits for room.
        When the segment end to wait for moves (an idle worker starts one; one not begun is planned again with
        it; a running one is cut to let it in), returns that end, else None."""
        self.waiting.append(Running(index, tokens, context, first_token_s))
        if self.idle:
            return self._plan(now)
        if len(self.running) >= self.batch:
            return None
        if now <= self._start:  # the segment has not begun: plan it again with this request in
            return self._plan(self._start)
        cut = int(np.searchsorted(self._ends[: self._steps], now, side="left")) + 1
        if cut >= self._steps:
            return None
        self._steps = cut
        self.version += 1
        return float(self._ends[cut - 1])

    def segment_end(self) -> tuple[float, list[Running], float | None]:
        """The planned steps ran: (their end, the requests they finished, the next segment's end or None)."""
        k, times, ends = self._steps, self._times, self._ends
        now, first_end = float(ends[k - 1]), float(ends[0])
        rest_max = float(times[1:k].max()) if k > 1 else 0.0
        if k > 1:
            self.gaps.append((times[1:k], len(self.running)))
        finished, still = [], []
        for r in self.running:
            first = first_end - r.last_token_s  # one step for a running request, longer for one that joined
            self.first_gaps.append(first)
            r.max_gap_s = max(r.max_gap_s, first, rest_max)
            r.remaining -= k
            r.context += k
            r.last_token_s = now
            (finished if r.remaining == 0 else still).append(r)
        self.running = still
        self._steps = 0
        return now, finished, self._plan(now)

    def _plan(self, now: float) -> float | None:
        while self.waiting and len(self.running) < self.batch:
            self.running.append(self.waiting.popleft())
        if not self.running:
            return None
        b = len(self.running)
        k = min(r.remaining for r in self.running)
        contexts = sum(r.context for r in self.running) + b * np.arange(k, dtype=np.float64)
        self._times = self.steps.at(b, contexts)
        self._ends = now + np.cumsum(self._times)
        self._start = now
        self._steps = k
        self.version += 1
        return float(self._ends[-1])
