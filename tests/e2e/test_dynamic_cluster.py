"""Dynamic xPyD: real etcd, real worker processes (tiny random Llama), the proxy discovering them.

Covers joining, leaving (SIGTERM and SIGKILL), 2P2D with on-demand peer
connections, and an etcd outage while requests flow.

The tests share one cluster: etcd, a prefill worker p0, a decode worker d0 and the proxy. Each test adds
the workers it needs (and kills or stops them); after each, the workers it added are stopped and the
cluster is back where the next test expects it: etcd up, the proxy routing to p0 and d0 alone, both up
and holding no request, KV or transfer.
"""

from __future__ import annotations

import copy

import asyncio
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.cluster import Cluster, free_port
from xpyd.discovery.local_etcd import LocalEtcd

PROMPTS = ["hello world", "the quick brown fox", "one two three four five", "a b c", "etcd is a key value store",
           "disaggregated prefill and decode"]
MAX_TOKENS = 8
LEASE_TTL = 2


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.numerics import decided_greedy

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    model64 = copy.deepcopy(model).double()  # every reference token is decided beyond float32 error
    out = {}
    for p in PROMPTS:
        ids = tok(p).input_ids
        out[p] = tok.decode(decided_greedy(model, model64, ids, MAX_TOKENS), skip_special_tokens=True)
    return out


class Watcher:
    """Our EtcdRegistry in a background loop, recording when each worker appeared / disappeared."""

    def __init__(self, endpoint: str) -> None:
        from xpyd.discovery.etcd import EtcdRegistry

        self.registry = EtcdRegistry(endpoint)
        self.appeared: dict[str, float] = {}
        self.gone: dict[str, float] = {}
        self._known: set[str] = set()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.registry.on_change(self._changed)
        asyncio.run_coroutine_threadsafe(self.registry.start(), self.loop).result(10)
        self._changed()

    def _changed(self) -> None:
        now = time.monotonic()
        urls = {w.http_url for role in ("prefill", "decode") for w in self._workers(role)}
        for u in urls - self._known:
            self.appeared[u] = now
        for u in self._known - urls:
            self.gone[u] = now
        self._known = urls

    def _workers(self, role: str):
        from xpyd.discovery.types import Role

        return self.registry.workers(Role(role))

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.registry.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Dyn:
    """The shared cluster (``base``: p0, d0, the proxy) and the workers the current test added (``added``)."""

    def __init__(self, workdir: Path, model: Path, etcd: LocalEtcd) -> None:
        self.base = Cluster(workdir)
        self.added = Cluster(workdir)
        self.model = model
        self.etcd = etcd
        self.proxy_url = ""
        self.p0 = self.d0 = None

    def worker(self, role: str, name: str, cluster: Cluster | None = None):
        port = free_port()
        args = [role, "--model", str(self.model), "--dtype", "float32", "--threads", "1", "--max-model-len",
                "256", "--batch-size", "4", "--etcd", self.etcd.endpoint, "--lease-ttl", str(LEASE_TTL),
                "--port", str(port)]
        args += ["--signal-port", str(free_port())] if role == "prefill" else ["--kv-port", str(free_port())]
        return (cluster or self.added).start(name, args, f"http://127.0.0.1:{port}")

    def start_base(self) -> None:
        self.p0 = self.worker("prefill", "p0", self.base)
        self.d0 = self.worker("decode", "d0", self.base)
        # (with the workers: a proxy in dynamic mode starts with none, answers /health once a prefill and a
        # decode worker registered, and finds the others as they register)
        port = free_port()
        self.proxy_url = f"http://127.0.0.1:{port}"
        self.base.start("proxy", ["proxy", "--port", str(port), "--etcd", self.etcd.endpoint], self.proxy_url)
        self.base.wait_healthy()
        self.wait_base_only()

    def wait_healthy(self) -> None:
        self.base.wait_healthy()
        self.added.wait_healthy()

    def wait_base_only(self) -> None:
        """Until the proxy routes to p0 and d0 alone, both up, and both hold nothing."""
        want = {self.p0.url, self.d0.url}
        _wait(lambda: set(self.by_url()) == want and all(w["health"] == "up" for w in self.by_url().values()),
              30, "the proxy to route to p0 and d0 alone, both up")
        idle = ("waiting", "running", "transferring", "blocks_used", "kv_used_bytes")
        _wait(lambda: all(_stats(u)[k] == 0 for u in want for k in idle), 30, "p0 and d0 idle")

    def end_test(self) -> None:
        """Stop the workers the test added (SIGTERM; those it killed are gone), bring etcd back if the test
        stopped it, and wait for the cluster to be back to p0 + d0, idle."""
        try:
            self.added.stop()
        finally:
            self.added = Cluster(self.base.workdir)
        if not self.etcd.running:
            self.etcd.start()
        for p in self.base.procs:
            assert p.popen.poll() is None, f"{p.name} exited with {p.popen.returncode}:\n{p.tail()}"
        self.wait_base_only()

    def cluster(self) -> dict:
        return json.loads(urllib.request.urlopen(self.proxy_url + "/cluster", timeout=5).read())

    def by_url(self) -> dict[str, dict]:
        return {w["http_url"]: w for w in self.cluster()["workers"]}


def complete(proxy_url: str, prompt: str, timeout: float = 60) -> tuple[int, str]:
    body = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    req = urllib.request.Request(proxy_url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())["choices"][0]["text"]
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError as e:
        return 0, str(e)


class Done(NamedTuple):
    t: float  # when it ended
    status: int
    prompt: str
    ok: bool  # 200 and the reference text
    start: float


class Load:
    """Requests flowing through the proxy from background threads until stopped."""

    def __init__(self, proxy_url: str, reference: dict, threads: int = 2) -> None:
        self.results: list[Done] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(proxy_url, reference, i), daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self, url: str, reference: dict, i: int) -> None:
        k = i
        while not self._stop.is_set():
            prompt = PROMPTS[k % len(PROMPTS)]
            k += 1
            start = time.monotonic()
            status, text = complete(url, prompt)
            self.results.append(Done(time.monotonic(), status, prompt, status == 200 and text == reference[prompt],
                                     start))

    def wait_done(self, n: int, started_after: float = 0.0, what: str = "requests through the proxy") -> None:
        """Until ``n`` requests that started after ``started_after`` have ended (a window with traffic)."""
        _wait(lambda: sum(r.start > started_after for r in self.results) >= n, 120, f"{n} {what}")

    def stop(self) -> list[tuple[float, int, str, bool]]:
        self._stop.set()
        for t in self._threads:
            t.join(90)
        return self.results


@pytest.fixture(scope="module")
def shared(tmp_path_factory, tiny_model_dir: Path):
    workdir = tmp_path_factory.mktemp("dynamic")
    etcd = LocalEtcd(data_dir=workdir / "etcd")
    etcd.start()
    d = Dyn(workdir, tiny_model_dir, etcd)
    try:
        d.start_base()
        yield d
    finally:
        d.added.stop()
        d.base.stop()
        etcd.stop()


@pytest.fixture
def dyn(shared: Dyn):
    """The shared cluster, p0 + d0 behind the proxy; put back so after the test (see the module docstring)."""
    yield shared
    shared.end_test()


def _wait(cond, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def _stats(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/xpyd/stats", timeout=5).read())


def test_2p2d_spreads_requests_and_connects_on_demand(dyn, reference):
    workers = [dyn.p0, dyn.worker("prefill", "p1"), dyn.d0, dyn.worker("decode", "d1")]
    dyn.wait_healthy()
    _wait(lambda: len(dyn.cluster()["workers"]) == 4, 10, "the proxy to see 4 workers")
    requests_before = {u: w["requests"] for u, w in dyn.by_url().items()}
    sends_before = {p.url: _stats(p.url)["sends"] for p in workers[:2]}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(24)]
    with ThreadPoolExecutor(3) as ex:
        results = list(ex.map(lambda p: complete(dyn.proxy_url, p), prompts))
    for p, (status, text) in zip(prompts, results):
        assert status == 200, text
        assert text == reference[p]
    by_url = dyn.by_url()
    for w in workers:  # every worker was used (p0 and d0 may have served earlier tests: count from now)
        assert by_url[w.url]["requests"] > requests_before[w.url], (by_url, requests_before)
    prefill_addrs = {by_url[w.url]["signal_addr"] for w in workers[:2]}

    def cross_pulls_seen() -> bool:  # (p0 and p1 are the only prefill workers this module ever runs)
        return all(set(_stats(d.url)["pulls"]) == prefill_addrs for d in workers[2:])

    # Routing picks each side independently, but under load the pairings can repeat for a while: send
    # a few more rounds (bounded) until each decode worker has pulled from both prefill workers.
    for _ in range(6):
        if cross_pulls_seen():
            break
        with ThreadPoolExecutor(3) as ex:
            for p, (status, text) in zip(prompts[:6], ex.map(lambda p: complete(dyn.proxy_url, p), prompts[:6])):
                assert status == 200 and text == reference[p], text
    assert cross_pulls_seen(), [_stats(d.url)["pulls"] for d in workers[2:]]
    for p in workers[:2]:
        s = _stats(p.url)
        sent_to = {d for d, n in s["sends"].items() if n > sends_before[p.url].get(d, 0)}
        assert s["blocks_used"] == 0 and len(sent_to) == 2, (s, sends_before[p.url])


def test_join_receives_requests_soon_after_registering(dyn, reference):
    watcher = Watcher(dyn.etcd.endpoint)
    load = Load(dyn.proxy_url, reference, threads=3)
    try:
        load.wait_done(3)
        late = dyn.worker("decode", "d-late")
        _wait(lambda: late.url in watcher.appeared, 120, "the late worker to register", 0.02)
        registered = watcher.appeared[late.url]
        first = _wait(lambda: dyn.by_url().get(late.url, {}).get("requests", 0) > 0 and time.monotonic(),
                      30, "a request on the late worker", 0.02)
        assert first - registered < 5.0  # pushed by etcd's watch (~1 s), not waiting for a re-sync or restart
    finally:
        results = load.stop()
        watcher.close()
    assert results and all(r.ok for r in results), [r for r in results if not r.ok][:3]


def test_sigterm_deregisters_at_once_and_no_request_fails(dyn, reference):
    victim = dyn.worker("decode", "d-term")  # (d0 is the decode worker that stays)
    dyn.wait_healthy()
    watcher = Watcher(dyn.etcd.endpoint)
    _wait(lambda: victim.url in watcher.appeared, 10, "the victim registered")
    _wait(lambda: len(dyn.cluster()["workers"]) == 3, 10, "the proxy to see 3 workers")
    load = Load(dyn.proxy_url, reference, threads=3)
    try:
        load.wait_done(6)
        t0 = time.monotonic()
        victim.popen.send_signal(signal.SIGTERM)
        _wait(lambda: victim.url in watcher.gone, 10, "the victim's key to disappear", 0.005)
        assert watcher.gone[victim.url] - t0 < LEASE_TTL / 2  # deregistered, not left to its lease expiring
        assert victim.popen.wait(40) == 0
        load.wait_done(6, started_after=time.monotonic(), what="requests after the victim exited")
    finally:
        results = load.stop()
        watcher.close()
    failed = [r for r in results if not r[3]]
    assert results and not failed, failed[:3]


def test_sigkill_stops_routing_after_first_failure(dyn, reference):
    victim = dyn.worker("decode", "d-kill")  # (d0 is the decode worker that stays)
    dyn.wait_healthy()
    _wait(lambda: len(dyn.cluster()["workers"]) == 3, 10, "the proxy to see 3 workers")
    load = Load(dyn.proxy_url, reference, threads=3)
    try:
        load.wait_done(6)
        victim.popen.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        seen: list[str] = []  # the victim's health at the proxy, "gone" once its lease expired

        def not_up() -> bool:
            seen.append(dyn.by_url().get(victim.url, {"health": "gone"})["health"])
            return seen[-1] != "up"
        _wait(not_up, LEASE_TTL + 10, "the victim marked down or gone", 0.02)
        t_down = time.monotonic()
        # Marked down by the proxy itself (a refused connection: a request's, or a health poll's) while
        # still registered: not found out by its lease expiring (LEASE_TTL s after the kill).
        assert seen[-1] == "down", seen[-5:]
        assert t_down - t_kill < LEASE_TTL / 2, t_down - t_kill
        before = dyn.by_url().get(victim.url, {}).get("requests")
        load.wait_done(9, started_after=t_down, what="requests after the victim was marked down")
        after = dyn.by_url().get(victim.url, {}).get("requests")
        assert after in (None, before)  # nothing more routed to the dead worker (None: lease expired)
    finally:
        results = load.stop()
    late = [r for r in results if r.start > t_down]
    assert late and all(r.ok for r in late), [r for r in late if not r.ok][:3]
    failed = [r for r in results if not r.ok]  # (those the victim had): over by the time it was found dead
    assert all(r.t < t_down + 2.0 for r in failed), [(r.t - t_down, r.status) for r in failed]
    assert len(failed) <= 3, failed  # at most the three clients' requests in flight there at the kill


def test_etcd_outage_keeps_serving_and_recovers(dyn, reference):
    _wait(lambda: len(dyn.cluster()["workers"]) == 2, 10, "the proxy to see both workers")
    load = Load(dyn.proxy_url, reference, threads=2)
    try:
        load.wait_done(4)
        dyn.etcd.stop()
        t_down = time.monotonic()
        # serving through an outage longer than the workers' leases (they cannot renew them meanwhile)
        load.wait_done(4, started_after=t_down, what="requests during the etcd outage")
        _wait(lambda: time.monotonic() - t_down > 2 * LEASE_TTL, 3 * LEASE_TTL, "the outage to outlast the leases")
        during = [r for r in load.results if r.start > t_down]
        assert during and all(r.ok for r in during)
        dyn.etcd.start()
        late = dyn.worker("decode", "d-after-restart")
        _wait(lambda: late.url in dyn.by_url(), 120, "the proxy to discover a worker started after the restart")
        _wait(lambda: dyn.by_url()[late.url]["requests"] > 0, 10, "requests on the new worker")
        _wait(lambda: len(dyn.by_url()) == 3, 10, "the old workers re-registered")
    finally:
        results = load.stop()
    failed = [r for r in results if not r[3]]
    assert not failed, failed[:3]
