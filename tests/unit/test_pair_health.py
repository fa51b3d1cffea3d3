"""Which prefill/decode pairs the proxy avoids (xpyd.proxy.pairs), on a clock the test moves."""

from __future__ import annotations

import pytest

from xpyd.discovery.types import Role, WorkerInfo
from xpyd.proxy.pairs import PairHealth


def worker(role: Role, i: int) -> WorkerInfo:
    return WorkerInfo(role, f"http://10.0.{int(role is Role.DECODE)}.{i}:8100", f"10.0.0.{i}:9100", "m", 1, 8)


P0, P1 = worker(Role.PREFILL, 0), worker(Role.PREFILL, 1)
D0, D1 = worker(Role.DECODE, 0), worker(Role.DECODE, 1)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_a_failed_pair_cools_down_then_is_usable_again(clock):
    pairs = PairHealth(base=5.0, cap=60.0, clock=clock)
    assert pairs.failed(P0, D0, "cut") == 5.0
    assert not pairs.usable(P0, D0)
    assert pairs.usable(P0, D1) and pairs.usable(P1, D0)  # the workers themselves are fine
    clock.now += 4.9
    assert not pairs.usable(P0, D0)
    clock.now += 0.1
    assert pairs.usable(P0, D0)
    assert pairs.to_dict() == [{"prefill": P0.http_url, "decode": D0.http_url, "cooling_for": 0.0,
                                "failures": 1, "trying": False, "reason": "cut"}]


def test_failing_again_after_the_cooldown_doubles_it_up_to_the_cap_and_success_resets_it(clock):
    pairs = PairHealth(base=5.0, cap=12.0, clock=clock)
    assert pairs.failed(P0, D0, "a") == 5.0
    clock.now += 1
    assert pairs.failed(P0, D0, "b") == 5.0  # in flight when it broke: the same failure, not a longer one
    assert pairs.to_dict()[0]["cooling_for"] == 4.0 and pairs.to_dict()[0]["reason"] == "b"
    clock.now += 4
    assert pairs.failed(P0, D0, "c") == 10.0  # tried again and failed again
    clock.now += 10
    assert pairs.failed(P0, D0, "d") == 12.0  # capped
    assert pairs.to_dict()[0]["failures"] == 3
    clock.now += 12
    pairs.ended(P0, D0, pairs.started(P0, D0), completed=True)
    assert pairs.to_dict() == []
    assert pairs.failed(P0, D0, "e") == 5.0  # starts over


def test_after_the_cooldown_one_request_tries_the_pair_while_the_others_still_avoid_it(clock):
    pairs = PairHealth(base=5.0, clock=clock)
    pairs.failed(P0, D0, "cut")
    forced = pairs.started(P0, D0)  # (a request while it cools: no pair but this one was left)
    pairs.ended(P0, D0, forced, completed=False)
    clock.now += 5
    assert pairs.usable(P0, D0)
    trial = pairs.started(P0, D0)  # the trial
    assert not pairs.usable(P0, D0) and pairs.to_dict()[0]["trying"]
    pairs.ended(P0, D0, trial, completed=False)  # the client left before it showed anything
    assert pairs.usable(P0, D0)
    trial = pairs.started(P0, D0)
    assert pairs.failed(P0, D0, "still cut") == 10.0  # the trial failed: twice as long
    pairs.ended(P0, D0, trial, completed=False)
    assert not pairs.usable(P0, D0)
    clock.now += 10
    pairs.ended(P0, D0, pairs.started(P0, D0), completed=True)  # it went through: healthy
    assert pairs.usable(P0, D0) and pairs.to_dict() == []
    pairs.started(P0, D0)  # (a healthy pair is not tried: it is used)
    assert pairs.usable(P0, D0)


def test_a_request_that_started_before_the_failure_does_not_clear_the_pair(clock):
    """A stream whose KV crossed before the path broke completes after it broke: that says nothing about the
    path now. Only a request started after the failure (forced there, or the trial) may clear it."""
    pairs = PairHealth(base=5.0, clock=clock)
    old, older = pairs.started(P0, D0), pairs.started(P0, D0)
    pairs.failed(P0, D0, "cut")
    pairs.ended(P0, D0, old, completed=True)
    assert not pairs.usable(P0, D0) and pairs.to_dict()[0]["failures"] == 1
    clock.now += 5
    trial = pairs.started(P0, D0)
    pairs.ended(P0, D0, older, completed=True)  # after the cool-down, still older than the failure
    assert pairs.to_dict()[0]["trying"] and not pairs.usable(P0, D0)
    pairs.ended(P0, D0, older, completed=False)  # nor does its end free the trial's place
    assert not pairs.usable(P0, D0)
    pairs.ended(P0, D0, trial, completed=True)
    assert pairs.usable(P0, D0) and pairs.to_dict() == []


def test_a_later_failure_of_an_older_request_keeps_newer_ones_from_clearing_the_pair(clock):
    """While it cools, a request routed there anyway (no other pair) started after the first failure; an
    older request failing after that starts the count again: requests started before it clear nothing."""
    pairs = PairHealth(base=5.0, clock=clock)
    old = pairs.started(P0, D0)
    pairs.failed(P0, D0, "cut")
    forced = pairs.started(P0, D0)
    clock.now += 1
    assert pairs.failed(P0, D0, "cut, seen by an older request") == 5.0
    pairs.ended(P0, D0, old, completed=False)
    pairs.ended(P0, D0, forced, completed=True)
    assert not pairs.usable(P0, D0)
    later = pairs.started(P0, D0)
    pairs.ended(P0, D0, later, completed=True)
    assert pairs.usable(P0, D0) and pairs.to_dict() == []


def test_a_prefill_worker_is_stranded_when_each_of_its_pairs_is_avoided(clock):
    pairs = PairHealth(base=5.0, clock=clock)
    assert not pairs.stranded(P0, [D0, D1])
    pairs.failed(P0, D0, "cut")
    assert not pairs.stranded(P0, [D0, D1])  # p0 still has d1
    assert pairs.stranded(P0, [D0]) and not pairs.stranded(P1, [D0])
    assert not pairs.stranded(P0, [])  # no decode worker up: nothing to say about its pairs
    clock.now += 5
    assert not pairs.stranded(P0, [D0])


@pytest.mark.parametrize("base, cap", [(0.0, 60.0), (-1.0, 60.0), (10.0, 5.0)])
def test_a_cooldown_that_makes_no_sense_is_refused(base, cap):
    with pytest.raises(ValueError, match="cool-down"):
        PairHealth(base=base, cap=cap)
