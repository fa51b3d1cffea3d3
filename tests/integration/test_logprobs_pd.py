"""Logprobs, echo and prompt logprobs through the proxy, P/D against colocated, with simulated workers and
the real tiny model (whose values are checked against a float64 transformers forward computed here, within the
float32 error bound of tests.numerics).

P/D splits a response's logprobs: prefill writes the first token's (and an echoed prompt's), decode the rest,
with text offsets that continue prefill's; the proxy joins them (JSON) or passes each on (stream). Requests that
need no decode step (max_tokens 0 with echo, or 1: an evaluation harness's loglikelihood requests) are answered
by the prefill worker alone: the decode worker never hears of them and no KV moves.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, post_json, start_pd_and_colocated

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
GEN = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


def _call(url: str, path: str, body: dict):
    events = post_json(url, path, body)
    if body.get("stream"):
        assert all("error" not in e for e in events), events
    return events


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def _joined(events: list[dict], chat: bool) -> dict:
    """A stream's choice as one: its text and its chunks' logprobs joined."""
    choices = [c for e in events for c in e["choices"]]
    text = "".join((c["delta"].get("content") or "") if chat else c["text"] for c in choices)
    parts = [c["logprobs"] for c in choices if c.get("logprobs") is not None]
    if chat:
        logprobs = {"content": [x for p in parts for x in p["content"]]}
    else:
        logprobs = {k: [x for p in parts for x in p[k]] for k in ("text_offset", "token_logprobs", "tokens",
                                                                   "top_logprobs")}
    return {"text": text, "logprobs": logprobs, "finish_reason": choices[-1]["finish_reason"]}


def _completion(url: str, body: dict) -> tuple[dict, dict]:
    """The JSON choice and the stream's (same text; same logprobs up to float32 error: the second request
    may start after a cached prefix, which sums in another order)."""
    c = _call(url, "/v1/completions", {**body, "prompt": PROMPT})["choices"][0]
    streamed = _joined(_call(url, "/v1/completions", {**body, "prompt": PROMPT, "stream": True}), chat=False)
    assert streamed["text"] == c["text"] and streamed["finish_reason"] == c["finish_reason"]
    return c, streamed


def _chat(url: str, body: dict) -> tuple[dict, dict]:
    c = _call(url, "/v1/chat/completions", {**body, "messages": MESSAGES})["choices"][0]
    streamed = _joined(_call(url, "/v1/chat/completions", {**body, "messages": MESSAGES, "stream": True}),
                       chat=True)
    assert streamed["text"] == c["message"]["content"]
    return c, streamed


def _ids(names: list[str]) -> list[int]:
    out = []
    for n in names:
        m = re.fullmatch(r"token_id:(\d+)", n)
        assert m, n
        out.append(int(m.group(1)))
    return out


@pytest.fixture(scope="module", params=["sim", "tiny"])
def cluster(request, tmp_path_factory, smollm_dir: Path):
    if request.param == "sim":
        model = smollm_dir
        options = ["--model", str(model), "--engine", "sim", "--sim-speedup", "inf"]
    else:
        model = request.getfixturevalue("tiny_model_dir")
        options = ["--model", str(model), "--dtype", "float32"]
    options += ["--threads", "1", "--batch-size", "4", "--max-model-len", "256", "--served-model-name", "m"]
    c = Cluster(tmp_path_factory.mktemp(f"logprobs-{request.param}"))
    try:  # (prefill computes, and scores, prompts in chunks)
        urls = start_pd_and_colocated(c, options, prefill=["--prefill-chunk", "16"])
    except BaseException:
        c.stop()
        raise
    yield request.param, urls, model
    c.stop()


class Exact:
    """The tiny model's float64 logprobs of a token sequence, and the float32 error bound around them."""

    def __init__(self, model_dir: Path) -> None:
        import copy

        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.m32 = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.m64 = copy.deepcopy(self.m32).double().eval()

    def check(self, ids: list[int], start: int, got: list[float], what: str) -> None:
        """``got[j]``: the logprob of ids[start + j] after ids[:start + j]."""
        from tests.numerics import Reference

        torch = self.torch
        with torch.inference_mode():
            x = torch.tensor([ids])
            lp64 = torch.log_softmax(self.m64(x).logits[0].double(), -1)
            lp32 = torch.log_softmax(self.m32(x).logits[0].float(), -1)
        pos = torch.arange(start - 1, len(ids) - 1)
        target = torch.tensor(ids[start:])
        ref = Reference.measure(lp64[pos, target], lp32[pos, target])
        ref.check(torch.tensor(got, dtype=torch.float32), what)


@pytest.fixture(scope="module")
def exact(cluster):
    engine, _, model = cluster
    return Exact(model) if engine == "tiny" else None


def _same_logprobs(engine: str, a: dict, b: dict, chat: bool) -> None:
    """Two answers' logprobs: the very values on the simulated engine; on the model the same tokens, offsets
    and alternatives (values are checked against float64 on their own: two paths differ in the last bits)."""
    if engine == "sim":
        assert a == b
        return
    if chat:
        assert [x["token"] for x in a["content"]] == [x["token"] for x in b["content"]]
        return
    assert a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"]


@pytest.mark.parametrize("top", [0, 3])
def test_completion_logprobs_pd_as_colocated(cluster, exact, top):
    engine, urls, _ = cluster
    body = {**GEN, "logprobs": top, "return_tokens_as_token_ids": True}
    answers = [*_completion(urls["pd"], body), *_completion(urls["co"], body)]  # P/D JSON, stream; colocated
    pd = answers[0]
    for other in answers[1:]:
        assert other["text"] == pd["text"]
        _same_logprobs(engine, pd["logprobs"], other["logprobs"], chat=False)
    lp = pd["logprobs"]
    assert len(lp["tokens"]) == GEN["max_tokens"]
    offsets = [0]
    for name in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(name))
    assert lp["text_offset"] == offsets
    for name, value, alts in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert alts[name] == value  # the chosen token is among its alternatives
        assert len(alts) in (top, top + 1) if top else len(alts) == 1
        assert max(alts.values()) == alts[name]  # greedy: the chosen token is the most likely
    if exact is not None:
        prompt = exact.tok(PROMPT).input_ids
        for i, a in enumerate(answers):
            exact.check(prompt + _ids(a["logprobs"]["tokens"]), len(prompt), a["logprobs"]["token_logprobs"],
                        f"generated logprobs (answer {i})")


def test_chat_logprobs_pd_as_colocated(cluster, exact):
    engine, urls, _ = cluster
    body = {**GEN, "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}
    answers = [*_chat(urls["pd"], body), *_chat(urls["co"], body)]
    pd = answers[0]
    for other in answers[1:]:
        assert other.get("message", {}).get("content", other.get("text")) == pd["message"]["content"]
        _same_logprobs(engine, pd["logprobs"], other["logprobs"], chat=True)
    content = pd["logprobs"]["content"]
    assert len(content) == GEN["max_tokens"]
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode("utf-8", "replace"))
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # (vLLM's order: the chosen token first)
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]
        assert entry["top_logprobs"][1]["logprob"] <= entry["logprob"]  # greedy
    if exact is not None:
        prompt = _call(urls["pd"], "/tokenize", {"messages": MESSAGES})["tokens"]
        for i, a in enumerate(answers):
            got = a["logprobs"]["content"]
            exact.check(prompt + _ids([x["token"] for x in got]), len(prompt), [x["logprob"] for x in got],
                        f"chat logprobs (answer {i})")


def _decode_generations(urls: dict) -> int:
    text = _get(urls["decode"] + "/metrics")
    return sum(int(float(v)) for v in re.findall(r'^xpyd_http_requests_total\{[^}]*route="/v1/[^"]*"[^}]*\} (\S+)$',
                                                text, re.M))


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_prompt_logprobs_answered_by_prefill_alone(cluster, exact, max_tokens):
    """What lm-evaluation-harness sends for a loglikelihood: echo, logprobs, max_tokens 0 or 1."""
    engine, urls, _ = cluster
    body = {"temperature": 0, "max_tokens": max_tokens, "echo": True, "logprobs": 1,
            "return_tokens_as_token_ids": True}
    before = _decode_generations(urls)
    (pd, pd_streamed), (co, _) = _completion(urls["pd"], body), _completion(urls["co"], body)
    assert _decode_generations(urls) == before  # decode never heard of them
    _same_logprobs(engine, pd["logprobs"], pd_streamed["logprobs"], chat=False)
    stats = json.loads(_get(urls["prefill"] + "/xpyd/stats"))
    assert stats["transferring"] == 0 and stats["requests_held"] == 0 and not stats["sends"].get("ok")
    assert pd["text"] == co["text"] and pd["text"].startswith(PROMPT)
    lp = pd["logprobs"]
    _same_logprobs(engine, lp, co["logprobs"], chat=False)
    ids = _ids(lp["tokens"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None for v in lp["token_logprobs"][1:])
    assert pd["finish_reason"] == "length"
    n = len(ids) - max_tokens
    if exact is not None:
        assert ids[:n] == exact.tok(PROMPT).input_ids
        exact.check(ids, 1, lp["token_logprobs"][1:], "echoed prompt logprobs")
    if max_tokens == 0:
        assert pd["text"] == PROMPT
    usage = _call(urls["pd"], "/v1/completions", {**body, "prompt": PROMPT})["usage"]
    assert usage["completion_tokens"] == max_tokens and usage["prompt_tokens"] == n


def test_prompt_logprobs_field(cluster, exact):
    """vLLM's prompt_logprobs: per prompt token null (the first), then {id: {logprob, rank, decoded_token}} for
    the prompt's token and the k most likely; a completion's in its choice, a chat's at the top."""
    engine, urls, _ = cluster
    body = {**GEN, "max_tokens": 3, "prompt_logprobs": 2}
    pd = _call(urls["pd"], "/v1/completions", {**body, "prompt": PROMPT})
    co = _call(urls["co"], "/v1/completions", {**body, "prompt": PROMPT})
    got = pd["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) > 3
    if engine == "sim":
        assert got == co["choices"][0]["prompt_logprobs"]
    prompt = _call(urls["pd"], "/tokenize", {"prompt": PROMPT})["tokens"]
    assert len(got) == len(prompt)
    for i in range(1, len(prompt)):
        pos = got[i]
        assert str(prompt[i]) in pos and 2 <= len(pos) <= 3
        assert {1, 2} <= {v["rank"] for v in pos.values()}  # the two most likely, and the prompt's own rank
    if exact is not None:
        assert prompt == exact.tok(PROMPT).input_ids
        exact.check(prompt, 1, [got[i][str(prompt[i])]["logprob"] for i in range(1, len(prompt))],
                    "prompt_logprobs")
    chat = _call(urls["pd"], "/v1/chat/completions", {**body, "messages": MESSAGES})
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 3
