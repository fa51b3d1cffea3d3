"""Real worker processes for the fault, token and fuzz tests (tiny random Llama, short limits).

One set for test_worker_faults.py (the fault, token and fuzz tests), started once and handed to each
test alive and idle: a test that leaves a request, KV or a dead worker behind fails itself (each ends with
its own idle checks), and the next test gets a fresh set instead of inheriting the leak.

- ``prefill``: requires the cluster token, kv_ttl 2 s;
- ``decode``: presents the token, prefill-wait timeout 3 s;
- ``decode_wrong`` / ``decode_none``: a wrong token / none;
- ``prefill_victim``: requires the token too (a decode worker's token keys its transfers, so a prefill
  worker without it refuses it); the SIGKILL test kills it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port
from tests.integration.faults.fault_helpers import KEYS, KV_TTL, PREFILL_WAIT, TOKEN, info, wait_idle
from xpyd.signal.request_id import ClusterKeys


def _start(workdir: Path, model: Path) -> tuple[Cluster, dict[str, str]]:
    c = Cluster(workdir)
    common = ["--model", str(model), "--dtype", "float32", "--threads", "1", "--max-model-len", "256",
              "--batch-size", "4"]
    urls: dict[str, str] = {}
    for name, extra in (("prefill", ["--cluster-token", TOKEN, "--kv-ttl", str(KV_TTL)]),
                        ("prefill_victim", ["--cluster-token", TOKEN])):
        port, sig = free_port(), free_port()
        urls[name] = f"http://127.0.0.1:{port}"
        urls[name + "_signal"] = f"127.0.0.1:{sig}"
        c.start(name, ["prefill", *common, *extra, "--port", str(port), "--signal-port", str(sig)], urls[name])
        KEYS[urls[name]] = ClusterKeys(TOKEN)
    for name, token in (("decode", TOKEN), ("decode_wrong", "not-the-cluster-token"), ("decode_none", None)):
        port = free_port()
        urls[name] = f"http://127.0.0.1:{port}"
        extra = ["--prefill-wait-timeout", str(PREFILL_WAIT)] + (["--cluster-token", token] if token else [])
        c.start(name, ["decode", *common, *extra, "--port", str(port), "--kv-port", str(free_port())], urls[name])
        if token:
            KEYS[urls[name]] = ClusterKeys(token)
    try:
        c.wait_healthy()
        for name in ("decode", "decode_wrong", "decode_none"):
            urls[name + "_id"] = info(urls[name])["signal_addr"]
    except BaseException:
        c.stop()
        raise
    return c, urls


def _clean(c: Cluster, urls: dict[str, str]) -> bool:
    """Every worker alive and holding nothing (a failed test may have left a request, KV or a dead worker)."""
    for p in c.procs:
        if p.popen.poll() is not None:
            return False
        try:
            wait_idle(p.url, timeout=5)
        except (AssertionError, OSError):
            return False
    return True


@pytest.fixture(scope="session")
def _fault_cluster(tmp_path_factory, tiny_model_dir: Path):
    holder: dict[str, tuple[Cluster, dict[str, str]]] = {}

    def get() -> tuple[Cluster, dict[str, str]]:
        if "c" in holder and not _clean(*holder["c"]):
            holder.pop("c")[0].stop()  # one test's leak or crash must not fail every later test
        if "c" not in holder:
            holder["c"] = _start(tmp_path_factory.mktemp("fault-workers"), tiny_model_dir)
        return holder["c"]

    yield get
    if "c" in holder:
        holder["c"][0].stop()


@pytest.fixture
def fault_workers(_fault_cluster):
    """The workers, alive and idle: restarted first if an earlier test left them otherwise."""
    return _fault_cluster()
