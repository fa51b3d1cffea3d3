"""Tools in requests (xpyd.api.tools), tool calls read out of text (xpyd.api.tool_parsers), the answer's content
and tool_calls (xpyd.api.tool_output), and structured output's one constraint (xpyd.api.structured)."""

from __future__ import annotations

import json

import pytest

from xpyd.api.errors import APIError
from xpyd.api.openai import RequestKind, parse_request
from xpyd.api.tool_output import ToolOutput, check_tools
from xpyd.api.tool_parsers import ToolCallParser, parse
from xpyd.api.tools import ToolMode

TOOL = {"type": "function", "function": {"name": "get", "parameters": {"type": "object",
                                                                      "properties": {"q": {"type": "string"}}}}}
CHAT = [{"role": "user", "content": "hi"}]


def _chat(**body):
    return parse_request(json.dumps({"messages": CHAT, **body}).encode(), RequestKind.CHAT)


HERMES = 'Sure.\n<tool_call>\n{"name": "get", "arguments": {"q": "a"}}\n</tool_call>\n<tool_call>{"name": "put", ' \
         '"arguments": {}}</tool_call>'


def test_hermes_reads_every_call_and_keeps_the_text():
    content, calls = parse("hermes", HERMES)
    assert content == "Sure.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get", {"q": "a"}), ("put", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("chatcmpl-tool-") for c in calls)


@pytest.mark.parametrize("cut", [1, 2, 3, 7])
def test_hermes_streamed_in_any_pieces_gives_the_same(cut):
    p = ToolCallParser("hermes")
    content, names = "", []
    for i in range(0, len(HERMES), cut):
        text, calls = p.feed(HERMES[i:i + cut])
        content += text
        names += [c.name for c in calls]
    text, calls = p.finish()
    assert content + text == "Sure.\n" and names + [c.name for c in calls] == ["get", "put"]


def test_text_that_is_not_a_call_stays_text():
    assert parse("hermes", "a <tool_call>not json</tool_call> b")[0] == "a <tool_call>not json</tool_call> b"
    assert parse("hermes", "less than < sign, <tool")[0] == "less than < sign, <tool"
    assert parse("hermes", 'x <tool_call>{"name": "get", "arguments": {}}') [1][0].name == "get"  # (unclosed at EOS)
    assert parse("llama3_json", "Hello {not a call}") == ("Hello {not a call}", [])
    assert parse("llama3_json", '{"broken": ') == ('{"broken":', [])


def test_llama3_json_calls():
    content, calls = parse("llama3_json", '<|python_tag|>{"name": "get", "parameters": {"q": "x;y"}}; '
                                          '{"name": "put", "arguments": "{}"}')
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get", {"q": "x;y"}),
                                                                                     ("put", {})]


def test_tool_output_modes():
    auto = ToolOutput(_chat(tools=[TOOL]).tools, "hermes")
    msg = auto.message('ok <tool_call>{"name": "get", "arguments": {"q": "z"}}</tool_call>')
    assert msg["content"] == "ok " and msg["tool_calls"][0]["function"] == {"name": "get", "arguments": '{"q": "z"}'}
    assert auto.finish_reason("stop") == "tool_calls"
    none_called = ToolOutput(_chat(tools=[TOOL]).tools, "hermes")
    assert none_called.message("just text") == {"content": "just text", "tool_calls": []}
    assert none_called.finish_reason("stop") == "stop"
    named = ToolOutput(_chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get"}}).tools, None)
    deltas = named.delta('{"q":') + named.delta(' "v"}') + named.finish()
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get", "arguments": ""}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"q": "v"}'
    assert named.finish_reason("stop") == "stop" and named.calls[0].arguments == '{"q": "v"}'
    required = ToolOutput(_chat(tools=[TOOL], tool_choice="required").tools, None)
    assert required.delta('[{"name": "get", "parameters": {"q": "1"}}]') == []
    (calls,) = required.finish()
    assert calls["tool_calls"][0]["function"] == {"name": "get", "arguments": '{"q": "1"}'}
    assert required.finish_reason("stop") == "tool_calls"


def test_tool_requests_as_vllm_reads_them():
    r = _chat(tools=[TOOL])
    assert r.tools.mode is ToolMode.AUTO and r.chat.as_kwargs()["tools"] == [TOOL] and r.constraint is None
    with pytest.raises(APIError, match="--tool-call-parser"):
        check_tools(r.tools, None)
    check_tools(r.tools, "hermes")
    check_tools(_chat(tools=[TOOL], tool_choice="required").tools, None)  # (forced: needs no parser)
    r = _chat(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(r.constraint.value)
    assert r.constraint.kind == "json_schema" and schema["maxItems"] == 1 and schema["minItems"] == 1
    r = _chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get"}})
    assert json.loads(r.constraint.value) == TOOL["function"]["parameters"]
    assert _chat(tools=[TOOL], tool_choice="none").tools.parsed is False


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [TOOL, TOOL]}, "tools"),
    ({"tools": "x"}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [TOOL], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]}, "messages"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "{nope"}}]}]}, "messages"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "[not json"}, "guided_json"),
    ({"structured_outputs": {"json": {}, "disable_any_whitespace": "yes"}}, "structured_outputs"),
])
def test_bad_tool_and_constraint_fields_are_400(body, param):
    with pytest.raises(APIError) as e:
        parse_request(json.dumps({"messages": CHAT, **body}).encode(), RequestKind.CHAT)
    assert (e.value.status, e.value.param) == (400, param)


def test_constraints_as_specs():
    c = _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})
    assert (c.constraint.kind, json.loads(c.constraint.value)) == ("json_schema", {"type": "object"})
    c = _chat(structured_outputs={"json_object": True, "disable_any_whitespace": True})
    assert json.loads(c.constraint.value) == {"type": "object", "x-guidance": {"whitespace_flexible": False}}
    c = _chat(response_format={"type": "json_object"}, guided_whitespace_pattern=" ?")
    assert json.loads(c.constraint.value)["x-guidance"] == {"whitespace_pattern": " ?"}
    assert _chat(response_format={"type": "json_object"}).constraint.kind == "json_object"
    assert _chat(response_format={"type": "text"}).constraint is None
    assert json.loads(_chat(guided_choice=["a", "b"]).constraint.value) == ["a", "b"]
    assert _chat(structured_outputs={"grammar": "start: 'x'"}).constraint.kind == "grammar"
