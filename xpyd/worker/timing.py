"""A worker's own clock on one answer, for ``X-Xpyd-Timing`` (``xpyd.api.timing``: what is asked and answered).

``AnswerClock.asked(header)`` starts one when the request asked for it (None otherwise: nothing is recorded
and nothing changes in the answer); the HTTP handler calls ``chunk()`` as it hands each content chunk (one
with text) to the server, and ends the stream with ``comment()``, or a JSON answer with ``header()``.
Memory is bounded: the first ``MAX_GAPS`` gaps are kept, the rest only counted.
"""

from __future__ import annotations

import time

from xpyd.api.timing import ASK, MAX_GAPS, TIMING_HEADER, WorkerTiming

__all__ = ["TIMING_HEADER", "AnswerClock"]

_US = 1_000_000


class AnswerClock:
    """Arrival, the first content chunk, and the gaps between chunks, in ``time.perf_counter`` seconds."""

    __slots__ = ("_arrived", "_first", "_last", "_gaps_us", "_gaps")

    def __init__(self, arrived: float) -> None:
        self._arrived = arrived
        self._first: float | None = None
        self._last = 0.0
        self._gaps_us: list[int] = []
        self._gaps = 0

    @classmethod
    def asked(cls, header: str | None) -> AnswerClock | None:
        """A clock started now if ``header`` (the request's ``X-Xpyd-Timing``) asks for one."""
        return cls(time.perf_counter()) if header == ASK else None

    def chunk(self, now: float | None = None) -> None:
        """A content chunk is written now."""
        now = time.perf_counter() if now is None else now
        if self._first is None:
            self._first = now
        else:
            self._gaps += 1
            if len(self._gaps_us) < MAX_GAPS:
                self._gaps_us.append(_micros(now - self._last))
        self._last = now

    def timing(self) -> WorkerTiming:
        ttft = None if self._first is None else _micros(self._first - self._arrived)
        return WorkerTiming(ttft_us=ttft, gaps_us=tuple(self._gaps_us), gaps=self._gaps)

    def comment(self) -> bytes:
        """The SSE comment that ends a streamed answer (before ``[DONE]``)."""
        return self.timing().comment()

    def header(self) -> str:
        """``X-Xpyd-Timing``'s value on a JSON answer, built now (its first token is the answer)."""
        if self._first is None:
            self.chunk()
        return self.timing().to_json().decode()


def _micros(seconds: float) -> int:
    return max(0, round(seconds * _US))
