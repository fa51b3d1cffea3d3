"""The online planner's decisions, stepped interval by interval against a fake fleet model."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from planner_fixtures import linear_profile
from xpyd.planner.controller import Controller, Decision, Fleet, PlannerConfig, Role
from xpyd.planner.observe import Interval
from xpyd.planner.online_model import Prediction, SimFleetModel, synthetic_workload
from xpyd.planner.predict import Forecast
from xpyd.planner.slo import PlanSLO

SLO = PlanSLO(ttft_s=1.0, itl_s=0.05, attainment=0.95)
STEP_S = 10.0


@dataclass
class CapacityModel:
    """Each prefill worker serves ``prefill_rps`` within the TTFT target, each decode worker ``decode_rps``;
    past that, the share met falls as capacity / rate."""

    prefill_rps: float = 1.0
    decode_rps: float = 2.0
    calls: int = 0

    def predict(self, prefill: int, decode: int, load: Forecast) -> Prediction:
        self.calls += 1
        if load.rate_per_s == 0:
            return Prediction(1.0, 1.0)
        p = min(1.0, prefill * self.prefill_rps / load.rate_per_s)
        return Prediction(p, min(p, decode * self.decode_rps / load.rate_per_s))


def interval(rate: float) -> Interval:
    return Interval(0.0, STEP_S, rate, 0, 0, 1000, 100, True, None, None, None, None, None, 0, 0)


def run(controller: Controller, fleet: Fleet, rates) -> tuple[Fleet, list[Decision]]:
    """Feed one interval per rate, apply every decision at once; the fleet at the end and every decision."""
    decisions = []
    for k, rate in enumerate(rates):
        for d in controller.decide(k * STEP_S, interval(rate), fleet):
            assert d.target == fleet.count(d.role) + d.delta
            fleet = Fleet(**{**{r.value: fleet.count(r) for r in Role}, d.role.value: d.target})
            decisions.append(d)
        assert fleet.prefill + fleet.decode <= controller.config.max_workers
    return fleet, decisions


def controller(model=None, **kw) -> Controller:
    kw.setdefault("dwell_s", 0.0)
    return Controller(PlannerConfig(SLO, **{"max_workers": 16, **kw}), model or CapacityModel())


def test_a_ramp_scales_both_roles_up_with_reasons():
    fleet, decisions = run(controller(), Fleet(1, 1), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 6.0, 6.0])
    assert fleet.prefill >= 6 and fleet.decode >= 3  # 6 req/s: 6 prefill (1 each) and 3 decode (2 each)
    assert all(d.delta > 0 for d in decisions)
    assert {d.role for d in decisions} == {Role.PREFILL, Role.DECODE}
    up = decisions[0]
    assert up.reason.startswith("at ") and "predicted to meet" in up.reason and "< 95.0%" in up.reason


def test_a_steady_load_makes_no_decision():
    fleet, decisions = run(controller(), Fleet(4, 2), [3.9] * 20)
    assert decisions == [] and fleet == Fleet(4, 2)


def test_a_load_alternating_around_a_threshold_does_not_flap():
    # 3 prefill workers meet 95% up to 3.16 req/s; the load alternates 3.0 / 3.3
    fleet, decisions = run(controller(), Fleet(3, 2), [3.0, 3.3] * 15)
    assert [(d.role, d.delta) for d in decisions] == [(Role.PREFILL, 1)]  # up once, then held by the band
    assert fleet == Fleet(4, 2)


def test_no_role_changes_twice_within_the_dwell_time():
    c = controller(dwell_s=60.0)
    fleet, decisions = run(c, Fleet(1, 1), [float(r) for r in range(1, 16)])
    for role in Role:
        times = [d.at_s for d in decisions if d.role is role]
        assert times and all(b - a >= 60.0 for a, b in zip(times, times[1:]))
    assert any("dwell 60s" in n for n in c.notes)  # the load still outgrows the fleet: held, and said why


def test_scale_down_waits_for_consecutive_intervals_and_steps_one_at_a_time():
    c = controller(down_intervals=3)
    fleet, decisions = run(c, Fleet(6, 4), [1.0, 1.0])
    assert decisions == []  # two intervals: not yet
    fleet, decisions = run(c, fleet, [1.0])
    assert [(d.role, d.delta) for d in decisions] == [(Role.PREFILL, -1), (Role.DECODE, -1)]
    assert "3 intervals in a row" in decisions[0].reason and "headroom" in decisions[0].reason


def test_one_busy_interval_resets_the_scale_down_streak():
    _, calm = run(controller(down_intervals=3), Fleet(4, 2), [1.0, 1.0, 1.0, 1.0, 1.0])
    assert calm and all(d.delta < 0 for d in calm)
    _, decisions = run(controller(down_intervals=3), Fleet(4, 2), [1.0, 1.0, 3.0, 1.0, 1.0])
    assert decisions == []  # 3 req/s needs the 4 prefill and 2 decode workers: the streak starts again


def test_max_workers_is_never_passed_and_the_hold_is_said():
    c = controller(max_workers=6)
    fleet, _ = run(c, Fleet(1, 1), [50.0] * 12)
    assert fleet.prefill + fleet.decode == 6
    assert any("--max-workers 6" in n for n in c.notes)


def test_max_step_starts_several_at_once():
    _, decisions = run(controller(max_step=4), Fleet(1, 4), [5.0])
    assert [(d.role, d.delta, d.target) for d in decisions] == [(Role.PREFILL, 4, 5)]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max-workers"):
        PlannerConfig(SLO, max_workers=1)
    with pytest.raises(ValueError):
        PlannerConfig(SLO, headroom=1.0)
    with pytest.raises(ValueError):
        PlannerConfig(SLO, dwell_s=-1)
    with pytest.raises(ValueError):
        Decision(0.0, Role.DECODE, 0, 2, "nothing")
    with pytest.raises(ValueError):
        Fleet(-1, 1)


def test_the_sim_model_predicts_more_met_with_more_prefill_workers():
    profile = linear_profile(prefill_per_token=1e-3)  # a 500-token prompt: 0.5 s on one worker
    model = SimFleetModel(profile, PlanSLO(ttft_s=1.0, attainment=0.9), window_s=30.0)
    load = Forecast(4.0, 500, 4)  # 2 req/s a worker at most
    one, three = model.predict(1, 1, load), model.predict(3, 1, load)
    assert one.prefill_met < 0.5 and three.prefill_met > 0.9
    assert model.predict(3, 1, load) == three  # seeded: the same forecast, the same answer
    assert model.predict(1, 1, Forecast(0.0, 500, 4)) == Prediction(1.0, 1.0)


def test_the_synthetic_workload_is_the_forecast():
    w = synthetic_workload(Forecast(2.0, 300, 20, backlog=5), window_s=50.0, max_requests=1000, seed=1)
    assert len(w.requests) == 105
    assert [r.arrival_s for r in w.requests[:5]] == [0.0] * 5  # the backlog, at once
    assert {(r.input_tokens, r.output_tokens) for r in w.requests} == {(300, 20)}
    assert 35.0 < w.span_s < 65.0  # 100 Poisson arrivals at 2/s
    assert synthetic_workload(Forecast(0.0, 300, 20), 50.0, 1000, 1) is None
