"""How a fleet of x prefill and y decode workers would do under a forecast load: the online planner's model.

``FleetModel`` is what the controller asks; ``SimFleetModel`` answers by running the offline planner's
discrete-event fleet model (`fleet_model.simulate`) on a synthetic workload of the forecast: Poisson arrivals
at the forecast rate over ``window_s`` (seeded, so the same forecast gets the same answer), every request of the
forecast's mean lengths and sharing no prefix, the backlog arriving at once at the start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from xpyd.model.sim.profile import SimProfile
from xpyd.planner.fleet_model import FleetConfig, simulate
from xpyd.planner.predict import Forecast
from xpyd.planner.slo import PlanSLO
from xpyd.planner.workload import PlanRequest, Workload

__all__ = ["FleetModel", "Prediction", "SimFleetModel", "synthetic_workload"]


@dataclass(frozen=True, slots=True)
class Prediction:
    prefill_met: float  # the share of requests meeting the prefill side's target (TTFT; 1 without one)
    met: float  # ... meeting every target

    def __post_init__(self) -> None:
        for name in ("prefill_met", "met"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise ValueError(f"{name.replace('_', ' ')} must be a share in [0, 1], got {v!r}")


class FleetModel(Protocol):
    def predict(self, prefill: int, decode: int, load: Forecast) -> Prediction: ...


@dataclass(frozen=True, slots=True)
class SimFleetModel:
    profile: SimProfile
    slo: PlanSLO
    base: FleetConfig = field(default_factory=lambda: FleetConfig(1, 1))  # all but the worker counts
    window_s: float = 60.0  # the forecast interval modelled
    max_requests: int = 2000  # a higher rate is modelled over a shorter window
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise ValueError(f"the modelled window must be > 0 s, got {self.window_s!r}")
        if self.max_requests < 1:
            raise ValueError(f"max requests must be >= 1, got {self.max_requests}")

    def predict(self, prefill: int, decode: int, load: Forecast) -> Prediction:
        workload = synthetic_workload(load, self.window_s, self.max_requests, self.seed)
        if workload is None:
            return Prediction(1.0, 1.0)
        result = simulate(self.profile, workload, replace(self.base, prefill_workers=prefill,
                                                          decode_workers=decode), self.slo)
        ttft = 1.0 if self.slo.ttft_s is None else float(np.mean(result.ttft_s <= self.slo.ttft_s))
        return Prediction(ttft, result.attainment)


def synthetic_workload(load: Forecast, window_s: float, max_requests: int, seed: int) -> Workload | None:
    """The forecast as requests (None: no request at all)."""
    n = min(max_requests, round(load.rate_per_s * window_s) + load.backlog)
    if n < 1:
        return None
    arrivals = np.zeros(n)
    fresh = n - min(load.backlog, n)
    if fresh:
        gaps = np.random.default_rng(seed).exponential(1.0 / load.rate_per_s, fresh)
        arrivals[n - fresh:] = np.cumsum(gaps)
    lengths = max(1, round(load.mean_input_tokens)), max(1, round(load.mean_output_tokens))
    return Workload(tuple(PlanRequest(float(t), *lengths) for t in arrivals))
