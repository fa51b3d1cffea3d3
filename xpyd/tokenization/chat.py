"""Chat templates rendered as transformers renders them, with jinja2 alone.

Sandboxed Jinja with ``trim_blocks`` and ``lstrip_blocks``, the loop-control extension and
``{% generation %}`` blocks; transformers' ``tojson`` (plain JSON, no HTML escaping), ``raise_exception`` and
``strftime_now``; the variables ``messages``, ``tools`` and ``documents``, ``add_generation_prompt``, the special
tokens' strings (``bos_token`` ...) and a request's chat_template_kwargs; ``continue_final_message`` cuts the text
after the final message as transformers does. Any way a template fails is a ValueError.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
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


CONTINUE_TAG = "XPYD_CONTINUE_FINAL_MESSAGE_TAG "  # marks where the final message ends (continue_final_message)


def render(template: jinja2.Template, messages: list, special_tokens: Mapping[str, str],
           add_generation_prompt: bool = True, continue_final_message: bool = False, tools: list | None = None,
           documents: list | None = None, **variables: Any) -> str:
    """``messages`` (as they are: no message is changed or checked here) through ``template``; ``variables``:
    more names the template may read (a request's chat_template_kwargs). ``continue_final_message``: the text
    ends where the final message's content ends (``continue_final``), for the model to continue it."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
    final = None
    if continue_final_message:
        final, messages = _tag_final(messages)
    try:
        text = template.render(**{**variables, **special_tokens}, messages=messages, tools=tools,
                               documents=documents, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # raise_exception's TemplateError, or whatever the template trips on
        raise ValueError(f"chat template failed on these messages: {e}") from None
    return continue_final(text, final) if final is not None else text


def _tag_final(messages: list) -> tuple[str, list]:
    last = messages[-1] if messages else None
    if not isinstance(last, Mapping) or not isinstance(last.get("content"), str):
        raise ValueError("continue_final_message needs a final message with text content")
    return last["content"], [*messages[:-1], {**last, "content": last["content"] + CONTINUE_TAG}]


def continue_final(text: str, final: str) -> str:
    """A chat rendered with ``CONTINUE_TAG`` after the final message's content, cut where the tag starts (as
    transformers cuts it): just there when the template kept the tag whole, else with the space before it
    stripped (the template trimmed the content)."""
    tag = CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError("continue_final_message: the final message does not appear in the rendered chat (the chat "
                         "template changes it)")
    at = text.rindex(tag)
    return text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


def read_chat_template(value: str) -> str:
    """``--chat-template``'s value as vLLM reads it: the template itself when it has a Jinja tag, else a file's
    text; ValueError for a file that cannot be read, or a template that does not compile."""
    if "{{" in value or "{%" in value:
        text = value
    else:
        try:
            text = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {value}: {e}") from None
    compile_template(text)  # (a syntax error now, not on the first chat request)
    return text


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
