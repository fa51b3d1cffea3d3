"""Cache-aware routing on a real 2P2D cluster through etcd (tiny random Llama, float32): requests that share
a prefix go to the workers that cache it, the proxy's index follows what the workers store and evict,
and a worker busy past a batch is avoided even though it holds the prefix."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port, wait_until
from xpyd.discovery.local_etcd import LocalEtcd
from xpyd.prefix_hash import block_hashes

CAPACITY = 4  # --batch-size of every worker
PREFIX = " ".join(f"word{i}" for i in range(60))  # ~120 tokens: several full blocks
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


class TwoByTwo:
    def __init__(self, workdir: Path, model: Path, etcd: LocalEtcd) -> None:
        self.c = Cluster(workdir)
        self.urls: dict[str, str] = {}
        for role, name in (("prefill", "p0"), ("prefill", "p1"), ("decode", "d0"), ("decode", "d1")):
            port = free_port()
            args = [role, "--model", str(model), "--dtype", "float32", "--threads", "1", "--max-model-len", "256",
                    "--batch-size", str(CAPACITY), "--kv-cache-tokens", "512", "--etcd", etcd.endpoint,
                    "--lease-ttl", "2", "--port", str(port)]
            args += ["--signal-port", str(free_port())] if role == "prefill" else ["--kv-port", str(free_port())]
            self.urls[name] = self.c.start(name, args, f"http://127.0.0.1:{port}").url
        # (with the workers: a proxy in dynamic mode starts with none, answers /health once a prefill and a
        # decode worker registered, and finds the others as they register)
        port = free_port()
        self.proxy = self.c.start("proxy", ["proxy", "--port", str(port), "--etcd", etcd.endpoint],
                                  f"http://127.0.0.1:{port}").url
        self.c.wait_healthy()
        wait_until(lambda: len(self.cluster()["workers"]) == 4, 15, "the proxy to see 4 workers")
        # (until the proxy has fetched the workers' tokenizer it routes by load alone)
        wait_until(lambda: self.cluster()["tokenizer"] is not None, 30, "the proxy to have the tokenizer")

    def cluster(self) -> dict:
        return json.loads(urllib.request.urlopen(self.proxy + "/cluster", timeout=5).read())

    def settled(self) -> None:
        """Wait until the proxy's view of every worker is exact: a stats report asked for after the last
        request was sent (nothing ``assigned`` since) shows the worker idle, holding no block. Routing on
        reports that lag a request behind is a cost estimate that may tip either way (that case is in
        tests/unit/test_routing.py); this is the state in which a prefix's holder must win."""
        def idle(w: dict) -> bool:
            load = w["load"]
            return (load["assigned"] == 0 and load["waiting"] == load["running"] == load["transferring"] == 0
                    and w["cache"]["blocks_used"] == 0)
        wait_until(lambda: all(idle(w) for w in self.cluster()["workers"]), 20, "every worker reported idle")

    def requests(self) -> dict[str, int]:
        by_url = {w["http_url"]: w["requests"] for w in self.cluster()["workers"]}
        return {name: by_url[url] for name, url in self.urls.items()}

    def complete(self, prompt: str, max_tokens: int = 4) -> dict:
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(self.proxy + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200
            return json.loads(r.read())


def get(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url, timeout=5).read())


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory, tiny_model_dir: Path):
    tmp_path = tmp_path_factory.mktemp("cache-routing")
    etcd = LocalEtcd(data_dir=tmp_path / "etcd")
    etcd.start()
    cluster = None
    try:
        cluster = TwoByTwo(tmp_path, tiny_model_dir, etcd)
        yield cluster
    finally:
        if cluster is not None:
            cluster.c.stop()
        etcd.stop()


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def test_prefix_sharing_requests_follow_the_cache_and_the_index_follows_evictions(two_by_two, tiny_model_dir):
    c = two_by_two
    assert c.cluster()["policy"] == "cache_aware"
    before = c.requests()
    first = c.complete(PREFIX + " first")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    holders = {name for name, n in delta(c.requests(), before).items() if n == 1}  # the pair that served it
    assert len(holders) == 2

    # The same prefix again, one at a time (each once the proxy knows the one before ended): always the
    # holders, always a hit.
    before = c.requests()
    for word in WORDS[:4]:
        c.settled()
        answer = c.complete(PREFIX + " " + word)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96, answer["usage"]
    moved = delta(c.requests(), before)
    assert {name for name, n in moved.items() if n} == holders and set(moved.values()) <= {0, 4}, moved

    # Distinct prompts until no worker caches the prefix any more: the proxy's index drops it as well.
    desc = get(c.urls["p0"] + "/xpyd/tokenizer")
    from tokenizers import Tokenizer

    ids = Tokenizer.from_str(desc["tokenizer"]).encode(PREFIX).ids
    prefix_hashes = set(block_hashes(ids, desc["block_size"], desc["hash_seed"]))

    def nobody_caches_the_prefix() -> bool:
        return all(not prefix_hashes & set(get(url + "/xpyd/kv_events")["snapshot"]) for url in c.urls.values())

    i = 0
    while not nobody_caches_the_prefix():
        assert i < 60, "the small caches should have evicted the prefix"
        c.complete(f"flood {i} " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(40)))
        i += 1

    def index_matches_the_workers() -> bool:
        by_url = {w["http_url"]: w["cache"] for w in c.cluster()["workers"]}
        return all(by_url[url]["indexed_blocks"] == get(url + "/xpyd/stats")["blocks_cached"]
                   for url in c.urls.values())

    wait_until(index_matches_the_workers, 20, "the proxy's index to equal what the workers cache")
    again = c.complete(PREFIX + " again")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # routed as the cold request it is


def test_a_busy_holder_shares_the_load(two_by_two):
    c = two_by_two
    before = c.requests()
    c.complete(PREFIX + " warm")
    holder = next(name for name, n in delta(c.requests(), before).items() if n == 1 and name.startswith("d"))
    other = "d1" if holder == "d0" else "d0"
    reused = get(c.urls[holder] + "/xpyd/stats")["kv_reused_blocks"]
    before = c.requests()
    # Long generations that all share the prefix, at once: the holder's cache draws them until the blocks
    # they hold there cost more than pulling the prefix to the other decode worker, and no worker is ever a
    # batch busier than the other.
    with ThreadPoolExecutor(12) as ex:
        answers = list(ex.map(lambda w: c.complete(PREFIX + " " + w, max_tokens=60), WORDS[:12]))
    assert all(a["usage"]["completion_tokens"] == 60 for a in answers)
    moved = delta(c.requests(), before)
    assert moved[other] >= 1 and moved[holder] >= 1, moved  # load won over the cache ...
    assert abs(moved[holder] - moved[other]) <= CAPACITY, moved  # ... no hot spot
    assert get(c.urls[holder] + "/xpyd/stats")["kv_reused_blocks"] > reused  # ... and the cache still served
    for url in c.urls.values():
        s = get(url + "/xpyd/stats")
        assert s["blocks_used"] == 0
