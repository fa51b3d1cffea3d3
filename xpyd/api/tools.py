"""Tools in a chat request, as OpenAI and vLLM take them: ``tools``, ``tool_choice``, ``parallel_tool_calls``,
and the history's ``tool`` messages and assistant ``tool_calls``.

``tool_choice``: ``none`` (the model answers in text; the tools still reach the chat template), ``auto`` (the
model may call tools: its output is parsed by the server's ``--tool-call-parser``, which ``auto`` needs, as in
vLLM), ``required`` (at least one call) or a named function (that one call): the last two are forced by
structured output, whatever the model. Without ``tools`` a ``tool_choice`` other than ``none`` is a 400; with
them the default is ``auto``. The legacy ``functions``/``function_call`` fields are refused (``xpyd.api.openai``).

History: an assistant message's ``tool_calls`` reach the template with each call's ``arguments`` decoded from
its JSON string (as vLLM hands them: templates write them with ``tojson``), a ``tool`` message with its
``tool_call_id``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

from xpyd.api.errors import bad_request as _bad

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class ToolMode(str, Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True, slots=True)
class Tools:
    """A chat request's tools: their definitions (as sent, checked), how the model may use them."""

    definitions: list  # [{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}]
    mode: ToolMode
    name: str | None = None  # NAMED: the function
    parallel: bool = True  # more than one call in an answer

    @property
    def parsed(self) -> bool:
        """The output is parsed for calls (auto) or forced into them (required, named)."""
        return self.mode is not ToolMode.NONE

    def function(self, name: str) -> dict:
        return next(t["function"] for t in self.definitions if t["function"]["name"] == name)


def parse_tools(d: dict) -> Tools | None:
    """A chat body's tools (None: none given and no tool_choice)."""
    tools, choice = d.get("tools"), d.get("tool_choice")
    parallel = d.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if not tools:
        if choice is not None and choice != "none":
            raise _bad("when using 'tool_choice', 'tools' must be set", "tool_choice")
        if tools is not None and not isinstance(tools, list):
            raise _bad("'tools' must be a list", "tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _bad(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    names = [_check_tool(i, t) for i, t in enumerate(tools)]
    if len(set(names)) != len(names):
        raise _bad("'tools' names a function twice", "tools")
    mode, name = _parse_choice(choice, names)
    return Tools(tools, mode, name, True if parallel is None else parallel)


def _check_tool(i: int, tool: Any) -> str:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise _bad(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'", "tools")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise _bad(f"tools[{i}].function.description must be a string", "tools")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise _bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise _bad(f"tools[{i}].function.strict must be a boolean", "tools")
    return name


def _parse_choice(choice: Any, names: list[str]) -> tuple[ToolMode, str | None]:
    if choice is None:
        return ToolMode.AUTO, None
    if isinstance(choice, str):
        try:
            mode = ToolMode(choice)
        except ValueError:
            mode = None
        if mode is None or mode is ToolMode.NAMED:
            raise _bad("'tool_choice' must be none, auto, required or {'type': 'function', 'function': "
                       "{'name': ...}}", "tool_choice")
        return mode, None
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _bad("a named 'tool_choice' is {'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if name not in names:
        raise _bad(f"'tool_choice' names {name!r}, which is not in 'tools'", "tool_choice")
    return ToolMode.NAMED, name


def tool_message(i: int, m: dict, content: str) -> dict:
    """A ``tool`` message as the template gets it."""
    call_id = m.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"messages[{i}]: a tool message needs its 'tool_call_id'", "messages")
    out = {"role": "tool", "content": content, "tool_call_id": call_id}
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def history_calls(i: int, calls: Any) -> list[dict]:
    """An assistant message's ``tool_calls`` as the template gets them (arguments decoded)."""
    if not isinstance(calls, list) or not calls:
        raise _bad(f"messages[{i}].tool_calls must be a non-empty list", "messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"messages[{i}].tool_calls: each call is {{'id', 'type': 'function', 'function': "
                       "{'name', 'arguments'}}", "messages")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise _bad(f"messages[{i}].tool_calls: the arguments of {fn['name']!r} are not JSON",
                           "messages") from None
        if not isinstance(args, dict):
            raise _bad(f"messages[{i}].tool_calls: the arguments of {fn['name']!r} must be a JSON object",
                       "messages")
        out.append({"id": call.get("id") if isinstance(call.get("id"), str) else f"call_{len(out)}",
                    "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out
