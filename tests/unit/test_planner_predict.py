"""The next interval's load: ahead of a ramp, at once on a burst, slow to forget either."""

from __future__ import annotations

import pytest

from xpyd.planner.observe import Interval
from xpyd.planner.predict import Forecast, Predictor, PredictorConfig


def interval(rate: float, input_tokens: float = 1000, output_tokens: float = 100, measured: bool = True,
             waiting: int = 0) -> Interval:
    return Interval(0.0, 10.0, rate, 0, 0, input_tokens, output_tokens, measured, None, None, None, None, None,
                    0, waiting)


def feed(p: Predictor, rates) -> list[float]:
    return [p.update(interval(r)).rate_per_s for r in rates]


def test_a_steady_load_is_forecast_as_it_is():
    assert feed(Predictor(), [5.0] * 6) == pytest.approx([5.0] * 6)


def test_a_ramp_is_forecast_ahead_of_the_last_interval():
    rates = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    out = feed(Predictor(), rates)
    assert all(f > r for f, r in zip(out[1:], rates[1:]))  # a step ahead of what was seen
    assert out[-1] <= rates[-1] + 1.0 + 1e-9  # ... by no more than one interval's rise


def test_a_burst_is_met_at_once_and_forgotten_slowly():
    out = feed(Predictor(), [2.0, 2.0, 10.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0])
    assert out[2] >= 10.0  # the burst's own interval: at least its rate
    after = out[3:]
    assert all(a >= b for a, b in zip(after, after[1:]))  # then down, never up again
    assert after[0] > 3.0 and after[-1] < 2.5  # still above the base for a while, back near it later


def test_a_fall_ends_the_trend():
    p = Predictor()
    feed(p, [1.0, 2.0, 3.0, 4.0])
    assert p.update(interval(1.0)).rate_per_s < 4.0  # the EWMA, no longer the ramp's projection


def test_lengths_follow_measured_intervals_only():
    p = Predictor(PredictorConfig(alpha=0.5))
    assert p.update(interval(1.0, 1000, 100)).mean_input_tokens == 1000
    f = p.update(interval(1.0, 3000, 300))
    assert (f.mean_input_tokens, f.mean_output_tokens) == (2000, 200)
    f = p.update(interval(1.0, 1, 1, measured=False))  # the defaults: no news
    assert (f.mean_input_tokens, f.mean_output_tokens) == (2000, 200)


def test_the_backlog_is_carried():
    assert Predictor().update(interval(1.0, waiting=7)).backlog == 7


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        PredictorConfig(alpha=0)
    with pytest.raises(ValueError):
        PredictorConfig(trend_intervals=-1)
    with pytest.raises(ValueError):
        Forecast(-1.0, 10, 10)
