"""The KV cache's size and its reuse as live workers and `xpyd bench` report them (real 1P1D, tiny random Llama).

``--kv-cache-memory`` sizes both workers' pools in whole blocks, and a prompt that shares a prefix with
an earlier one shows up in the prefix-cache metrics of both roles: prefill's hits, decode's KV not moved,
and the client's ``cached_tokens``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import start_1p1d
from tests.integration.faults.fault_helpers import wait_idle
from xpyd.model.kv_pool import KVLayout

MEMORY = 300 << 10  # --kv-cache-memory 300KiB
BLOCK = 16
PREFIX = [(17 * i) % 9000 + 100 for i in range(40)]  # 40 tokens: two full blocks and 8 more


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir: Path):
    c, urls = start_1p1d(tmp_path_factory.mktemp("cache-live"), str(tiny_model_dir), max_model_len=256,
                         extra=["--kv-cache-memory", "300KiB", "--block-size", str(BLOCK)])
    yield urls
    c.stop()


def _metrics(url: str) -> dict[tuple, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(values: dict, name: str, **labels: str) -> float:
    return values[(name, tuple(sorted(labels.items())))]


def _complete(proxy: str, prompt: list[int]) -> dict:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(proxy + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_kv_cache_memory_sizes_the_pool_of_both_workers(cluster, tiny_model_dir: Path):
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    layout = KVLayout(cfg["num_hidden_layers"], cfg["num_key_value_heads"],
                      cfg["hidden_size"] // cfg["num_attention_heads"], "float32", 1, BLOCK)
    token_bytes = layout.block_bytes // BLOCK
    blocks = MEMORY // token_bytes // BLOCK
    for role in ("prefill", "decode"):
        values = _metrics(cluster[role])
        assert _value(values, "xpyd_kv_pool_capacity_bytes", role=role) == blocks * layout.block_bytes
        assert sum(_value(values, "xpyd_kv_blocks", role=role, state=s) for s in ("used", "cached", "free")) == blocks


def test_a_shared_prefix_shows_in_both_roles_prefix_cache_metrics(cluster):
    wait_idle(cluster["prefill"])
    before = {role: _metrics(cluster[role]) for role in ("prefill", "decode")}
    first = _complete(cluster["proxy"], [*PREFIX, 7])
    second = _complete(cluster["proxy"], [*PREFIX, 8])
    wait_idle(cluster["prefill"])
    wait_idle(cluster["decode"])
    after = {role: _metrics(cluster[role]) for role in ("prefill", "decode")}

    def delta(role: str, name: str) -> float:
        return _value(after[role], name, role=role) - _value(before[role], name, role=role)

    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK  # whole blocks of the prefix
    assert delta("prefill", "xpyd_prefix_cache_queries_total") == 2 * (len(PREFIX) + 1)
    assert delta("prefill", "xpyd_prefix_cache_hits_total") == 2 * BLOCK
    # decode holds the first prompt's two full blocks and pulls only the rest of the second
    capacity = _value(after["decode"], "xpyd_kv_pool_capacity_bytes", role="decode")
    blocks = sum(_value(after["decode"], "xpyd_kv_blocks", role="decode", state=s) for s in ("used", "cached", "free"))
    # the states add up to the pool; the two prefix blocks stay cached (held by no request) on both workers
    for role in ("prefill", "decode"):
        assert _value(after[role], "xpyd_kv_blocks", role=role, state="cached") == 2
        assert _value(after[role], "xpyd_kv_blocks", role=role, state="free") == blocks - 2
    assert delta("decode", "xpyd_kv_reuse_saved_bytes_total") == 2 * capacity / blocks  # two blocks' bytes


def test_xpyd_bench_against_xpyd_reports_every_request_and_the_prefix_cache(cluster, tiny_model_dir: Path,
                                                                           tmp_path: Path):
    """`xpyd bench` as a user runs it against this cluster: shared-prefix workload, streaming, usage read back."""
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "xpyd", "bench", "--url", cluster["proxy"], "--workload", "shared-prefix",
         "--num-prefixes", "2", "--prefix-len", "48", "--input-len", "8", "--output-len", "5",
         "--num-requests", "8", "--concurrency", "2", "--tokenizer", str(tiny_model_dir), "--seed", "1",
         "--json", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["completed"] == 8 and report["failed"] == 0, report["errors"]
    assert report["ttft_ms"]["count"] == 8 and report["e2e_ms"]["count"] == 8
    assert report["total_output_tokens"] == 8 * 5
    # 2 prefixes of 48 tokens (3 blocks) over 8 requests: every request after a prefix's first finds it cached
    cache = report["prefix_cache"]
    assert cache["requests"] == 8 and cache["cached_tokens"] >= (8 - 2) * 3 * BLOCK, cache
    assert 0 < cache["hit_rate"] < 1
