"""A chat answer's text as the client gets it when tools are in play: content and ``tool_calls``, as vLLM writes
them.

- ``auto``: the server's ``--tool-call-parser`` (``xpyd.api.tool_parsers``) reads calls out of the text; the
  finish reason is ``tool_calls`` when it found any.
- ``required``: the text is a JSON array of ``{"name": ..., "parameters": {...}}`` (structured output forces it),
  each item one call; finish reason ``tool_calls``.
- a named function: the text is that function's arguments (forced likewise): one call, streamed as the text
  comes (its name first, then the arguments in pieces); finish reason ``stop``.

Whoever writes the client's answer uses it: the P/D proxy (prefill's first token and decode's deltas), or a
colocated worker. ``auto`` without a parser is refused before anything runs (``check_tools``).
"""

from __future__ import annotations

import json

from xpyd.api.errors import APIError
from xpyd.api.tool_parsers import ToolCall, ToolCallParser, call_from, new_call_id
from xpyd.api.tools import ToolMode, Tools


def check_tools(tools: Tools | None, parser: str | None) -> None:
    """400 for ``tool_choice: auto`` on a server without a tool call parser (as vLLM: it needs
    ``--enable-auto-tool-choice`` and ``--tool-call-parser``)."""
    if tools is not None and tools.mode is ToolMode.AUTO and parser is None:
        raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                       param="tool_choice")


def required_schema(tools: Tools) -> dict:
    """The JSON schema a ``required`` answer is forced into: one or more calls of the given functions (one,
    without parallel_tool_calls)."""
    items = {"anyOf": [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [t["function"]["name"]]},
        "parameters": t["function"].get("parameters") or {"type": "object"}},
        "required": ["name", "parameters"], "additionalProperties": False} for t in tools.definitions]}
    schema: dict = {"type": "array", "minItems": 1, "items": items}
    if not tools.parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(tools: Tools) -> dict:
    """The JSON schema of the named function's arguments."""
    return tools.function(tools.name or "").get("parameters") or {"type": "object"}


class ToolOutput:
    """One answer's text (fed in deltas) as chat deltas: ``{"content": ...}`` or ``{"tool_calls": [...]}``."""

    def __init__(self, tools: Tools, parser: str | None) -> None:
        self.tools = tools
        self._parser = ToolCallParser(parser) if tools.mode is ToolMode.AUTO and parser is not None else None
        self._text = ""
        self._named_id: str | None = None
        self.calls: list[ToolCall] = []

    def delta(self, text: str) -> list[dict]:
        if not text:
            return []
        mode = self.tools.mode
        if mode is ToolMode.AUTO:
            return self._parsed(*self._parser.feed(text))
        if mode is ToolMode.NAMED:
            out = []
            if self._named_id is None:
                self._named_id = new_call_id()
                out.append({"tool_calls": [{"index": 0, "id": self._named_id, "type": "function",
                                            "function": {"name": self.tools.name, "arguments": ""}}]})
            self._text += text
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out
        self._text += text  # required: the array is read whole at the end
        return []

    def finish(self) -> list[dict]:
        mode = self.tools.mode
        if mode is ToolMode.AUTO:
            return self._parsed(*self._parser.finish())
        if mode is ToolMode.NAMED:
            out = []
            if self._named_id is None:  # (no text at all: the call, with no arguments)
                self._named_id = new_call_id()
                out.append({"tool_calls": [{"index": 0, "id": self._named_id, "type": "function",
                                            "function": {"name": self.tools.name, "arguments": ""}}]})
            self.calls = [ToolCall(self._named_id, self.tools.name or "", self._text)]
            return out
        return self._parsed("", self._required_calls())

    def _required_calls(self) -> list[ToolCall]:
        try:
            items = json.loads(self._text)
        except ValueError:
            return []
        calls = [call_from(item) for item in items] if isinstance(items, list) else []
        return [c for c in calls if c is not None]

    def _parsed(self, content: str, calls: list[ToolCall]) -> list[dict]:
        out = [{"content": content}] if content else []
        if calls:
            start = len(self.calls)
            self.calls.extend(calls)
            out.append({"tool_calls": [{"index": start + i, **c.to_dict()} for i, c in enumerate(calls)]})
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """The answer's finish reason: ``tool_calls`` when calls were made (auto, required)."""
        if reason is not None and self.calls and self.tools.mode is not ToolMode.NAMED:
            return "tool_calls"
        return reason

    def message(self, text: str) -> dict:
        """A whole (non-streamed) answer's message fields."""
        content = [d["content"] for d in self.delta(text) + self.finish() if "content" in d]
        return {"content": "".join(content) if content else None,
                "tool_calls": [c.to_dict() for c in self.calls]}
