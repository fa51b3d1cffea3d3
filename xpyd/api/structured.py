"""Structured output as OpenAI and vLLM ask for it, read into one ``Constraint`` (what the workers' grammar
engine, ``xpyd.model.grammar``, compiles):

    response_format   {"type": "text"}                                   no constraint
                      {"type": "json_object"}                            any JSON object
                      {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} | {"json_object": true}
    guided_json, guided_regex, guided_choice, guided_grammar            (vLLM's older names)
    tool_choice       required, or a named function (``xpyd.api.tool_output``)

At most one may be given (two are a 400 naming the second). JSON allows any white space between its tokens, as
vLLM's default; ``structured_outputs.disable_any_whitespace`` allows none, and ``structured_outputs.whitespace_pattern``
or ``guided_whitespace_pattern`` (a regex) sets it (the grammar engine's ``x-guidance`` options, written into
the schema). ``guided_decoding_backend`` names an engine: any value is taken (xpyd has one, llguidance); structural
tags are a 400 that names them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from xpyd.api.errors import bad_request as _bad
from xpyd.api.tool_output import named_schema, required_schema
from xpyd.api.tools import ToolMode, Tools

MAX_CHOICE_STRINGS = 1024


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: str  # json_object | json_schema | regex | choice | grammar (``xpyd.model.grammar.KINDS``)
    value: str  # "" | the schema's JSON | the regex | the choices' JSON list | the grammar
    param: str  # the request field it came from (a grammar the engine refuses is a 400 naming it)


def _schema(value: Any, param: str, spacing: dict | None = None) -> Constraint:
    """A JSON schema constraint; ``spacing``: the grammar engine's white space options for it."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise _bad(f"'{param}' is not a JSON schema: {e}", param) from None
    if not isinstance(value, dict):
        raise _bad(f"'{param}' must be a JSON schema (an object)", param)
    if spacing:
        value = {**value, "x-guidance": {**(value.get("x-guidance") or {}), **spacing}}
    return Constraint("json_schema", json.dumps(value, ensure_ascii=False), param)


def _json_object(param: str, spacing: dict | None) -> Constraint:
    return _schema({"type": "object"}, param, spacing) if spacing else Constraint("json_object", "", param)


def _spacing(disable: Any, pattern: Any, param: str) -> dict | None:
    if disable is not None and not isinstance(disable, bool):
        raise _bad(f"'{param}' disable_any_whitespace must be a boolean", param)
    if pattern is not None and (not isinstance(pattern, str) or not pattern):
        raise _bad(f"'{param}' must be a non-empty regular expression", param)
    if disable:
        return {"whitespace_flexible": False}
    return {"whitespace_pattern": pattern} if pattern is not None else None


def _text(value: Any, kind: str, param: str) -> Constraint:
    if not isinstance(value, str) or not value:
        raise _bad(f"'{param}' must be a non-empty string", param)
    return Constraint(kind, value, param)


def _choice(value: Any, param: str) -> Constraint:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise _bad(f"'{param}' must be a non-empty list of non-empty strings", param)
    if len(value) > MAX_CHOICE_STRINGS:
        raise _bad(f"'{param}' may list at most {MAX_CHOICE_STRINGS} strings", param)
    return Constraint("choice", json.dumps(value, ensure_ascii=False), param)


def _response_format(v: Any, spacing: dict | None) -> Constraint | None:
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise _bad("'response_format' must be {'type': 'text' | 'json_object' | 'json_schema', ...}", "response_format")
    kind = v["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_object("response_format", spacing)
    if kind == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise _bad("'response_format' json_schema needs 'json_schema': {'name': ..., 'schema': {...}}",
                       "response_format")
        return _schema(spec["schema"], "response_format", spacing)
    raise _bad(f"'response_format' type {kind!r} is not supported (text, json_object or json_schema)",
               "response_format")


def _structured_outputs(v: Any, spacing: dict | None) -> Constraint | None:
    if v.get("structural_tag") is not None:
        raise _bad("'structured_outputs.structural_tag' is not supported", "structured_outputs")
    given = [k for k in ("json", "regex", "choice", "grammar") if v.get(k) is not None]
    if v.get("json_object"):
        given.append("json_object")
    if len(given) > 1:
        raise _bad(f"'structured_outputs' gives {' and '.join(given)}: give one", "structured_outputs")
    if not given:
        return None
    key = given[0]
    p = "structured_outputs"
    if key == "json":
        return _schema(v["json"], p, spacing)
    if key == "choice":
        return _choice(v["choice"], p)
    if key == "json_object":
        return _json_object(p, spacing)
    return _text(v[key], key, p)


_GUIDED = {"guided_json": lambda v, spacing: _schema(v, "guided_json", spacing),
           "guided_regex": lambda v, _: _text(v, "regex", "guided_regex"),
           "guided_choice": lambda v, _: _choice(v, "guided_choice"),
           "guided_grammar": lambda v, _: _text(v, "grammar", "guided_grammar")}


def parse_constraint(d: dict, tools: Tools | None) -> Constraint | None:
    """The request's one constraint on its output (None: free text)."""
    so = d.get("structured_outputs")
    if so is not None and not isinstance(so, dict):
        raise _bad("'structured_outputs' must be an object", "structured_outputs")
    so = so or {}
    if d.get("guided_whitespace_pattern") is not None:
        spacing = _spacing(None, d["guided_whitespace_pattern"], "guided_whitespace_pattern")
    else:
        spacing = _spacing(so.get("disable_any_whitespace"), so.get("whitespace_pattern"), "structured_outputs")
    found: list[Constraint] = []
    if d.get("response_format") is not None:
        c = _response_format(d["response_format"], spacing)
        if c is not None:
            found.append(c)
    if d.get("structured_outputs") is not None:
        c = _structured_outputs(so, spacing)
        if c is not None:
            found.append(c)
    for key, read in _GUIDED.items():
        if d.get(key) is not None:
            found.append(read(d[key], spacing))
    if tools is not None and tools.mode in (ToolMode.REQUIRED, ToolMode.NAMED):
        schema = required_schema(tools) if tools.mode is ToolMode.REQUIRED else named_schema(tools)
        found.append(_schema(schema, "tool_choice", spacing))
    if len(found) > 1:
        raise _bad(f"give one constraint on the output: '{found[0].param}' and '{found[1].param}' were both given",
                   found[1].param)
    return found[0] if found else None
