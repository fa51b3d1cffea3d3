"""GET /metrics on a real 1P1D cluster (tiny random Llama): the counters match the requests that were served."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import start_1p1d
from xpyd.model.kv_pool import KVLayout
from xpyd.worker.config import WorkerConfig

BATCH, MAX_LEN, MAX_TOKENS = 4, 256, 6
BLOCK = WorkerConfig(role="prefill").block_size  # the workers' default
PROMPTS = ["The capital of France is", "One, two, three,", "Tell me a story about a cat who",
           "In the beginning"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir: Path):
    c, urls = start_1p1d(tmp_path_factory.mktemp("metrics"), str(tiny_model_dir), batch_size=BATCH,
                         max_model_len=MAX_LEN)
    yield urls
    c.stop()


@pytest.fixture(scope="module")
def layout(tiny_model_dir: Path) -> KVLayout:
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    return KVLayout(cfg["num_hidden_layers"], cfg["num_key_value_heads"],
                    cfg["hidden_size"] // cfg["num_attention_heads"], "float32", BATCH * MAX_LEN // BLOCK, BLOCK)


def scrape(url: str) -> dict[tuple, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(values: "dict | Delta", name: str, **labels: str) -> float:
    return values[(name, tuple(sorted(labels.items())))]


class Delta:
    """Counters since ``before`` (the cluster is shared by the module's tests: no absolute counts);
    ``now`` for gauges."""

    def __init__(self, now: dict, before: dict) -> None:
        self.now, self._before = now, before

    def __getitem__(self, key: tuple) -> float:
        return self.now[key] - self._before[key]


def completion(proxy: str, prompt: str, stream: bool, max_tokens: int = MAX_TOKENS) -> int:
    """One request through the proxy; returns its prompt tokens (from usage)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(proxy + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        if not stream:
            return json.loads(r.read())["usage"]["prompt_tokens"]
        chunks = [json.loads(line[5:]) for line in r.read().decode().splitlines()
                  if line.startswith("data: {")]
    return [c["usage"] for c in chunks if c.get("usage")][-1]["prompt_tokens"]


def wait_idle(urls: dict[str, str], timeout: float = 10.0) -> dict[str, dict]:
    """Scrape every process until both workers hold nothing (sends are polled a moment after the reply)."""
    deadline = time.monotonic() + timeout
    while True:
        got = {name: scrape(url) for name, url in urls.items()}
        busy = [(name, k) for name in ("prefill", "decode") for k, v in got[name].items()
                if k[0] in ("xpyd_requests_in_flight", "xpyd_kv_pool_used_bytes") and v != 0]
        if not busy or time.monotonic() > deadline:
            assert not busy, f"not idle: {busy}"
            return got
        time.sleep(0.05)


def test_metrics_count_the_requests_served(cluster, layout):
    before = wait_idle(cluster)  # every series is there whatever ran before (counted from here: deltas)
    assert value(before["proxy"], "xpyd_requests_in_flight", role="proxy") == 0

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        prompt_tokens = list(pool.map(completion, [cluster["proxy"]] * len(PROMPTS), PROMPTS,
                                      [i % 2 == 0 for i in range(len(PROMPTS))]))
    n = len(PROMPTS)
    kv_bytes = sum(layout.blocks_for(t) for t in prompt_tokens) * layout.block_bytes  # whole blocks move

    got = wait_idle(cluster)
    p, d, x = (Delta(got[k], before[k]) for k in ("prefill", "decode", "proxy"))
    P, D = {"role": "prefill"}, {"role": "decode"}

    # Outcomes: every request finished on both workers and was ok at the proxy.
    assert value(p, "xpyd_requests_total", **P, outcome="finished") == n
    assert value(d, "xpyd_requests_total", **D, outcome="finished") == n
    for outcome in ("failed", "aborted", "rejected"):
        assert value(p, "xpyd_requests_total", **P, outcome=outcome) == 0
        assert value(d, "xpyd_requests_total", **D, outcome=outcome) == 0
    assert value(x, "xpyd_proxy_requests_total", endpoint="/v1/completions", outcome="ok") == n

    # KV: nothing held when idle; capacity is the whole pool; every prompt's KV moved once, each way.
    for m, r in ((p, P), (d, D)):
        assert value(m.now, "xpyd_kv_pool_used_bytes", **r) == 0
        assert value(m.now, "xpyd_kv_pool_capacity_bytes", **r) == layout.total_bytes
        for state in ("waiting", "running", "transferring"):
            assert value(m.now, "xpyd_requests_in_flight", **r, state=state) == 0
    assert value(p, "xpyd_kv_transfer_bytes_total", **P, direction="send") == kv_bytes
    assert value(d, "xpyd_kv_transfer_bytes_total", **D, direction="recv") == kv_bytes
    assert value(p, "xpyd_kv_transfers_total", **P, direction="send", outcome="ok") == n
    assert value(d, "xpyd_kv_transfers_total", **D, direction="recv", outcome="ok") == n
    assert value(p, "xpyd_kv_transfer_seconds_count", **P, direction="send") == n
    assert value(d, "xpyd_kv_transfer_seconds_count", **D, direction="recv") == n
    # The prefix cache: every prompt looked up on prefill; these share no full block, so nothing hit or saved.
    assert value(p, "xpyd_prefix_cache_queries_total", **P) == sum(prompt_tokens)
    assert value(p, "xpyd_prefix_cache_hits_total", **P) == 0
    assert value(d, "xpyd_kv_reuse_saved_bytes_total", **D) == 0
    for m, r in ((p, P), (d, D)):
        assert value(m.now, "xpyd_kv_blocks", **r, state="used") == 0
        assert value(m.now, "xpyd_kv_blocks", **r, state="free") == layout.num_blocks

    # Latencies: one TTFT per request (prefill, proxy), one ITL per later token, E2E per request.
    assert value(p, "xpyd_time_to_first_token_seconds_count", **P) == n
    assert value(x, "xpyd_proxy_time_to_first_token_seconds_count") == n
    # (short prompts that arrive together share a prefill forward pass: n prompts, 1..n steps)
    assert 1 <= value(p, "xpyd_engine_step_seconds_count", **P, kind="prefill") <= n
    assert value(p, "xpyd_engine_batch_size_sum", **P, kind="prefill") == n
    assert value(d, "xpyd_engine_batch_size_sum", **D, kind="decode") == n * (MAX_TOKENS - 1)
    assert value(d, "xpyd_inter_token_latency_seconds_count", **D) == n * (MAX_TOKENS - 2)
    assert value(x, "xpyd_proxy_inter_token_latency_seconds_count") == n * (MAX_TOKENS - 1)
    assert value(d, "xpyd_e2e_request_latency_seconds_count", **D) == n
    assert value(x, "xpyd_proxy_e2e_request_latency_seconds_count") == n
    assert value(x.now, "xpyd_requests_in_flight", role="proxy") == 0
    assert value(x.now, "xpyd_proxy_workers", role="prefill", health="up") == 1
    assert value(x.now, "xpyd_proxy_workers", role="decode", health="up") == 1


def test_refused_requests_are_counted(cluster):
    bad = json.dumps({"prompt": "x", "max_tokens": 0}).encode()
    before = {name: scrape(cluster[name]) for name in ("prefill", "proxy")}
    for name in ("proxy", "prefill"):
        req = urllib.request.Request(cluster[name] + "/v1/completions", bad, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 400
    prefill = Delta(scrape(cluster["prefill"]), before["prefill"])
    proxy = Delta(scrape(cluster["proxy"]), before["proxy"])
    assert value(prefill, "xpyd_requests_total", role="prefill", outcome="rejected") == 1
    assert value(proxy, "xpyd_proxy_requests_total", endpoint="/v1/completions", outcome="client_error") == 1


def test_request_ending_on_its_first_token_is_finished_on_prefill(cluster):
    before = wait_idle(cluster)
    completion(cluster["proxy"], "Hello", stream=False, max_tokens=1)
    after = wait_idle(cluster)

    def delta(name: str, metric: str, **labels: str) -> float:
        return value(after[name], metric, **labels) - value(before[name], metric, **labels)

    # It needs no decode step: the proxy sends it to prefill alone, which frees its KV with the first token (a
    # finished request, not an abort); no KV moves and the decode worker never hears of it.
    assert delta("prefill", "xpyd_requests_total", role="prefill", outcome="finished") == 1
    assert delta("prefill", "xpyd_requests_total", role="prefill", outcome="aborted") == 0
    assert delta("prefill", "xpyd_kv_transfers_total", role="prefill", direction="send", outcome="ok") == 0
    assert sum(delta("decode", "xpyd_requests_total", role="decode", outcome=o)
               for o in ("finished", "aborted", "failed", "rejected")) == 0
    assert delta("proxy", "xpyd_proxy_requests_total", endpoint="/v1/completions", outcome="ok") == 1
