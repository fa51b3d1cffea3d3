"""The sweep: which prefill:decode split and decode batch meets the SLO at the least workers.

Configurations are tried by total workers, fewest first (for each total every split x + y, x, y >= 1, and every
batch size), and the sweep stops after the first total where one meets the SLO's attainment: more workers are
never cheaper (``exhaustive`` tries every total up to ``max_workers`` anyway). Among those that meet it, the
answer is the one with the fewest workers, then the highest goodput, then the fewest prefill workers.

A request's TTFT does not depend on the decode side in the fleet model, so once x prefill workers alone miss the
attainment on TTFT, every configuration with x prefill workers is skipped (listed with that reason), unless
the sweep is ``exhaustive``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from xpyd.model.sim.profile import SimProfile
from xpyd.planner.fleet_model import FleetConfig, FleetResult, simulate
from xpyd.planner.slo import PlanSLO
from xpyd.planner.workload import Workload

__all__ = ["Attempt", "SearchConfig", "SearchResult", "search"]


@dataclass(frozen=True, slots=True)
class SearchConfig:
    max_workers: int = 8
    batch_sizes: tuple[int, ...] = (8, 16, 32)
    base: FleetConfig = field(default_factory=lambda: FleetConfig(1, 1))  # everything but the split and batch
    exhaustive: bool = False  # model every configuration up to max_workers: no early stop, nothing skipped

    def __post_init__(self) -> None:
        if isinstance(self.max_workers, bool) or not isinstance(self.max_workers, int) or self.max_workers < 2:
            raise ValueError(f"max workers must be an int >= 2 (one prefill, one decode), got {self.max_workers!r}")
        if not self.batch_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                                       for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be ints >= 1, got {self.batch_sizes!r}")
        if len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise ValueError(f"batch sizes repeat: {self.batch_sizes!r}")


@dataclass(frozen=True, slots=True)
class Attempt:
    config: FleetConfig
    result: FleetResult | None  # None: skipped
    meets: bool
    note: str = ""  # why it was skipped

    def row(self) -> dict:
        base = {"config": self.config.label, "prefill_workers": self.config.prefill_workers,
                "decode_workers": self.config.decode_workers, "decode_batch": self.config.decode_batch,
                "workers": self.config.workers, "meets_slo": self.meets}
        if self.result is None:
            return {**base, "skipped": self.note}
        return {**base, **self.result.summary(), "meets_slo": self.meets}


@dataclass(frozen=True, slots=True)
class SearchResult:
    attempts: tuple[Attempt, ...]
    best: Attempt | None  # None: nothing tried meets the SLO
    seconds: float  # the sweep's own time

    @property
    def closest(self) -> Attempt | None:
        """The highest attainment tried (what to show when nothing meets the SLO)."""
        tried = [a for a in self.attempts if a.result is not None]
        return max(tried, key=lambda a: (a.result.attainment, a.result.goodput), default=None)


def search(profile: SimProfile, workload: Workload, slo: PlanSLO, config: SearchConfig,
           progress: Callable[[Attempt], None] | None = None) -> SearchResult:
    started = time.perf_counter()
    attempts: list[Attempt] = []
    ttft_short: dict[int, float] = {}  # prefill workers -> TTFT-only attainment below the target
    ttft_only = PlanSLO(ttft_s=slo.ttft_s, attainment=slo.attainment) if slo.ttft_s is not None else None
    found_at: int | None = None
    for total in range(2, config.max_workers + 1):
        if found_at is not None and not config.exhaustive:
            break
        for x in range(1, total):
            for b in config.batch_sizes:
                fleet = replace(config.base, prefill_workers=x, decode_workers=total - x, decode_batch=b)
                if x in ttft_short and not config.exhaustive:
                    attempt = Attempt(fleet, None, False, f"TTFT alone met by {ttft_short[x]:.1%} with {x} "
                                                          f"prefill workers")
                else:
                    result = simulate(profile, workload, fleet, slo)
                    attempt = Attempt(fleet, result, result.attainment >= slo.attainment)
                    if ttft_only is not None:
                        share = float(np.mean(result.ttft_s <= ttft_only.ttft_s))
                        if share < slo.attainment:
                            ttft_short[x] = share
                attempts.append(attempt)
                if progress is not None:
                    progress(attempt)
                if attempt.meets and found_at is None:
                    found_at = total
    meeting = [a for a in attempts if a.meets]
    best = min(meeting, key=lambda a: (a.config.workers, -a.result.goodput, a.config.prefill_workers),
               default=None)
    return SearchResult(tuple(attempts), best, time.perf_counter() - started)
