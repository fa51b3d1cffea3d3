"""Tool calls read from a model's output text (``tool_choice: auto``), as vLLM's ``--tool-call-parser`` reads them.

Formats:

- ``hermes`` (Hermes, Qwen 2/2.5/3 and the many templates that copy them): calls are
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; text outside them is content.
- ``llama3_json`` (Llama 3.x's JSON tool calling): an output that starts (after white space, or
  ``<|python_tag|>``) with ``{`` is one or more ``{"name": ..., "parameters": {...}}`` objects separated by
  ``;``; any other output is content.

``ToolCallParser`` reads a stream of text deltas (``feed``, then ``finish``) and says what the client gets:
content deltas, and each call whole once it is complete (its id, name and arguments as a JSON string, in one
``tool_calls`` delta: clients join argument deltas, so one whole delta is a valid stream). Text that looks like
a call but is not valid JSON stays content. ``parse`` does it all at once. Pure Python: the proxy uses it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

PARSERS = ("hermes", "llama3_json")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call_from(obj: object, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """A call from a decoded object with a string ``name`` and object arguments (None otherwise)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(args, str):  # (some models write the arguments as a JSON string)
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallParser:
    """One output's text, as it streams: ``feed`` each delta, then ``finish``; each returns
    (content to show, calls completed)."""

    def __init__(self, name: str) -> None:
        if name not in PARSERS:
            raise ValueError(f"tool call parser must be one of {', '.join(PARSERS)}, not {name!r}")
        self.name = name
        self._buf = ""
        self._in_call = False  # hermes: inside a <tool_call> block
        self._opened = False  # hermes: a block was opened (white space between blocks is no content)
        self._mode: str | None = None  # llama3_json: "calls" or "content" once the output's start decides it
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        return self._hermes(False) if self.name == "hermes" else self._llama(False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._hermes(True) if self.name == "hermes" else self._llama(True)

    def _text(self, content: list[str], piece: str) -> None:
        """Content outside calls; after a call, white space alone is none (what separates calls)."""
        if piece and not (self._opened and not piece.strip()):
            content.append(piece)

    def _done(self, content: str, calls: list[ToolCall]) -> tuple[str, list[ToolCall]]:
        self.calls.extend(calls)
        return content, calls

    def _hermes(self, end: bool) -> tuple[str, list[ToolCall]]:
        content, calls = [], []
        while True:
            if not self._in_call:
                at = self._buf.find(_OPEN)
                if at < 0:
                    keep = 0 if end else _partial_suffix(self._buf, _OPEN)
                    if not end and self._opened and not self._buf[: len(self._buf) - keep].strip():
                        break  # (white space after a call: kept back, it is content only if text follows)
                    self._text(content, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                self._text(content, self._buf[:at])
                self._buf, self._in_call, self._opened = self._buf[at + len(_OPEN):], True, True
            at = self._buf.find(_CLOSE)
            if at < 0 and not end:
                break
            body = self._buf if at < 0 else self._buf[:at]
            call = _json_call(body)
            if call is None:  # not a call after all: the block stays text
                content.append(_OPEN + body + ("" if at < 0 else _CLOSE))
            else:
                calls.append(call)
            self._buf, self._in_call = ("" if at < 0 else self._buf[at + len(_CLOSE):]), False
            if at < 0:
                break
        return self._done("".join(content), calls)

    def _llama(self, end: bool) -> tuple[str, list[ToolCall]]:
        if self._mode is None:
            head = self._buf.lstrip()
            if head.startswith(_PYTHON_TAG) or head.startswith("{"):
                self._mode = "calls"
            elif head and not _PYTHON_TAG.startswith(head):
                self._mode = "content"
            elif not end:
                return "", []
            else:
                self._mode = "content"
        if self._mode == "content":
            text, self._buf = self._buf, ""
            return self._done(text, [])
        if not end:
            return "", []
        text = self._buf.strip()
        text = text[len(_PYTHON_TAG):] if text.startswith(_PYTHON_TAG) else text
        calls = []
        for part in _split_objects(text):
            call = _json_call(part)
            if call is None:  # not calls after all: the whole output is content
                self._buf = ""
                return self._done(text, [])
            calls.append(call)
        self._buf = ""
        return self._done("", calls)


def _json_call(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text.strip())
    except ValueError:
        return None
    return call_from(obj)


def _split_objects(text: str) -> list[str]:
    """``a; b; c`` where each is a JSON object (split at top-level semicolons outside strings)."""
    parts, depth, start, in_str, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (held back: it may be a tag's start)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def parse(name: str, text: str) -> tuple[str, list[ToolCall]]:
    """A whole output: its content and its calls."""
    p = ToolCallParser(name)
    content, calls = p.feed(text)
    more, last = p.finish()
    return content + more, calls + last
