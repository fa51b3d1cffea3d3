"""The next interval's load, from the intervals seen so far.

The rate forecast is the larger of an EWMA of the arrival rate (which remembers a burst for a while, so the
fleet does not shrink the moment one ends) and the last interval's rate plus its trend (an EWMA of the
interval-to-interval increases, reset by a fall), so a ramp is met a step ahead and a burst at once. The
mean lengths are EWMAs of the measured ones (intervals with default lengths leave them as they were). Requests
waiting for a decode slot at the end of an interval are carried into the forecast as a backlog.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xpyd.planner.observe import Interval

__all__ = ["Forecast", "Predictor", "PredictorConfig"]


@dataclass(frozen=True, slots=True)
class PredictorConfig:
    alpha: float = 0.3  # the newest interval's weight in the rate's and the lengths' EWMAs
    trend_alpha: float = 0.5  # ... in the trend's EWMA
    trend_intervals: float = 1.0  # how many intervals ahead the trend is projected

    def __post_init__(self) -> None:
        for name in ("alpha", "trend_alpha"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v <= 1):
                raise ValueError(f"{name.replace('_', ' ')} must be in (0, 1], got {v!r}")
        if not (math.isfinite(self.trend_intervals) and self.trend_intervals >= 0):
            raise ValueError(f"trend intervals must be >= 0, got {self.trend_intervals!r}")


@dataclass(frozen=True, slots=True)
class Forecast:
    rate_per_s: float
    mean_input_tokens: float
    mean_output_tokens: float
    backlog: int = 0  # requests already waiting at the start

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_per_s) and self.rate_per_s >= 0):
            raise ValueError(f"a forecast rate must be >= 0, got {self.rate_per_s!r}")
        if not (self.mean_input_tokens >= 1 and self.mean_output_tokens >= 1):
            raise ValueError(f"mean lengths must be >= 1 token, got {self.mean_input_tokens!r}, "
                             f"{self.mean_output_tokens!r}")
        if self.backlog < 0:
            raise ValueError(f"a backlog must be >= 0 requests, got {self.backlog}")

    def describe(self) -> str:
        queued = f", {self.backlog} waiting" if self.backlog else ""
        return (f"{self.rate_per_s:.3g} req/s (in {self.mean_input_tokens:.0f} / out {self.mean_output_tokens:.0f} "
                f"tokens{queued})")


class Predictor:
    """Fed one ``Interval`` at a time (``update``), answers the next one's ``Forecast``."""

    def __init__(self, config: PredictorConfig = PredictorConfig()) -> None:
        self.config = config
        self._rate: float | None = None  # the EWMA
        self._last: float | None = None
        self._trend = 0.0
        self._input: float | None = None
        self._output: float | None = None

    def update(self, interval: Interval) -> Forecast:
        c, rate = self.config, interval.arrivals_per_s
        if self._last is None:
            self._rate = rate
        else:
            rise = rate - self._last  # a fall ends a ramp
            self._trend = 0.0 if rise < 0 else c.trend_alpha * rise + (1 - c.trend_alpha) * self._trend
            self._rate = c.alpha * rate + (1 - c.alpha) * self._rate
        self._last = rate
        if interval.lengths_measured or self._input is None:
            self._input = _ewma(self._input, interval.mean_input_tokens, c.alpha)
            self._output = _ewma(self._output, interval.mean_output_tokens, c.alpha)
        forecast = max(self._rate, rate + c.trend_intervals * self._trend)
        return Forecast(forecast, self._input, self._output, interval.queue_waiting)


def _ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else alpha * new + (1 - alpha) * old
