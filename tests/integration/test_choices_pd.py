"""Several choices (``n`` > 1, lists of prompts) through the P/D proxy and on a colocated worker, with simulated
workers: choice ``p * n + j`` is what a one-choice request for prompt p with ``seed + j`` gets (vLLM's parallel
sampling), the same on P/D and colocated, in JSON and streams (indices on every chunk, a role chunk per chat
choice, one usage chunk: each prompt's tokens once, every choice's completion tokens); a prompt's later choices
find its blocks in the prefill worker's prefix cache instead of computing them again."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, post_json, start_pd_and_colocated

PROMPTS = ["The quick brown fox jumps over the lazy dog and then", "Once upon a time in a land far away, there"]
SAMPLED = {"temperature": 0.9, "seed": 11, "max_tokens": 6, "ignore_eos": True}


_call = post_json


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _by_index(events: list[dict], chat: bool) -> tuple[dict[int, str], dict | None]:
    """A stream's text per choice index, and its usage."""
    texts: dict[int, str] = {}
    usage = None
    for e in events:
        assert "error" not in e, e
        if e.get("usage") is not None:
            assert e["choices"] == []
            usage = e["usage"]
        for c in e["choices"]:
            piece = (c["delta"].get("content") or "") if chat else c["text"]
            texts[c["index"]] = texts.get(c["index"], "") + piece
    return texts, usage


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smollm_dir: Path):
    options = ["--model", str(smollm_dir), "--engine", "sim", "--sim-speedup", "inf", "--threads", "1",
               "--batch-size", "8", "--max-model-len", "256", "--served-model-name", "m"]
    c = Cluster(tmp_path_factory.mktemp("choices"))
    try:
        urls = start_pd_and_colocated(c, options)
    except BaseException:
        c.stop()
        raise
    yield urls
    c.stop()


def _one(url: str, prompt: str, seed: int) -> dict:
    j = _call(url, "/v1/completions", {**SAMPLED, "prompt": prompt, "seed": seed})
    return {"text": j["choices"][0]["text"], "usage": j["usage"]}


@pytest.mark.parametrize("where", ["pd", "co"])
def test_choices_are_the_one_choice_answers_with_seed_plus_j(cluster, where):
    url = cluster[where]
    n = 3
    j = _call(url, "/v1/completions", {**SAMPLED, "prompt": PROMPTS, "n": n})
    assert [c["index"] for c in j["choices"]] == list(range(2 * n))
    singles = [_one(cluster["pd"], p, SAMPLED["seed"] + k) for p in PROMPTS for k in range(n)]
    assert [c["text"] for c in j["choices"]] == [s["text"] for s in singles]
    assert len({c["text"] for c in j["choices"][:n]}) > 1  # (sampled: the seeds differ)
    prompt_tokens = singles[0]["usage"]["prompt_tokens"] + singles[n]["usage"]["prompt_tokens"]
    assert j["usage"]["prompt_tokens"] == prompt_tokens  # each prompt once
    assert j["usage"]["completion_tokens"] == 2 * n * SAMPLED["max_tokens"]
    # the stream: the same texts by index, one usage chunk
    events = _call(url, "/v1/completions", {**SAMPLED, "prompt": PROMPTS, "n": n, "stream": True,
                                            "stream_options": {"include_usage": True}})
    texts, usage = _by_index(events, chat=False)
    assert texts == {c["index"]: c["text"] for c in j["choices"]}
    assert usage == j["usage"]
    assert [e for e in events if e.get("usage") is not None] == [events[-1]]


@pytest.mark.parametrize("where", ["pd", "co"])
def test_chat_choices_stream_each_with_its_role_chunk(cluster, where):
    url = cluster[where]
    body = {**SAMPLED, "messages": [{"role": "user", "content": "Say something."}], "n": 2}
    j = _call(url, "/v1/chat/completions", body)
    assert [c["index"] for c in j["choices"]] == [0, 1]
    events = _call(url, "/v1/chat/completions", {**body, "stream": True})
    roles = [c["index"] for e in events for c in e["choices"] if c["delta"].get("role") == "assistant"]
    assert sorted(roles) == [0, 1]
    texts, usage = _by_index(events, chat=True)
    assert texts == {c["index"]: c["message"]["content"] for c in j["choices"]}
    assert usage is None  # (not asked)


def test_pd_and_colocated_agree(cluster):
    body = {**SAMPLED, "prompt": PROMPTS[0], "n": 4, "logprobs": 2}
    pd = _call(cluster["pd"], "/v1/completions", body)
    co = _call(cluster["co"], "/v1/completions", body)
    assert pd["choices"] == co["choices"]
    greedy = _call(cluster["pd"], "/v1/completions", {**body, "temperature": 0})
    assert len({c["text"] for c in greedy["choices"]}) == 1


def test_later_choices_reuse_the_prompts_blocks_on_prefill(cluster):
    prompt = "A prompt no test sent before, long enough to fill a few KV blocks of sixteen tokens each: " * 2
    before = _get(cluster["prefill"] + "/xpyd/stats")
    n = 4
    j = _call(cluster["pd"], "/v1/completions", {**SAMPLED, "prompt": prompt, "n": n})
    after = _get(cluster["prefill"] + "/xpyd/stats")
    prompt_tokens = j["usage"]["prompt_tokens"]
    full_blocks = prompt_tokens // 16 * 16
    assert full_blocks >= 32
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] >= (n - 1) * (full_blocks - 16)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": ["x"] * 65, "n": 2}, "n"),
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": ["x", [1, 2]]}, "prompt"),
])
def test_bad_choice_counts_are_400(cluster, body, param):
    err = _call(cluster["pd"], "/v1/completions", body, status=400)
    assert err["error"]["param"] == param


def test_a_prefill_worker_takes_one_choice_a_request(cluster):
    from xpyd.signal.request_id import RequestId

    prefill, decode = _get(cluster["prefill"] + "/xpyd/info"), _get(cluster["decode"] + "/xpyd/info")
    rid = str(RequestId.new(prefill["signal_addr"], decode["signal_addr"]))
    err = _call(cluster["prefill"], "/v1/completions", {"prompt": "x", "n": 2}, status=400,
                headers={"X-Request-Id": rid})
    assert err["error"]["param"] == "n"
