"""When one request passed each point of a worker, on the worker's monotonic clock (``WorkItem.stamps``).

The engine thread stamps what happens in the engine; the HTTP handler's ``AnswerClock`` holds when the
request arrived and when its first chunk was written, and turns the stamps into the role's phases
(``xpyd.api.phases``) once that chunk is out::

    prefill   received -> handed -> scheduled -> sampled -> written
    decode    received -> handed -> pull_started -> landed -> step_started -> step_ended -> written
    colocated received -> handed -> scheduled -> sampled [-> finished, a JSON answer] -> written
              and, streamed: sampled -> step_started -> step_ended -> the next chunk written

``handed`` is the item's ``arrival`` (made when the request was validated and tokenized). A stamp is set
once (the first time); a request that never reached a point (it ended on prefill's token, it failed) has
no phases.
"""

from __future__ import annotations

from xpyd.api.phases import ColocatedPhases, DecodePhases, PrefillPhases, StepPhases, spans_us


class PhaseStamps:
    """The engine's stamps of one request (seconds, ``time.monotonic``; None: not reached)."""

    __slots__ = ("scheduled", "sampled", "pull_started", "landed", "step_started", "step_ended", "finished")

    def __init__(self) -> None:
        self.scheduled: float | None = None  # prefill: its first prompt chunk's forward pass started
        self.sampled: float | None = None  # prefill: its first token sampled
        self.pull_started: float | None = None  # decode: its KV pull started (or found it all cached)
        self.landed: float | None = None  # decode: its KV landed (as the engine learned it)
        self.step_started: float | None = None  # decode: the first decode step it ran in started
        self.step_ended: float | None = None  # decode: ... and ended (token 2 sampled)
        self.finished: float | None = None  # colocated: its last token sampled

    def mark(self, name: str, now: float) -> None:
        """``name`` reached at ``now``, unless it was already."""
        if getattr(self, name) is None:
            setattr(self, name, now)

    def prefill(self, received: float, handed: float, written: float) -> PrefillPhases | None:
        if self.scheduled is None or self.sampled is None:
            return None
        parse, queue, compute, respond = spans_us(received, handed, self.scheduled, self.sampled, written)
        return PrefillPhases(parse_us=parse, queue_us=queue, compute_us=compute, respond_us=respond)

    def decode(self, received: float, handed: float, written: float) -> DecodePhases | None:
        marks = (self.pull_started, self.landed, self.step_started, self.step_ended)
        if any(m is None for m in marks):
            return None
        parse, wait, transfer, queue, step, respond = spans_us(received, handed, *marks, written)
        return DecodePhases(parse_us=parse, wait_us=wait, transfer_us=transfer, queue_us=queue, step_us=step,
                            respond_us=respond)

    def colocated(self, received: float, handed: float, written: float, answer: bool) -> ColocatedPhases | None:
        """``answer``: a JSON answer (built at ``written``), whose tokens after the first are ``rest``."""
        if self.scheduled is None or self.sampled is None or (answer and self.finished is None):
            return None
        if not answer:
            parse, queue, compute, respond = spans_us(received, handed, self.scheduled, self.sampled, written)
            return ColocatedPhases(parse_us=parse, queue_us=queue, compute_us=compute, respond_us=respond)
        parse, queue, compute, rest, respond = spans_us(received, handed, self.scheduled, self.sampled,
                                                        self.finished, written)
        return ColocatedPhases(parse_us=parse, queue_us=queue, compute_us=compute, rest_us=rest, respond_us=respond)

    def first_step(self, written: float) -> StepPhases | None:
        """A colocated stream's first decode step, its next chunk with text ``written``."""
        if self.sampled is None or self.step_started is None or self.step_ended is None:
            return None
        queue, step, respond = spans_us(self.sampled, self.step_started, self.step_ended, written)
        return StepPhases(queue_us=queue, step_us=step, respond_us=respond)
