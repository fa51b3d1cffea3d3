"""When to start asking a prefill worker whether a request's prefill is done.

The decode worker learns readiness by polling (`lookup_all`, every 2 ms per prefill worker while requests
wait). Each poll wakes the prefill worker's signal thread and our engine thread, and on a host with few
cores every wake-up preempts one of the prefill's compute threads mid-forward: measured on 2 cores with a
fixed hand-set schedule, a served 256-token prefill took 142 ms with polls from the start and 107 ms with
polls held back until it could be done (TTFT p50 152 -> 108 ms); this learned schedule has not yet been
measured on a quiet machine.

So, per prefill worker, we remember how fast prefills have recently become ready — seconds from the
request's arrival to "ready" per prompt token, the fastest of the last `window` — and start polling a
request at `arrival + margin * fastest * prompt_tokens`. A prefill that is slower than that (queued behind
others, sharing cores) is then polled every 2 ms as before; one that is faster than anything seen recently
is noticed late by at most the difference, and teaches the schedule its new speed. Before any observation
(a new peer) polls start at once.
"""

from __future__ import annotations

from collections import deque


class PollSchedule:
    def __init__(self, margin: float = 0.8, window: int = 32) -> None:
        if not 0.0 <= margin <= 1.0:
            raise ValueError("margin must be in [0, 1]")
        if window < 1:
            raise ValueError("window must be >= 1")
        self.margin = margin
        self.window = window
        self._per_token: dict[str, deque[float]] = {}

    def start_at(self, peer: str, arrival: float, prompt_tokens: int) -> float:
        """Monotonic time from which this request's status is worth asking for."""
        seen = self._per_token.get(peer)
        if not seen:
            return arrival
        return arrival + self.margin * min(seen) * prompt_tokens

    def observe(self, peer: str, arrival: float, ready_at: float, prompt_tokens: int) -> None:
        """A request of `prompt_tokens` that arrived at `arrival` was seen ready at `ready_at`."""
        if prompt_tokens <= 0 or ready_at < arrival:
            return
        seen = self._per_token.setdefault(peer, deque(maxlen=self.window))
        seen.append((ready_at - arrival) / prompt_tokens)

    def forget(self, peer: str) -> None:
        self._per_token.pop(peer, None)
