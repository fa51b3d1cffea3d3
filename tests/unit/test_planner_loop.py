"""`xpyd up --planner`'s loop (``xpyd.launcher.planner_loop``) over fakes: metrics texts from the real
``ProxyMetrics``, a model whose capacity is a number of requests a second per worker, and workers recorded as
they are started and drained."""

from __future__ import annotations

import json

from xpyd.launcher.planner_loop import PlannerLoop, PlannerLoopConfig, SupervisedWorkers
from xpyd.planner.controller import Controller, Fleet, PlannerConfig, Role
from xpyd.planner.online_model import Prediction
from xpyd.planner.slo import PlanSLO
from xpyd.proxy.metrics import Outcome, ProxyMetrics


class Capacity:
    """Each prefill worker takes 2 requests/s, each decode worker 1 (met: 1.0 within them, 0.5 beyond)."""

    def predict(self, prefill: int, decode: int, load) -> Prediction:
        rate = load.rate_per_s
        prefill_met = 1.0 if rate <= 2 * prefill else 0.5
        return Prediction(prefill_met, min(prefill_met, 1.0 if rate <= decode else 0.5))


class FakeCluster:
    def __init__(self) -> None:
        self.drained: list[str] = []

    def drain(self, name: str) -> None:
        self.drained.append(name)


def _loop(tmp_path, metrics: ProxyMetrics, dwell: float = 0.0):
    cluster, started = FakeCluster(), []

    def spawn(kind: str, i: int) -> str:
        started.append(f"{kind} {i}")
        return f"{kind} {i}"

    workers = SupervisedWorkers(cluster, spawn, 1, 1, port_free=lambda role, i: i != 2)
    config = PlannerConfig(slo=PlanSLO.parse("ttft=2s,itl=200ms,attainment=0.9"), max_workers=6, dwell_s=dwell,
                           down_intervals=2)
    said: list[str] = []
    loop = PlannerLoop(Controller(config, Capacity()), workers, lambda: {"proxy": metrics.render()[0].decode()},
                       PlannerLoopConfig(10.0, tmp_path / "decisions.jsonl"), said.append)
    return loop, workers, cluster, started, said


def _serve(metrics: ProxyMetrics, n: int) -> None:
    for _ in range(n):
        metrics.request("/v1/completions").end(Outcome.OK)


def test_a_load_above_the_fleet_starts_workers_with_their_reasons_and_a_lighter_one_drains_them(tmp_path):
    metrics = ProxyMetrics()
    loop, workers, cluster, started, said = _loop(tmp_path, metrics)
    assert loop.tick(0.0) == []  # the first scrape: nothing to compare yet
    assert loop.tick(5.0) == []  # not due
    _serve(metrics, 30)  # 3 requests/s over the next 10 s: one decode worker takes 1
    decisions = loop.tick(10.0)
    assert [(d.role, d.delta) for d in decisions] == [(Role.PREFILL, 1), (Role.DECODE, 1)]
    assert started == ["prefill 1", "decode 1"] and workers.fleet() == Fleet(2, 2)
    lines = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert [(d["role"], d["delta"], d["workers"]) for d in lines] == [("prefill", 1, ["prefill 1"]),
                                                                      ("decode", 1, ["decode 1"])]
    assert all("predicted" in d["reason"] for d in lines) and any("planner: decode +1 -> 2" in s for s in said)
    _serve(metrics, 40)
    loop.tick(20.0)
    assert started[-1] == "decode 3"  # (its port pair 2 is taken: the next one)
    for t in (30.0, 40.0, 50.0, 60.0):  # idle: one fewer meets it with headroom, twice in a row, then drained
        loop.tick(t)
    # each role's newest first (the third pair was taken: prefill 3 and decode 3 are the newest)
    assert [n for n in cluster.drained if n.startswith("decode")][0] == "decode 3"
    assert [n for n in cluster.drained if n.startswith("prefill")][:2] == ["prefill 3", "prefill 1"]
    assert workers.fleet() == Fleet(1, 2) and any("predicted to meet" in s and "-1" in s for s in said)


def test_a_scrape_that_fails_skips_the_interval(tmp_path):
    metrics = ProxyMetrics()
    loop, workers, _, started, said = _loop(tmp_path, metrics)

    def broken():
        raise OSError("connection refused")

    loop._scrape = broken
    assert loop.tick(0.0) == [] and loop.tick(10.0) == []
    assert started == [] and any("no metrics this interval (OSError" in s for s in said)
