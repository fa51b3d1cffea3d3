"""``xpyd proxy --workers 2`` in front of real sim workers: both processes serve requests on the one port,
name the workers alike without a cluster token (the parent's key), and SIGTERM to the parent leaves no
process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port
from tests.waiting import wait_until

PROFILE = {
    "format": "xpyd-sim-profile/1", "model": "test", "machine": "test", "dtype": "float32", "threads": 1,
    "created": "2026-01-01T00:00:00Z",
    "prefill": {"new_tokens": [1, 1024], "cached_tokens": [0, 1024], "seconds": [[0.001, 0.001], [0.01, 0.01]]},
    "decode": {"batch": [1, 8], "context_tokens": [1, 4096], "seconds": [[0.001, 0.002], [0.002, 0.003]]},
}
DISPATCH = re.compile(r"^\S+ \S+ +(proxy\.\d) INFO cmpl-\S+ -> ", re.M)  # a --log-requests line, by process


def _complete(url: str, i: int) -> tuple[dict, str]:
    req = urllib.request.Request(url + "/v1/completions",
                                 data=json.dumps({"prompt": f"request {i}", "max_tokens": 3}).encode(),
                                 headers={"Content-Type": "application/json", "Connection": "close"})
    with urllib.request.urlopen(req, timeout=60) as r:  # (a new connection each: the kernel picks a process)
        return json.loads(r.read()), r.headers["x-xpyd-workers"]


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(p) for p in (task / "children").read_text().split()]
    return out


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"  # (a zombie is gone too)
    except FileNotFoundError:
        return True


@pytest.fixture
def cluster(tmp_path, smollm_dir: Path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    options = ["--model", str(smollm_dir), "--engine", "sim", "--sim-profile", str(profile), "--sim-speedup", "inf",
               "--threads", "1", "--batch-size", "4", "--max-model-len", "512", "--block-size", "16",
               "--kv-backend", "tcp"]
    c = Cluster(tmp_path)
    pp, ps, dp, dk, xp = (free_port() for _ in range(5))
    urls = {"prefill": f"http://127.0.0.1:{pp}", "decode": f"http://127.0.0.1:{dp}", "proxy": f"http://127.0.0.1:{xp}"}
    try:
        c.start("prefill", ["prefill", *options, "--port", str(pp), "--signal-port", str(ps)], urls["prefill"])
        c.start("decode", ["decode", *options, "--port", str(dp), "--kv-port", str(dk)], urls["decode"])
        # (the proxy serves, and answers /health, once both workers answered their /xpyd/info)
        c.start("proxy", ["proxy", "--workers", "2", "--port", str(xp), "--prefill", urls["prefill"],
                          "--decode", urls["decode"], "--policy", "cache_aware", "--log-requests",
                          "--expose-worker-names"], urls["proxy"])
        c.wait_healthy()
        yield c, urls
    finally:
        c.stop()


def test_two_proxy_processes_serve_one_port_and_stop_together(cluster):
    c, urls = cluster
    proxy = next(p for p in c.procs if p.name == "proxy")
    children = _children(proxy.popen.pid)
    assert len(children) == 2
    served, names = set(), set()
    for i in range(40):
        body, name = _complete(urls["proxy"], i)
        assert body["usage"]["completion_tokens"] == 3
        names.add(name)
        served = set(DISPATCH.findall(proxy.log.read_text()))
        if i >= 8 and served == {"proxy.1", "proxy.2"}:
            break
    assert served == {"proxy.1", "proxy.2"}  # (each of 9+ connections went to one of two: all to one ~ 1/256)
    assert len(names) == 1  # both processes name the one pair alike (the parent's key, no cluster token)
    assert os.environ.get("XPYD_PROXY_NAMES_KEY") is None
    assert "XPYD_PROXY_NAMES_KEY" not in " ".join(Path(f"/proc/{pid}/cmdline").read_text() for pid in children)

    proxy.popen.send_signal(signal.SIGTERM)
    assert proxy.popen.wait(60) == 0
    wait_until(lambda: all(_gone(pid) for pid in children), "both proxy processes gone", timeout=30)


def test_a_proxy_process_that_dies_stops_the_others(cluster):
    c, _ = cluster
    proxy = next(p for p in c.procs if p.name == "proxy")
    children = _children(proxy.popen.pid)
    os.kill(children[0], signal.SIGKILL)
    assert proxy.popen.wait(60) == 1
    wait_until(lambda: all(_gone(pid) for pid in children), "both proxy processes gone", timeout=30)
    assert "exited (code -9); stopping the others" in proxy.log.read_text()
