"""The online planner's loop (``xpyd.launcher.planner_loop``) over fakes: metrics texts from the real
``ProxyMetrics``, a model whose capacity is a number of requests a second per worker, and workers recorded as
they are started and drained (`xpyd up`'s), or that fail as an unreachable API does; what it keeps for /cluster."""

from __future__ import annotations

import json

from xpyd.discovery.planner_state import MAX_DECISIONS, PlannerMode, Target, decode_state, encode_state
from xpyd.launcher.planner_loop import PlannerLoop, PlannerLoopConfig, SupervisedWorkers, WorkersError
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


def _loop(tmp_path, metrics: ProxyMetrics, dwell: float = 0.0, workers=None):
    cluster, started = FakeCluster(), []

    def spawn(kind: str, i: int) -> str:
        started.append(f"{kind} {i}")
        return f"{kind} {i}"

    workers = workers or SupervisedWorkers(cluster, spawn, 1, 1, port_free=lambda role, i: i != 2)
    config = PlannerConfig(slo=PlanSLO.parse("ttft=2s,itl=200ms,attainment=0.9"), max_workers=6, dwell_s=dwell,
                           down_intervals=2)
    said: list[str] = []
    loop = PlannerLoop(Controller(config, Capacity()), workers, lambda: {"proxy": metrics.render()[0].decode()},
                       PlannerLoopConfig(10.0, tmp_path / "decisions.jsonl"), said.append,
                       clock=lambda: 1_700_000_000.0 + len(said))
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


def test_the_state_for_cluster_holds_the_target_and_the_last_decisions_with_their_workers(tmp_path):
    metrics = ProxyMetrics()
    loop, workers, _, _, _ = _loop(tmp_path, metrics)
    state = loop.state()
    assert (state.mode, state.target, state.decisions, state.max_workers) == (PlannerMode.LOCAL, None, (), 6)
    assert state.slo == "ttft=2000ms,itl=200ms,attainment=0.9" and state.interval_s == 10.0
    loop.tick(0.0)
    _serve(metrics, 30)
    loop.tick(10.0)
    state = loop.state()
    assert state.target == Target(2, 2) and state.updated_at >= 1_700_000_000.0
    assert [(d.role.value, d.delta, d.target, d.workers, d.error) for d in state.decisions] == [
        ("prefill", 1, 2, ("prefill 1",), None), ("decode", 1, 2, ("decode 1",), None)]
    assert all(d.at >= 1_700_000_000.0 and "predicted" in d.reason for d in state.decisions)
    assert decode_state(encode_state(state)) == state  # (what the proxy reads back)


def test_only_the_last_decisions_are_kept(tmp_path):
    metrics = ProxyMetrics()
    loop, _, _, _, _ = _loop(tmp_path, metrics)
    loop.tick(0.0)
    t = 0.0
    for i in range(MAX_DECISIONS):  # a busy interval and an idle one: ups, then downs, again and again
        _serve(metrics, 30 if i % 4 == 0 else 0)
        t += 10.0
        loop.tick(t)
    assert len(loop.recent) == MAX_DECISIONS and len(loop.state().decisions) == MAX_DECISIONS
    assert len((tmp_path / "decisions.jsonl").read_text().splitlines()) > MAX_DECISIONS


class BrokenAPI:
    """Workers behind an API that answers the fleet (or not) and refuses every change."""

    def __init__(self, fleet_fails: bool) -> None:
        self.fleet_fails = fleet_fails

    def fleet(self) -> Fleet:
        if self.fleet_fails:
            raise WorkersError("GET .../scale: HTTP 503")
        return Fleet(1, 1)

    def start(self, role: Role) -> str:
        raise WorkersError("PATCH .../scale: HTTP 403: forbidden")

    def drain(self, role: Role, busy=None) -> str | None:
        raise WorkersError("PATCH .../scale: HTTP 403: forbidden")


def test_a_fleet_that_cannot_be_read_skips_the_interval(tmp_path):
    metrics = ProxyMetrics()
    loop, _, _, _, said = _loop(tmp_path, metrics, workers=BrokenAPI(fleet_fails=True))
    loop.tick(0.0)
    _serve(metrics, 30)
    assert loop.tick(10.0) == [] and loop.state().target is None
    assert any("the fleet is unknown this interval (GET .../scale: HTTP 503)" in s for s in said)


def test_a_change_that_fails_is_recorded_with_its_error_and_the_fleet_stays(tmp_path):
    metrics = ProxyMetrics()
    loop, _, _, _, said = _loop(tmp_path, metrics, workers=BrokenAPI(fleet_fails=False))
    loop.tick(0.0)
    _serve(metrics, 30)
    decisions = loop.tick(10.0)
    assert [(d.role, d.delta) for d in decisions] == [(Role.PREFILL, 1), (Role.DECODE, 1)]
    state = loop.state()
    assert state.target == Target(1, 1)  # nothing changed
    assert [(d.workers, d.error) for d in state.decisions] == [((), "PATCH .../scale: HTTP 403: forbidden")] * 2
    assert any("started nothing" in s and "(failed: PATCH" in s for s in said)
    lines = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert [d["error"] for d in lines] == ["PATCH .../scale: HTTP 403: forbidden"] * 2


def test_the_least_busy_worker_drains_by_the_last_scrape_and_the_newest_on_a_tie_or_without_one():
    from xpyd.planner.observe import Scrape

    cluster = FakeCluster()
    workers = SupervisedWorkers(cluster, lambda kind, i: f"{kind} {i}", 1, 4, port_free=lambda role, i: True)
    gauges = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {r}\n" \
             "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting {w}\n"
    scrape = Scrape.parse(0.0, {"decode 0": gauges.format(r=5, w=1), "decode 1": gauges.format(r=1, w=0),
                                "decode 2": gauges.format(r=0, w=1), "decode 3": gauges.format(r=3, w=0)})
    assert scrape.busy("decode 0") == 6 and scrape.busy("decode 1") == 1 and scrape.busy("decode 9") is None
    assert workers.drain(Role.DECODE, scrape.busy) == "decode 2"  # (1 request, the newest of the two with 1)
    assert workers.drain(Role.DECODE, scrape.busy) == "decode 1"
    assert workers.drain(Role.DECODE) == "decode 3"  # (nothing known: the newest)
    assert workers.drain(Role.DECODE, scrape.busy) is None  # (the last one stays)
    assert cluster.drained == ["decode 2", "decode 1", "decode 3"] and workers.fleet() == Fleet(1, 1)
