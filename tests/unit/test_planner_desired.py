"""`xpyd planner --mode metrics`'s fleet (``planner_workers.DesiredReplicas``): the desired counts, seeded once from
the workers the real proxy's metrics say it knows, never under one of a role."""

from __future__ import annotations

import pytest

from xpyd.launcher.planner_loop import WorkersError
from xpyd.launcher.planner_workers import DesiredReplicas
from xpyd.planner.controller import Fleet, Role
from xpyd.proxy.metrics import ProxyMetrics


def _proxy_text(prefill: tuple[int, int], decode: tuple[int, int]) -> str:
    metrics = ProxyMetrics()
    metrics.set_workers("prefill", *prefill)
    metrics.set_workers("decode", *decode)
    return metrics.render()[0].decode()


def test_the_fleet_starts_from_the_workers_the_proxy_knows_up_or_down():
    desired = DesiredReplicas()
    with pytest.raises(WorkersError, match="no fleet yet"):
        desired.fleet()
    desired.seed(_proxy_text((2, 1), (4, 0)))
    assert desired.seeded and desired.fleet() == Fleet(3, 4)
    desired.seed(_proxy_text((9, 0), (9, 0)))  # (only the first time: then the planner's own count)
    assert desired.fleet() == Fleet(3, 4)


def test_a_proxy_that_knows_no_worker_yet_seeds_one_of_each():
    desired = DesiredReplicas()
    desired.seed(_proxy_text((0, 0), (0, 0)))
    assert desired.fleet() == Fleet(1, 1)


def test_starts_and_drains_change_the_desired_count_never_under_one():
    desired = DesiredReplicas()
    desired.seed(_proxy_text((1, 0), (2, 0)))
    assert desired.start(Role.PREFILL) == "desired prefill replicas 1 -> 2"
    assert desired.drain(Role.DECODE) == "desired decode replicas 2 -> 1"
    assert desired.drain(Role.DECODE) is None
    assert desired.fleet() == Fleet(2, 1)


def test_text_that_is_not_prometheus_is_refused():
    with pytest.raises(ValueError):
        DesiredReplicas().seed("xpyd_proxy_workers{role=prefill 1\n")
