"""Structured output and tools through the P/D proxy and a colocated worker (simulated workers, whose tokens
are a function of the sequence: any output the grammar allows is one the sampler may pick): the grammar masks
token 1 on prefill and the rest on decode, so P/D gives the colocated answer, and every answer follows its
constraint (a choice, a regex, a JSON schema); tool_choice required and named are forced into calls, auto is
parsed by the server's --tool-call-parser (hermes), streamed as tool_calls deltas."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port, post_json, start_pd_and_colocated

CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "size": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["colour", "size"], "additionalProperties": False}


_call = post_json


@pytest.fixture(scope="module")
def urls(tmp_path_factory, smollm_dir: Path):
    options = ["--model", str(smollm_dir), "--engine", "sim", "--sim-speedup", "inf", "--threads", "1",
               "--max-model-len", "512", "--served-model-name", "m"]
    c = Cluster(tmp_path_factory.mktemp("structured"))
    try:
        out = start_pd_and_colocated(c, options, colocated=["--tool-call-parser", "hermes"],
                                     pd_proxy=["--tool-call-parser", "hermes"])
    except BaseException:
        c.stop()
        raise
    yield out
    c.stop()


def _both(urls: dict, path: str, body: dict) -> dict:
    """P/D's answer, which must be colocated's (the same tokens under the same grammar)."""
    pd, co = _call(urls["pd"], path, body), _call(urls["co"], path, body)
    assert pd["choices"] == co["choices"], (pd["choices"], co["choices"])
    return pd


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_choice_regex_and_schema_hold(urls, seed):
    sampled = {"temperature": 1.0, "seed": seed, "max_tokens": 48}
    a = _both(urls, "/v1/completions", {"prompt": "Pick:", **sampled, "guided_choice": ["yes", "no", "maybe"]})
    assert a["choices"][0]["text"] in ("yes", "no", "maybe") and a["choices"][0]["finish_reason"] == "stop"
    a = _both(urls, "/v1/completions", {"prompt": "Call", **sampled,
                                        "structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{4}", a["choices"][0]["text"]), a["choices"][0]
    # (JSON allows any white space, as vLLM's default: a simulated model, which picks among what is allowed, would
    # write it forever; these ask for none, as vLLM's disable_any_whitespace, and a pattern of one space)
    for constraint in ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
                       {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
                        "guided_whitespace_pattern": " "}):
        a = _both(urls, "/v1/chat/completions", {"messages": CHAT, **sampled, "max_tokens": 200, **constraint})
        choice = a["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        thing = json.loads(choice["message"]["content"])
        assert thing["colour"] in ("red", "green", "blue") and 1 <= thing["size"] <= 9
        assert set(thing) == {"colour", "size"}


def test_a_stream_follows_the_grammar_too(urls):
    body = {"prompt": "Pick:", "temperature": 1.0, "seed": 7, "max_tokens": 20, "guided_choice": ["alpha", "beta"]}
    events = _call(urls["pd"], "/v1/completions", {**body, "stream": True})
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == _call(urls["pd"], "/v1/completions", body)["choices"][0]["text"] in ("alpha", "beta")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named_are_calls(urls, stream):
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        body = {"messages": CHAT, "tools": [WEATHER, TIME], "tool_choice": choice, "temperature": 1.0, "seed": 3,
                "max_tokens": 200, "parallel_tool_calls": False,
                "structured_outputs": {"disable_any_whitespace": True}}
        for url in (urls["pd"], urls["co"]):
            if not stream:
                message = _call(url, "/v1/chat/completions", body)["choices"][0]
                calls = message["message"]["tool_calls"]
                finish = message["finish_reason"]
            else:
                events = _call(url, "/v1/chat/completions", {**body, "stream": True})
                calls = _joined_calls(events)
                finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]][-1]
            assert len(calls) == 1 and calls[0]["function"]["name"] in names, calls
            args = json.loads(calls[0]["function"]["arguments"])
            if calls[0]["function"]["name"] == "get_time":
                assert args == {"zone": args["zone"]} and args["zone"] in ("UTC", "CET")
            else:
                assert args["city"] in ("Paris", "Rome") and args["unit"] in ("C", "F")
            assert finish == ("tool_calls" if choice == "required" else "stop")


def _joined_calls(events: list[dict]) -> list[dict]:
    """A stream's tool call deltas joined as a client joins them (by index; arguments concatenated)."""
    calls: dict[int, dict] = {}
    for e in events:
        for c in e["choices"]:
            for d in c["delta"].get("tool_calls") or []:
                call = calls.setdefault(d["index"], {"id": None, "function": {"name": "", "arguments": ""}})
                call["id"] = d.get("id") or call["id"]
                fn = d.get("function") or {}
                call["function"]["name"] += fn.get("name") or ""
                call["function"]["arguments"] += fn.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


FORCED = ('Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
          '</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_are_parsed_out_of_the_text(urls, stream):
    """The hermes parser reads a call out of the output (forced here with a regex: the simulated model writes
    no calls of its own), on the proxy (P/D) and on the colocated worker."""
    body = {"messages": CHAT, "tools": [WEATHER], "temperature": 0, "max_tokens": 120,
            "guided_regex": re.escape(FORCED)}
    for url in (urls["pd"], urls["co"]):
        if stream:
            events = _call(url, "/v1/chat/completions", {**body, "stream": True})
            content = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
            calls = _joined_calls(events)
            finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]][-1]
        else:
            choice = _call(url, "/v1/chat/completions", body)["choices"][0]
            content, calls, finish = (choice["message"]["content"], choice["message"]["tool_calls"],
                                      choice["finish_reason"])
        assert content == "Let me check."
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_weather", {"city": "Paris", "unit": "C"})]
        assert calls[0]["id"].startswith("chatcmpl-tool-") and finish == "tool_calls"


def test_tool_history_reaches_the_template(urls):
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "C"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    body = {"messages": history, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 4, "temperature": 0}
    a = _both(urls, "/v1/chat/completions", body)
    assert a["choices"][0]["finish_reason"] == "length"
    tokenized = _call(urls["prefill"], "/tokenize", {"messages": history, "tools": [WEATHER]})
    assert a["usage"]["prompt_tokens"] == tokenized["count"]
    prompt = _call(urls["prefill"], "/detokenize", {"tokens": tokenized["tokens"]})["prompt"]
    assert "<|im_start|>tool\n18 C and sunny<|im_end|>" in prompt  # (SmolLM2's template writes no tools)


@pytest.mark.parametrize("body, param", [
    ({"messages": CHAT, "tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),  # (the decode-less proxy: no parser)
    ({"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    ({"messages": CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"messages": CHAT, "guided_regex": "(unclosed"}, "guided_regex"),
    ({"messages": CHAT, "guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"messages": CHAT, "tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
])
def test_bad_constraints_are_400(urls, tmp_path, body, param):
    url = urls["pd"] if param != "tool_choice" or body.get("tool_choice") != "auto" else None
    if url is None:  # auto needs a parser: a proxy started without one refuses it
        return _auto_without_parser(urls, body)
    err = _call(url, "/v1/chat/completions", {**body, "max_tokens": 4}, status=400)
    assert err["error"]["param"] == param, err


def _auto_without_parser(urls: dict, body: dict) -> None:
    import subprocess
    import sys
    import time

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "xpyd", "proxy", "--port", str(port), "--prefill", urls["prefill"],
                             "--decode", urls["decode"]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                err = _call(f"http://127.0.0.1:{port}", "/v1/chat/completions", {**body, "max_tokens": 4}, status=400)
                break
            except (AssertionError, urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        assert err["error"]["param"] == "tool_choice" and "--tool-call-parser" in err["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(15)


def test_the_official_client_parses_and_calls_tools(urls):
    """The openai client's ``.parse()`` with a pydantic model, and ``tool_choice="required"``, through the P/D
    proxy: schema-valid every time (ten seeds)."""
    from typing import Literal

    import openai
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: Literal["Paris", "Rome", "Oslo"]
        celsius: int = Field(ge=-20, le=40)
        sunny: bool

    client = openai.OpenAI(base_url=urls["pd"] + "/v1", api_key="none", max_retries=0)
    compact = {"structured_outputs": {"disable_any_whitespace": True}}  # (a simulated model writes white space forever)
    for seed in range(10):
        done = client.beta.chat.completions.parse(model="m", messages=CHAT, response_format=Weather, seed=seed,
                                                  temperature=1.0, max_tokens=120, extra_body=compact)
        parsed = done.choices[0].message.parsed
        assert isinstance(parsed, Weather) and -20 <= parsed.celsius <= 40, done
        called = client.chat.completions.create(model="m", messages=CHAT, tools=[WEATHER, TIME], seed=seed,
                                                tool_choice="required", temperature=1.0, max_tokens=200,
                                                parallel_tool_calls=False,  # (a simulated model would list calls
                                                extra_body=compact)         # at random, as long as max_tokens)
        calls = called.choices[0].message.tool_calls
        assert calls and called.choices[0].finish_reason == "tool_calls", called
        for call in calls:
            args = json.loads(call.function.arguments)
            if call.function.name == "get_weather":
                assert args["city"] in ("Paris", "Rome") and args["unit"] in ("C", "F") and len(args) == 2
            else:
                assert call.function.name == "get_time" and args["zone"] in ("UTC", "CET") and len(args) == 1
