"""The planner's SLO: parsing (errors name the field) and whether a request meets it."""

from __future__ import annotations

import pytest

from xpyd.planner.slo import PlanSLO, RequestTimes


def test_units_and_defaults():
    slo = PlanSLO.parse("ttft=2s, itl=50ms, tpot=40, e2e=1500000us")
    assert (slo.ttft_s, slo.itl_s, slo.tpot_s, slo.e2e_s) == pytest.approx((2.0, 0.05, 0.04, 1.5))
    assert slo.attainment == 0.95


@pytest.mark.parametrize("text, share", [("attainment=0.9", 0.9), ("attainment=99%", 0.99), ("attainment=1", 1.0)])
def test_attainment(text, share):
    assert PlanSLO.parse(f"ttft=1s,{text}").attainment == pytest.approx(share)


@pytest.mark.parametrize("text, field", [
    ("ttft=fast", "ttft"), ("itl=-5ms", "itl"), ("ttft=0", "ttft"), ("attainment=1.5,ttft=1s", "attainment"),
    ("ttft=1s,attainment=0", "attainment"), ("ttft=1s,attainment=most", "attainment"), ("latency=1s", "latency"),
    ("ttft=1s,ttft=2s", "ttft"), ("ttft", "ttft"),
])
def test_errors_name_the_field(text, field):
    with pytest.raises(ValueError, match=field):
        PlanSLO.parse(text)


def test_a_target_is_required():
    with pytest.raises(ValueError, match="at least one"):
        PlanSLO.parse("attainment=0.9")
    with pytest.raises(ValueError, match="at least one"):
        PlanSLO.parse("")


def test_met_checks_every_target():
    slo = PlanSLO.parse("ttft=1s,itl=100ms,tpot=50ms")
    assert slo.met(RequestTimes(1.0, 0.1, 0.05, 9.0))  # inclusive
    assert not slo.met(RequestTimes(1.01, 0.1, 0.05, 9.0))
    assert not slo.met(RequestTimes(0.5, 0.2, 0.05, 9.0))  # one long gap
    assert not slo.met(RequestTimes(0.5, 0.1, 0.06, 9.0))
    assert slo.met(RequestTimes(0.5, None, None, 0.5))  # a one-token answer has no gaps


def test_describe_round_trips():
    slo = PlanSLO.parse("ttft=2s,itl=50ms,attainment=0.9")
    assert PlanSLO.parse(slo.describe()) == slo
