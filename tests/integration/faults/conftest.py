"""Real worker processes for the fault, token and fuzz tests (tiny random Llama, short limits).

One set for this directory (test_worker_faults.py and test_signal_fuzz.py):

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
from tests.integration.faults.fault_helpers import KV_TTL, PREFILL_WAIT, TOKEN, info


@pytest.fixture(scope="session")
def fault_workers(tmp_path_factory, tiny_model_dir: Path):
    c = Cluster(tmp_path_factory.mktemp("fault-workers"))
    common = ["--model", str(tiny_model_dir), "--dtype", "float32", "--threads", "1", "--max-model-len", "256",
              "--batch-size", "4"]
    urls: dict[str, str] = {}
    for name, extra in (("prefill", ["--cluster-token", TOKEN, "--kv-ttl", str(KV_TTL)]),
                        ("prefill_victim", ["--cluster-token", TOKEN])):
        port, sig = free_port(), free_port()
        urls[name] = f"http://127.0.0.1:{port}"
        urls[name + "_signal"] = f"127.0.0.1:{sig}"
        c.start(name, ["prefill", *common, *extra, "--port", str(port), "--signal-port", str(sig)], urls[name])
    for name, token in (("decode", TOKEN), ("decode_wrong", "not-the-cluster-token"), ("decode_none", None)):
        port = free_port()
        urls[name] = f"http://127.0.0.1:{port}"
        extra = ["--prefill-wait-timeout", str(PREFILL_WAIT)] + (["--cluster-token", token] if token else [])
        c.start(name, ["decode", *common, *extra, "--port", str(port), "--kv-port", str(free_port())], urls[name])
    try:
        c.wait_healthy()
        for name in ("decode", "decode_wrong", "decode_none"):
            urls[name + "_id"] = info(urls[name])["signal_addr"]
    except BaseException:
        c.stop()
        raise
    yield c, urls
    c.stop()
