"""What real applications send, through a 2P2D simulated cluster discovering itself through etcd (`xpyd up
--engine sim --prefill 2 --decode 2`: etcd, four workers and the proxy, all real but the forward pass), against a
colocated worker behind its proxy: logprobs, echo with prompt logprobs (answered by prefill alone), prompt_logprobs,
n with seeds and lists of prompts, chat template switches, structured output and tools give the very answers the
colocated worker gives (the simulated tokens are a function of the sequence), in JSON and in streams."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, UpProcess, free_port, free_port_run

SIM = ["--served-model-name", "m", "--engine", "sim", "--sim-speedup", "inf", "--max-model-len", "512",
       "--tool-call-parser", "hermes"]
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
FORCED = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "unit": "F"}}</tool_call>'

CASES = [
    ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 6, "logprobs": 3,
                         "return_tokens_as_token_ids": True, "temperature": 0}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 5, "logprobs": True, "top_logprobs": 2}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 0, "echo": True, "logprobs": 1}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 1, "echo": True, "logprobs": 1}),
    ("/v1/completions", {"prompt": "A long time ago", "max_tokens": 3, "prompt_logprobs": 2}),
    ("/v1/completions", {"prompt": ["first prompt here", "a second prompt"], "n": 3, "seed": 4, "temperature": 0.9,
                         "max_tokens": 5}),
    ("/v1/chat/completions", {"messages": [*CHAT, {"role": "assistant", "content": "It is"}],
                              "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 4}),
    ("/v1/completions", {"prompt": "Answer:", "guided_choice": ["yes", "no"], "temperature": 1.0, "seed": 2,
                         "max_tokens": 8}),
    ("/v1/completions", {"prompt": "Number:", "guided_regex": r"\d{2}-\d{2}", "max_tokens": 12}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 60, "response_format": {
        "type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER["function"]["parameters"]}}, **COMPACT}),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 80,
                              **COMPACT}),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [WEATHER], "max_tokens": 80,
                              "guided_regex": re.escape(FORCED)}),
]


def _greedy_unless_seeded(cases: list) -> list:
    return [(path, body if "seed" in body else {"temperature": 0, **body}) for path, body in cases]


CASES = _greedy_unless_seeded(CASES)


def _post(url: str, path: str, body: dict):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read()
    if not body.get("stream"):
        return json.loads(raw)
    return [json.loads(ln[6:]) for ln in raw.decode().splitlines() if ln.startswith("data: {")]


def _plain(obj):
    """Without what is new each time (tool call ids)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items() if not (k == "id" and str(v).startswith("chatcmpl-tool-"))}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


def _streamed(events: list[dict]) -> dict:
    """Each choice's chunks, in order (the choices of a stream interleave as they come)."""
    out: dict[int, list] = {}
    for e in events:
        for c in e["choices"]:
            out.setdefault(c["index"], []).append(_plain(c))
    return out


@pytest.fixture(scope="module")
def colocated(tmp_path_factory, smollm_dir: Path):
    c = Cluster(tmp_path_factory.mktemp("features-colocated"))
    wp, cp = free_port(), free_port()
    try:
        c.start("colocated", ["colocated", "--model", str(smollm_dir), *SIM, "--port", str(wp)],
                f"http://127.0.0.1:{wp}")
        # (the proxy serves, and answers /health, once the worker answered its /xpyd/info)
        c.start("proxy", ["proxy", "--port", str(cp), "--colocated", f"http://127.0.0.1:{wp}"],
                f"http://127.0.0.1:{cp}")
        c.wait_healthy()
    except BaseException:
        c.stop()
        raise
    yield f"http://127.0.0.1:{cp}"
    c.stop()


def test_features_through_2p2d_over_etcd_give_the_colocated_answers(tmp_path, smollm_dir, colocated):
    up = UpProcess(smollm_dir, tmp_path / "up.log", *SIM, "--prefill", "2", "--decode", "2",
                   "--etcd-port", str(free_port_run(2)))
    try:
        up.wait_ready()
        for path, body in CASES:
            got, want = _post(up.url, path, body), _post(colocated, path, body)
            assert _plain(got["choices"]) == _plain(want["choices"]), (body, got["choices"], want["choices"])
            assert got["usage"] == want["usage"], body
            if not body.get("prompt_logprobs"):
                streamed = {**body, "stream": True}
                assert _streamed(_post(up.url, path, streamed)) == _streamed(_post(colocated, path, streamed)), body
        # and the answers are what was asked (spot checks: the comparisons above hold them to colocated's)
        (_, echo0), (_, tools_required) = CASES[2], CASES[10]
        assert _post(up.url, "/v1/completions", echo0)["choices"][0]["text"] == echo0["prompt"]
        calls = _post(up.url, "/v1/chat/completions", tools_required)["choices"][0]["message"]["tool_calls"]
        assert calls and all(c["function"]["name"] == "get_weather" for c in calls)
    finally:
        up.stop()
