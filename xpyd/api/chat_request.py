"""A chat request's messages and what it gives the chat template besides them (vLLM's fields), parsed and checked.

Messages: system, developer, user, assistant and tool roles; text content (a string or text parts); an assistant's
``tool_calls`` and a tool message's ``tool_call_id`` (``xpyd.api.tools``). Template arguments: ``ChatTemplateArgs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from xpyd.api.errors import bad_request as _bad
from xpyd.api.fields import optional_bool as _optional_bool
from xpyd.api.tools import Tools, history_calls, tool_message


# Names a chat template sees that chat_template_kwargs may not set (the renderer's own arguments and variables).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize",
    "return_dict", "chat_template", "padding", "truncation", "max_length", "return_tensors", "tokenizer_kwargs",
    "return_assistant_tokens_mask", "sanitize_control_tokens", "bos_token", "eos_token", "unk_token", "pad_token"})
MAX_DOCUMENTS = 64
MAX_TEMPLATE_CHARS = 64 * 1024  # a request's own chat template


@dataclass(frozen=True, slots=True)
class ChatTemplateArgs:
    """What a chat request gives its chat template besides the messages (vLLM's fields): the assistant turn's
    opening (``add_generation_prompt``) or the final message left open to continue (``continue_final_message``),
    ``documents`` and ``tools`` as template variables, and ``chat_template_kwargs`` (any other variables)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list | None = None
    tools: list | None = None
    kwargs: dict = field(default_factory=dict)
    template: str | None = None  # the request's own chat template (vLLM's chat_template field; sandboxed Jinja)

    def as_kwargs(self) -> dict:
        """The arguments of ``apply_chat_template`` (transformers' and ``xpyd.tokenization``'s alike)."""
        out = {**self.kwargs, "add_generation_prompt": self.add_generation_prompt,
               "continue_final_message": self.continue_final_message}
        if self.documents is not None:
            out["documents"] = self.documents
        if self.tools is not None:
            out["tools"] = self.tools
        if self.template is not None:
            out["chat_template"] = self.template
        return out


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _bad(f"messages[{i}]: only text content parts are supported", "messages")
            if not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}]: a text part needs a string 'text'", "messages")
            parts.append(part["text"])
        return "\n".join(parts)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def parse_messages(d: dict) -> list[dict]:
    v = d.get("messages")
    if v is None:
        raise _bad("'messages' is required", "messages")
    if not isinstance(v, list) or not v:
        raise _bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role not in _ROLES:
            raise _bad(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}", "messages")
        if m.get("function_call"):
            raise _bad(f"messages[{i}]: the legacy 'function_call' is not supported: use 'tool_calls'", "messages")
        calls = m.get("tool_calls")
        if calls and role != "assistant":
            raise _bad(f"messages[{i}]: only an assistant message has 'tool_calls'", "messages")
        content = m.get("content")
        text = "" if content is None and (calls or role == "assistant") else _message_text(content, i)
        if role == "tool":
            out.append(tool_message(i, m, text))
            continue
        msg = {"role": role, "content": text}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if calls:
            msg["tool_calls"] = history_calls(i, calls)
        out.append(msg)
    return out


UNTRUSTED_TEMPLATE = ("a chat template was passed with the request, but this server does not run requests' templates "
                      "(--trust-request-chat-template is not set)")


def parse_chat_args(d: dict, tools: Tools | None, trusted_templates: bool = False) -> ChatTemplateArgs:
    """``trusted_templates``: a request's own ``chat_template`` is run (vLLM's --trust-request-chat-template;
    else a 400: a template is code, sandboxed, but a stranger's may still spend the server's CPU)."""
    agp = _optional_bool(d, "add_generation_prompt", True)
    cont = _optional_bool(d, "continue_final_message")
    if agp and cont:
        raise _bad("cannot set both 'continue_final_message' and 'add_generation_prompt' to true (set "
                   "add_generation_prompt to false to continue the final message)", "continue_final_message")
    docs = d.get("documents")
    if docs is not None:
        if not isinstance(docs, list) or not all(isinstance(doc, dict) and all(isinstance(k, str) for k in doc)
                                                 for doc in docs):
            raise _bad("'documents' must be a list of objects", "documents")
        if len(docs) > MAX_DOCUMENTS:
            raise _bad(f"at most {MAX_DOCUMENTS} documents are supported", "documents")
    kwargs = d.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        raise _bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    reserved = sorted(k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise _bad(f"'chat_template_kwargs' may not set {', '.join(reserved)} (the request's own fields do)",
                   "chat_template_kwargs")
    if not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise _bad("'chat_template_kwargs' keys must be identifiers", "chat_template_kwargs")
    effort = d.get("reasoning_effort")  # (a template variable, as vLLM hands it to reasoning models' templates)
    if effort is not None:
        if not isinstance(effort, str):
            raise _bad("'reasoning_effort' must be a string", "reasoning_effort")
        kwargs = {"reasoning_effort": effort, **kwargs}
    include = d.get("include_reasoning")
    if include is not None and not isinstance(include, bool):  # (no reasoning parser: no reasoning to include)
        raise _bad("'include_reasoning' must be a boolean", "include_reasoning")
    template = d.get("chat_template")
    if template is not None and not (isinstance(template, str) and 0 < len(template) <= MAX_TEMPLATE_CHARS):
        raise _bad(f"'chat_template' must be a template of 1 to {MAX_TEMPLATE_CHARS} characters", "chat_template")
    if template is not None and not trusted_templates:
        raise _bad(UNTRUSTED_TEMPLATE, "chat_template")
    return ChatTemplateArgs(agp, cont, docs, tools.definitions if tools is not None else None, dict(kwargs), template)
