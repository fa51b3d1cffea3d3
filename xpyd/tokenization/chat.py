"""Chat templates rendered as transformers renders them, with jinja2 alone.

Sandboxed Jinja with ``trim_blocks`` and ``lstrip_blocks``, the loop-control extension and
``{% generation %}`` blocks; transformers' ``tojson`` (plain JSON, no HTML escaping), ``raise_exception`` and
``strftime_now``; the variables ``messages``, ``tools`` and ``documents`` (None), ``add_generation_prompt`` and
the special tokens' strings (``bos_token`` ...). Any way a template fails is a ValueError.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


def compile_template(source: str) -> jinja2.Template:
    """The template ``source`` compiled (ValueError for a syntax error)."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template: {e}") from None


def render(template: jinja2.Template, messages: list, special_tokens: Mapping[str, str],
           add_generation_prompt: bool = True) -> str:
    """``messages`` (as they are: no message is changed or checked here) through ``template``."""
    try:
        return template.render(messages=messages, tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **special_tokens)
    except Exception as e:  # raise_exception's TemplateError, or whatever the template trips on
        raise ValueError(f"chat template failed on these messages: {e}") from None


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env
