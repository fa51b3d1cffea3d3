"""A worker's own clock on one answer, for ``X-Xpyd-Timing`` (``xpyd.api.timing``: what is asked and answered)
and the phase histograms (``xpyd.api.phases``).

``AnswerClock.start(header)`` starts one as the request arrives; ``wanted`` says whether the request asked
for its timing (``X-Xpyd-Timing: 1``: nothing else changes in the answer otherwise). ``follow`` gives it the
request's engine stamps (``xpyd.worker.phases``) and what records its phases. The HTTP handler calls
``chunk()`` as it hands each content chunk (one with text) to the server, or ``answered()`` when a JSON answer
is built; at the first of those the request's phases are made and recorded (a colocated stream's first decode
step at its second chunk). A decode worker's request whose prompt it prefilled itself (``xpyd.api.local_prefill``)
is split as a colocated worker's. A streamed answer asked for its
timing ends with ``comment()``, a JSON one has ``header()``. Memory is bounded: the first ``MAX_GAPS`` gaps
are kept (only when asked), the rest only counted.
"""

from __future__ import annotations

import time
from typing import Callable

import msgspec

from xpyd.api.phases import ColocatedPhases, DecodePhases, PrefillPhases, StepPhases
from xpyd.api.timing import ASK, MAX_GAPS, TIMING_HEADER, WorkerTiming
from xpyd.worker.phases import PhaseStamps

__all__ = ["TIMING_HEADER", "AnswerClock"]

_US = 1_000_000
Phases = PrefillPhases | DecodePhases | ColocatedPhases | StepPhases


class AnswerClock:
    """Arrival, the first content chunk, and the gaps between chunks, in ``time.monotonic`` seconds."""

    __slots__ = ("wanted", "_arrived", "_first", "_last", "_gaps_us", "_gaps", "_follow", "_phases", "_answer")

    def __init__(self, arrived: float, wanted: bool = True) -> None:
        self.wanted = wanted  # the request asked for its timing
        self._arrived = arrived
        self._first: float | None = None
        self._last = 0.0
        self._gaps_us: list[int] = []
        self._gaps = 0
        self._follow: tuple[str, PhaseStamps, float, Callable[[Phases], None]] | None = None
        self._phases: PrefillPhases | DecodePhases | ColocatedPhases | None = None
        self._answer = False  # a JSON answer (``answered``)

    @classmethod
    def start(cls, header: str | None) -> AnswerClock:
        """A clock started now; ``wanted`` if ``header`` (the request's ``X-Xpyd-Timing``) asks for it."""
        return cls(time.monotonic(), wanted=header == ASK)

    def follow(self, role: str, stamps: PhaseStamps, handed: float, record: Callable[[Phases], None]) -> None:
        """The request's engine ``stamps`` (``handed``: when it went to the engine); at the first chunk they
        become ``role``'s phases (prefill, decode, colocated), given to ``record`` (and a colocated stream's
        first decode step at its second chunk)."""
        self._follow = (role, stamps, handed, record)

    def chunk(self, now: float | None = None) -> None:
        """A content chunk is written now."""
        now = time.monotonic() if now is None else now
        if self._first is None:
            self._first = now
            self._split(now)
        else:
            if self._gaps == 0:
                self._first_step(now)
            self._gaps += 1
            if self.wanted and len(self._gaps_us) < MAX_GAPS:
                self._gaps_us.append(_micros(now - self._last))
        self._last = now

    def answered(self) -> None:
        """A JSON answer is built now (its first token is the answer)."""
        if self._first is None:
            self._answer = True
            self.chunk()

    def _split(self, written: float) -> None:
        if self._follow is None:
            return
        role, stamps, handed, record = self._follow
        if role == "prefill":
            self._phases = stamps.prefill(self._arrived, handed, written)
        elif role == "decode":
            self._phases = stamps.decode(self._arrived, handed, written)
            if self._phases is None and stamps.pull_started is None:  # a prompt it prefilled itself: as colocated
                self._phases = stamps.colocated(self._arrived, handed, written, self._answer)
        elif role == "colocated":
            self._phases = stamps.colocated(self._arrived, handed, written, self._answer)
        if self._phases is not None:
            record(self._phases)

    def _first_step(self, written: float) -> None:
        """The second chunk with text is written: a colocated stream's first decode step, split."""
        phases = self._phases
        if not isinstance(phases, ColocatedPhases) or self._follow is None:
            return
        step = self._follow[1].first_step(written)
        if step is not None:
            self._phases = msgspec.structs.replace(phases, step=step)
            self._follow[3](step)

    def timing(self) -> WorkerTiming:
        ttft = None if self._first is None else _micros(self._first - self._arrived)
        phases = self._phases
        return WorkerTiming(ttft_us=ttft, gaps_us=tuple(self._gaps_us), gaps=self._gaps,
                            prefill=phases if isinstance(phases, PrefillPhases) else None,
                            decode=phases if isinstance(phases, DecodePhases) else None,
                            colocated=phases if isinstance(phases, ColocatedPhases) else None)

    def comment(self) -> bytes:
        """The SSE comment that ends a streamed answer (before ``[DONE]``)."""
        return self.timing().comment()

    def header(self) -> str:
        """``X-Xpyd-Timing``'s value on a JSON answer (built now if ``answered`` was not called)."""
        self.answered()
        return self.timing().to_json().decode()


def _micros(seconds: float) -> int:
    return max(0, round(seconds * _US))
