"""The planner's decisions on the proxy's /cluster, for real: a real etcd, sim workers (1P1D) and the proxy
discovering them there, and the real `xpyd planner --mode metrics` reading the proxy's and the workers' /metrics.

Under an SLO no fleet meets (TTFT and ITL of 1 ms) and a trickle of requests, the planner's first interval asks for
one more worker of each role: its /metrics says so (``xpyd_planner_desired_replicas``, what an HPA or KEDA reads),
and the proxy's /cluster shows its mode, target and decisions with their reasons, read back from etcd. Stopped, its
state leaves etcd and /cluster says null. A value in etcd that is not a planner's state is ignored (logged) and the
proxy goes on answering; the state `xpyd up --planner` writes from its synchronous loop (``BlockingPublisher``)
shows the same way.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import Cluster, free_port
from xpyd.discovery.etcd_common import connect
from xpyd.discovery.local_etcd import LocalEtcd
from xpyd.discovery.planner_state import PLANNER_KEY, DecisionRecord, PlannerMode, PlannerState, Target
from xpyd.discovery.types import Role
from xpyd.launcher.planner_publish import BlockingPublisher

PROFILE = {  # the sim workers' timing (they run with --sim-speedup inf: no simulated time)
    "format": "xpyd-sim-profile/1", "model": "test", "machine": "test", "dtype": "float32", "threads": 1,
    "created": "2026-01-01T00:00:00Z",
    "prefill": {"new_tokens": [1, 1024], "cached_tokens": [0, 1024], "seconds": [[0.001, 0.001], [0.01, 0.01]]},
    "decode": {"batch": [1, 8], "context_tokens": [1, 4096], "seconds": [[0.001, 0.002], [0.002, 0.003]]},
}


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _cluster(proxy: str) -> dict:
    status, body = _get(proxy + "/cluster")
    assert status == 200, body
    return json.loads(body)


def _desired(planner: str) -> dict[str, float]:
    _, text = _get(planner + "/metrics")
    return {s.labels["role"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "xpyd_planner_desired_replicas"}


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout:g}s: {what}"
        time.sleep(0.2)


def _etcd(endpoint: str, op):
    async def run():
        client = connect(endpoint)
        try:
            return await op(client)
        finally:
            await client.close()
    return asyncio.run(run())


@pytest.fixture
def sim_cluster(tmp_path: Path, etcd: LocalEtcd, smollm_dir: Path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    options = ["--model", str(smollm_dir), "--engine", "sim", "--sim-profile", str(profile), "--sim-speedup", "inf",
               "--served-model-name", "m", "--threads", "1", "--batch-size", "4", "--max-model-len", "512",
               "--etcd", etcd.endpoint]
    c = Cluster(tmp_path)
    pp, ps, dp, dk, xp = (free_port() for _ in range(5))
    urls = {"proxy": f"http://127.0.0.1:{xp}"}
    try:
        c.start("prefill", ["prefill", *options, "--port", str(pp), "--signal-port", str(ps)], f"http://127.0.0.1:{pp}")
        c.start("decode", ["decode", *options, "--port", str(dp), "--kv-port", str(dk)], f"http://127.0.0.1:{dp}")
        # (with the workers: a proxy in dynamic mode starts with none and answers /health once a prefill and
        # a decode worker registered)
        c.start("proxy", ["proxy", "--port", str(xp), "--etcd", etcd.endpoint], urls["proxy"])
        c.wait_healthy()
        yield c, urls
    finally:
        c.stop()


class Trickle:
    """A request every ~0.2 s through the proxy until stopped."""

    def __init__(self, proxy: str) -> None:
        self._proxy = proxy
        self._stop = threading.Event()
        self.answered = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        body = json.dumps({"model": "m", "prompt": "the quick brown fox jumps", "max_tokens": 6}).encode()
        while not self._stop.is_set():
            req = urllib.request.Request(self._proxy + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.status == 200
            self.answered += 1
            self._stop.wait(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def test_the_planners_decisions_reach_the_proxys_cluster_view_through_etcd(sim_cluster, etcd: LocalEtcd):
    c, urls = sim_cluster
    proxy = urls["proxy"]
    assert _cluster(proxy)["planner"] is None  # no planner runs
    port = free_port()
    planner = f"http://127.0.0.1:{port}"
    p = c.start("planner", ["planner", "--mode", "metrics", "--proxy-url", proxy, "--etcd", etcd.endpoint,
                            "--port", str(port), "--slo", "ttft=1ms,itl=1ms", "--max-workers", "4",
                            "--planner-interval", "1", "--planner-dwell", "600"], planner)
    load = Trickle(proxy)
    try:
        c.wait_healthy(60)
        _wait(lambda: _desired(planner) == {"prefill": 2.0, "decode": 2.0}, 60,
              f"the planner's desired replicas 2P2D; its log:\n{p.tail()}")
        view = _wait(lambda: (v := _cluster(proxy)["planner"]) and len(v["decisions"]) >= 2 and v, 10,
                     "the decisions on /cluster")
    finally:
        load.stop()
    assert load.answered > 0
    assert (view["mode"], view["target"], view["max_workers"], view["interval_s"]) == (
        "metrics", {"prefill": 2, "decode": 2}, 4, 1.0)
    assert view["slo"] == "ttft=1ms,itl=1ms,attainment=0.95" and view["updated_at"] > time.time() - 60
    first = view["decisions"][:2]
    assert [(d["role"], d["delta"], d["target"], d["error"]) for d in first] == [("prefill", 1, 2, None),
                                                                                 ("decode", 1, 2, None)]
    assert first[0]["workers"] == ["desired prefill replicas 1 -> 2"]
    assert first[1]["workers"] == ["desired decode replicas 1 -> 2"]
    assert all("predicted to meet" in d["reason"] for d in first)
    assert all("in 1024 / out 128" not in d["reason"] for d in first)  # (lengths from the workers' /metrics)
    assert abs(first[0]["at"] - time.time()) < 120
    kv = _etcd(etcd.endpoint, lambda client: client.get(PLANNER_KEY.encode()))
    lease = _etcd(etcd.endpoint, lambda client: client.get_lease_info(kv.lease))
    assert kv.lease != 0 and lease.grantedTTL == 10  # (a planner that dies: its state goes with the lease)

    p.popen.send_signal(signal.SIGTERM)
    assert p.popen.wait(60) == 0, p.tail()
    _wait(lambda: _cluster(proxy)["planner"] is None, 10, "the state gone with the planner")

    # Not a planner's state: ignored, logged, the proxy answers as before.
    for value in (b"{not json", json.dumps({"version": 1, "mode": "scale", "slo": "x", "max_workers": -3,
                                            "interval_s": 1, "updated_at": 0}).encode()):
        _etcd(etcd.endpoint, lambda client: client.put(PLANNER_KEY.encode(), value))
        time.sleep(0.5)
        assert _cluster(proxy)["planner"] is None
    proxy_log = next(q for q in c.procs if q.name == "proxy").tail(200)
    assert proxy_log.count(f"ignoring {PLANNER_KEY}") >= 2, proxy_log

    # What `xpyd up --planner` writes from its synchronous loop.
    state = PlannerState(PlannerMode.LOCAL, "ttft=1s", 4, 2.0, time.time(), Target(1, 2),
                         (DecisionRecord.of(time.time(), Role.DECODE, 1, 2, "a reason", ["decode 1"], None),))
    publisher = BlockingPublisher(etcd.endpoint, 2.0)
    try:
        assert publisher.publish(state)
        view = _wait(lambda: _cluster(proxy)["planner"], 10, "the launcher's state")
        assert view == json.loads(json.dumps(state.to_dict()))
    finally:
        publisher.close()
    _wait(lambda: _cluster(proxy)["planner"] is None, 10, "the launcher's state gone with it")


def test_planner_command_refuses_what_it_cannot_run():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "xpyd", "planner", *args], capture_output=True, text=True,
                              timeout=60, env=env)

    base = ("--proxy-url", "http://127.0.0.1:1", "--slo", "ttft=1s")
    done = run("--mode", "scale", *base, "--prefill-deployment", "p", "--decode-deployment", "d")
    assert done.returncode == 2 and "not in a Kubernetes pod" in done.stderr
    done = run("--mode", "scale", *base, "--prefill-deployment", "p")
    assert done.returncode == 2 and "--mode scale needs --decode-deployment" in done.stderr
    done = run("--mode", "metrics", "--proxy-url", "http://127.0.0.1:1")
    assert done.returncode == 2 and "needs --slo" in done.stderr
    done = run("--mode", "metrics", *base, "--max-workers", "1")
    assert done.returncode == 2 and "--max-workers" in done.stderr
