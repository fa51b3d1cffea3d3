"""Conditional disaggregation with simulated workers: through a 1P1D proxy with ``--local-prefill-max-tokens``, a
short prompt is prefilled by its decode worker (no prefill call; counted by the proxy, /cluster and the decode
worker) and a long one by the prefill worker; both answer exactly what the colocated worker answers, greedy and
seeded, streamed and JSON, completions and chat (the first token sampled with the request's first random draw
either way). The decode worker computes a short prompt in chunks of ``--local-prefill-chunk`` tokens."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, post_json, start_pd_and_colocated, wait_until

MAX_LOCAL = 64  # uncached prompt tokens the decode worker prefills itself
SHORT = "The quick brown fox jumps over the lazy dog and then"  # ~12 tokens (~50 in the chat template): local

def _long(tag: str) -> str:
    """~180 tokens, new to the cluster (once answered, its decode worker caches it): remote."""
    return " ".join(f"{tag}{i}" for i in range(60))


GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
SEEDED = {"temperature": 0.9, "seed": 7, "max_tokens": 6, "ignore_eos": True}


def _get(url: str, path: str) -> str:
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smollm_dir: Path):
    options = ["--model", str(smollm_dir), "--engine", "sim", "--sim-speedup", "inf", "--threads", "1",
               "--batch-size", "8", "--max-model-len", "512", "--served-model-name", "m"]
    c = Cluster(tmp_path_factory.mktemp("local-prefill"))
    try:
        urls = start_pd_and_colocated(c, options, decode=["--local-prefill-chunk", "5"],
                                      pd_proxy=["--local-prefill-max-tokens", str(MAX_LOCAL)])
        # the proxy counts a prompt's tokens with the workers' tokenizer, fetched once it is up
        wait_until(lambda: json.loads(_get(urls["pd"], "/cluster"))["tokenizer"] is not None, 60,
                   "the proxy's tokenizer")
    except BaseException:
        c.stop()
        raise
    yield urls
    c.stop()


def _paths(cluster) -> dict[str, int]:
    """The proxy's count of P/D requests by prefill path, as its metrics say (and /cluster agrees)."""
    text = _get(cluster["pd"], "/metrics")
    counts = {m[0]: int(float(m[1])) for m in re.findall(r'xpyd_proxy_prefill_path_total\{path="(\w+)"\} (\S+)', text)}
    decode = next(w for w in json.loads(_get(cluster["pd"], "/cluster"))["workers"] if w["role"] == "decode")
    assert decode["prefill_paths"] == counts
    return counts


def _answer(url: str, chat: bool, prompt: str, params: dict, stream: bool) -> tuple[str, dict]:
    body = {**params, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    got = post_json(url, "/v1/chat/completions" if chat else "/v1/completions", body)
    if not stream:
        choice = got["choices"][0]
        return (choice["message"]["content"] if chat else choice["text"]), got["usage"]
    text, usage, roles = "", None, 0
    for event in got:
        assert "error" not in event, event
        if event.get("usage"):
            usage = event["usage"]
        for c in event["choices"]:
            if chat:
                roles += c["delta"].get("role") == "assistant"
                text += c["delta"].get("content") or ""
            else:
                text += c["text"]
    assert roles == (1 if chat else 0)  # one role chunk, the proxy's
    return text, usage


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_short_prompts_go_local_long_ones_remote_with_the_colocated_tokens(cluster, chat, params, stream):
    tag = f"{'chat' if chat else 'text'}{'S' if params is SEEDED else 'G'}{'s' if stream else 'j'}w"
    for prompt, path in ((SHORT, "local"), (_long(tag), "remote")):
        before = _paths(cluster)
        text, usage = _answer(cluster["pd"], chat, prompt, params, stream)
        after = _paths(cluster)
        assert after[path] == before.get(path, 0) + 1, (prompt[:20], before, after)
        assert sum(after.values()) == sum(before.values()) + 1
        want, want_usage = _answer(cluster["co"], chat, prompt, params, stream)
        assert text == want and text
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == \
            (want_usage["prompt_tokens"], want_usage["completion_tokens"])


def test_the_decode_worker_counts_its_prefills(cluster):
    def stats() -> dict:
        return json.loads(_get(cluster["decode"], "/xpyd/stats"))

    before = stats()
    _answer(cluster["pd"], False, SHORT + " again", GREEDY, stream=True)
    after = stats()
    assert after["local_prefills"] == before["local_prefills"] + 1
    assert after["local_prefill_tokens"] > before["local_prefill_tokens"]
    assert after["pulls"] == before["pulls"]  # nothing pulled for it
    assert re.search(r'xpyd_local_prefills_total\{role="decode"\} [1-9]', _get(cluster["decode"], "/metrics"))
    wait_until(lambda: stats()["requests_held"] == 0 and stats()["kv_used_bytes"] == 0, 10,
               "the decode worker holding nothing")


def test_a_mostly_cached_prompt_goes_local(cluster):
    """A long prompt the decode worker holds after its first (remote) answer is prefilled there the next time:
    what it lacks is the prompt's tail."""
    prompt = _long("again")
    before = _paths(cluster)
    first, _ = _answer(cluster["pd"], False, prompt, GREEDY, stream=False)
    assert _paths(cluster)["remote"] == before["remote"] + 1
    # the decode worker's KV events reach the proxy's prefix index within a poll or two
    second = None

    def went_local() -> bool:
        nonlocal second
        was = _paths(cluster)["local"]
        second, _ = _answer(cluster["pd"], False, prompt, GREEDY, stream=False)
        return _paths(cluster)["local"] == was + 1

    wait_until(went_local, 10, "a cached prompt prefilled on its decode worker")
    assert second == first
