"""A cluster token rotated without refused calls: workers in the middle of a rotation serve every request.

The second step of a three-step rotation, as a rolling update leaves it (docs/kubernetes.md, "Rotating the
cluster token"): the prefill worker still proves and signs with the old token and accepts the new one
(step 1 rolled it), the decode worker already switched to the new token and accepts the old one (step 2
rolled it), and one proxy of each kind is still up. Real processes: the handshake between the two workers
proves different tokens each way, every KV transfer is MACed with the prefill worker's token and checked
by decode against either, the prefill worker's block hashes are keyed with its token and decode checks them
under that key and caches under its own. Answers through either proxy equal a colocated worker's, token for
token; a repeated prompt reuses decode's cached blocks; a proxy with a token neither worker holds is
refused by both (it does not start).
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port, post_json, start_pd_and_colocated
from xpyd.signal.request_id import ClusterKeys

OLD, NEW, THIRD = "the-cluster-token-before", "the-cluster-token-after", "a-token-nobody-holds"
PROMPT = ("The lighthouse keeper wrote the same three lines in the log every evening, and on the night of the "
          "storm he added a fourth: ")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir: Path):
    options = ["--model", str(tiny_model_dir), "--dtype", "float32", "--threads", "1", "--max-model-len", "256",
               "--batch-size", "4", "--served-model-name", "m"]
    c = Cluster(tmp_path_factory.mktemp("rotation"))
    try:
        urls = start_pd_and_colocated(c, options, prefill=["--cluster-token", OLD, "--cluster-token-accept", NEW],
                                      decode=["--cluster-token", NEW, "--cluster-token-accept", OLD],
                                      pd_proxy=["--cluster-token", OLD])
        port = free_port()
        urls["new"] = f"http://127.0.0.1:{port}"
        c.start("new-proxy", ["proxy", "--port", str(port), "--prefill", urls["prefill"], "--decode",
                              urls["decode"], "--cluster-token", NEW], urls["new"])
        c.wait_healthy()
    except BaseException:
        c.stop()
        raise
    yield urls
    c.stop()


def _stats(url: str, token: str) -> dict:
    req = urllib.request.Request(url + "/xpyd/stats", headers={"Authorization": f"Bearer {ClusterKeys(token).http_bearer}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_workers_mid_rotation_serve_either_proxy_with_the_colocated_tokens(cluster):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    want = post_json(cluster["co"], "/v1/completions", body)["choices"][0]["text"]
    reused = _stats(cluster["decode"], NEW)["kv_reused_blocks"]
    for proxy in ("pd", "new", "pd"):  # (the old token's proxy, the new one's, then the old's again)
        assert post_json(cluster[proxy], "/v1/completions", body)["choices"][0]["text"] == want, proxy
        streamed = post_json(cluster[proxy], "/v1/completions", {**body, "stream": True})
        assert "".join(e["choices"][0]["text"] for e in streamed if e.get("choices")) == want, proxy
    # The repeats found the prompt's full blocks in decode's cache, cached under decode's own names from KV
    # whose names came from the prefill worker keyed with the other token.
    assert _stats(cluster["decode"], NEW)["kv_reused_blocks"] > reused
    assert _stats(cluster["decode"], OLD)["kv_reused_blocks"] > reused  # (either token's bearer reads the stats)


def test_a_proxy_with_a_token_neither_worker_holds_is_refused(cluster):
    proxy = subprocess.run([sys.executable, "-m", "xpyd", "proxy", "--port", str(free_port()), "--prefill",
                            cluster["prefill"], "--decode", cluster["decode"], "--cluster-token", THIRD],
                           capture_output=True, text=True, timeout=120)
    assert proxy.returncode == 1 and "refused the proxy (HTTP 401)" in proxy.stderr, proxy.stderr[-2000:]
    for role in ("prefill", "decode"):
        req = urllib.request.Request(cluster[role] + "/xpyd/stats",
                                     headers={"Authorization": f"Bearer {ClusterKeys(THIRD).http_bearer}"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 401, role
