"""Preemption with real workers and the tiny real model (float32): a decode worker and a colocated worker whose
KV cache holds 256 tokens (16 blocks) run 8 concurrent requests that grow to ~100-140 tokens each, so running
requests keep running out of blocks and the newest are preempted and computed again. Every answer is the
one a colocated worker with a large cache gives (greedy, and seeded sampling with penalties; JSON and
streamed; P/D's decode worker recomputes in its local prefill's chunks, the colocated worker in one pass), both workers count their preemptions (stats, xpyd's and vLLM's metrics, the P/D proxy's ``/cluster``), and once the answers are
in no block is held: only the cached ones of ended requests stay."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port, post_json, start_pd_and_colocated, wait_until

SMALL = ["--kv-cache-tokens", "256"]  # = --max-model-len: one request alone always fits
PROMPTS = [" ".join(f"{w}{i}" for i in range(n)) for w, n in
           (("apple", 4), ("bird", 9), ("cloud", 6), ("door", 12), ("eagle", 3), ("fish", 8), ("grape", 5),
            ("house", 10))]


def _get(url: str, path: str) -> str:
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return r.read().decode()


def _stats(url: str) -> dict:
    return json.loads(_get(url, "/xpyd/stats"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir: Path):
    options = ["--model", str(tiny_model_dir), "--dtype", "float32", "--threads", "1", "--max-model-len", "256",
               "--batch-size", "8", "--served-model-name", "m"]
    c = Cluster(tmp_path_factory.mktemp("preemption"))
    try:
        urls = start_pd_and_colocated(c, options, decode=SMALL, colocated=SMALL)
        wp, xp = free_port(), free_port()
        urls["large"], urls["ref"] = f"http://127.0.0.1:{wp}", f"http://127.0.0.1:{xp}"
        c.start("large", ["colocated", *options, "--port", str(wp)], urls["large"])  # 8 x 256 tokens
        # (its proxy serves, and answers /health, once the worker answered its /xpyd/info)
        c.start("ref-proxy", ["proxy", "--port", str(xp), "--colocated", urls["large"]], urls["ref"])
        c.wait_healthy()
    except BaseException:
        c.stop()
        raise
    yield urls
    c.stop()


def _body(i: int, sampled: bool) -> dict:
    body = {"prompt": PROMPTS[i], "max_tokens": 80 + 8 * i, "ignore_eos": True, "stream": i % 2 == 1,
            "temperature": 0}
    if sampled:
        # (top_k: the random model's next-token distribution is nearly flat over 49k tokens, where the float32
        # differences between one batch and another flip a sampled token with or without preemption; among 3
        # tokens a draw used twice or skipped still changes the answer, float noise does not)
        body |= {"temperature": 0.9, "top_k": 3, "seed": 100 + i, "frequency_penalty": 0.5,
                 "repetition_penalty": 1.1}
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    return body


def _answer(url: str, body: dict) -> tuple[str, int]:
    got = post_json(url, "/v1/completions", body)
    if not body["stream"]:
        return got["choices"][0]["text"], got["usage"]["completion_tokens"]
    assert all("error" not in e for e in got), got
    usage = [e["usage"] for e in got if e.get("usage")]
    return "".join(c["text"] for e in got for c in e["choices"]), usage[-1]["completion_tokens"]


def _all(url: str, sampled: bool) -> list[tuple[str, int]]:
    with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:
        return list(ex.map(lambda i: _answer(url, _body(i, sampled)), range(len(PROMPTS))))


def _metric(url: str, name: str) -> float:
    found = re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", _get(url, "/metrics"), re.M)
    assert found, name
    return float(found[0])


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_preempted_requests_answer_what_a_large_cache_answers(cluster, sampled):
    before = {w: _stats(cluster[w])["preemptions"] for w in ("decode", "colocated")}
    want = _all(cluster["ref"], sampled)
    assert [n for _, n in want] == [80 + 8 * i for i in range(len(PROMPTS))]
    assert _all(cluster["pd"], sampled) == want
    assert _all(cluster["co"], sampled) == want
    for worker in ("decode", "colocated"):
        s = _stats(cluster[worker])
        assert s["preemptions"] > before[worker] and s["recomputed_tokens"] > 0, (worker, s)
    assert _stats(cluster["large"])["preemptions"] == 0


def test_preemptions_are_counted_and_no_block_is_left_held(cluster):
    for worker, role in (("decode", "decode"), ("colocated", "colocated")):
        url = cluster[worker]

        def idle() -> bool:
            s = _stats(url)
            return (s["waiting"] == s["running"] == s["preempted"] == 0 and s["blocks_used"] == 0
                    and s["kv_used_bytes"] == 0 and s.get("requests_held", 0) == 0)

        wait_until(idle, 30, f"the {worker} worker holding no block")
        s = _stats(url)
        assert s["preemptions"] > 0 and s["blocks_free"] == s["blocks_total"]  # (cached ones are free to take)
        assert _metric(url, "xpyd_preemptions_total") == s["preemptions"]
        assert _metric(url, "vllm:num_preemptions_total") == s["preemptions"]
        assert f'role="{role}"' in re.findall(r"^xpyd_preemptions_total\{[^}]*\}", _get(url, "/metrics"), re.M)[0]
    # The P/D proxy's /cluster shows the decode worker's count (as of its last poll of the worker's stats).
    want = _stats(cluster["decode"])["preemptions"]

    def shown() -> int | None:
        (decode,) = [w for w in json.loads(_get(cluster["pd"], "/cluster"))["workers"] if w["role"] == "decode"]
        return decode["preemptions"] if decode["preemptions"] == want else None

    wait_until(shown, 15, f"/cluster to show the decode worker's {want} preemptions")
