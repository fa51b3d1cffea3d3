"""The requests the fleet model replays: when each arrives, its lengths, and its prompt's block ids.

Built from a Mooncake trace (`xpyd.bench.trace`): arrival = (timestamp - the first's) / 1000 / time_scale, as
`xpyd bench --trace --time-scale` sends them; ``hash_ids`` name blocks of ``block_size`` tokens, two requests
with the same id at the same position sharing the prefix up to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from xpyd.bench.trace import MOONCAKE_BLOCK_SIZE, TraceRecord, send_offsets

__all__ = ["PlanRequest", "Workload", "from_trace"]


@dataclass(frozen=True, slots=True)
class PlanRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()  # the prompt's blocks; () = shares nothing

    def __post_init__(self) -> None:
        if not self.arrival_s >= 0:
            raise ValueError(f"arrival_s must be >= 0, got {self.arrival_s}")
        if self.input_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"input and output tokens must be >= 1, got {self.input_tokens}, {self.output_tokens}")


@dataclass(frozen=True, slots=True)
class Workload:
    requests: tuple[PlanRequest, ...]  # in arrival order
    block_size: int = MOONCAKE_BLOCK_SIZE  # tokens per hash id

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError("a workload needs at least one request")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if any(b.arrival_s < a.arrival_s for a, b in zip(self.requests, self.requests[1:])):
            raise ValueError("requests must be in arrival order")

    @property
    def span_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    def summary(self) -> dict[str, float]:
        n = len(self.requests)
        return {"requests": n, "span_s": self.span_s,
                "mean_input_tokens": sum(r.input_tokens for r in self.requests) / n,
                "mean_output_tokens": sum(r.output_tokens for r in self.requests) / n,
                "rate_per_s": n / self.span_s if self.span_s > 0 else float("inf")}


def from_trace(records: Sequence[TraceRecord], time_scale: float = 1.0,
               block_size: int = MOONCAKE_BLOCK_SIZE) -> Workload:
    offsets = send_offsets(records, time_scale)
    return Workload(tuple(PlanRequest(t, r.input_length, r.output_length, r.hash_ids)
                          for t, r in zip(offsets, records)), block_size)
