"""vLLM's ``/tokenize``, ``/detokenize`` and ``/version``: request parsing, and the answers for a tokenizer.

Shared by the workers (their transformers tokenizer, or ``xpyd.tokenization``'s under the simulated engine) and
the proxy (its copy of the workers' tokenizer), so both answer with the same tokens. The shapes are vLLM's
(``vllm/entrypoints/serve/tokenize/protocol.py``)::

    POST /tokenize    {"prompt": str, "add_special_tokens": true, "return_token_strs": false}      completion form
                      {"messages": [...], "add_generation_prompt": true, "add_special_tokens": false,
                       "continue_final_message": false, "return_token_strs": false}                chat form
                   -> {"count": n, "max_model_len": m, "tokens": [ids], "token_strs": [str] | null}
    POST /detokenize  {"tokens": [ids]} -> {"prompt": str}
    GET  /version     -> {"version": str}

The chat form renders the messages through the model's chat template (the messages read as the chat endpoint
reads them: ``xpyd.api.openai.parse_request``) and encodes the text with special tokens only if asked, as
vLLM does, with the chat endpoint's template arguments (``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs``, ``documents``, ``tools``, ``chat_template``). Fields that would change the tokens and
are not implemented here (multimodal kwargs) are a 400 that names them; other
unknown fields are ignored, as vLLM ignores them. A tokenizer here is anything offering transformers' names:
``encode(text, add_special_tokens=)``, ``apply_chat_template(messages, tokenize=False, **template arguments)``,
``decode(ids)``, ``len(tok)`` and ``backend_tokenizer.id_to_token``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from xpyd.api.chat_request import ChatTemplateArgs
from xpyd.api.fields import optional_bool as _optional_bool
from xpyd.api.openai import APIError, RequestKind, parse_request

# Fields of vLLM's TokenizeChatRequest that change the tokens and that this server does not implement yet,
# with the values that mean "off".
_CHAT_OFF: dict[str, tuple[Any, ...]] = {
    "media_io_kwargs": ({},),
    "mm_processor_kwargs": ({},),
}


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    model: str | None
    prompt: str | None  # the completion form
    messages: list[dict] | None  # the chat form, as the chat endpoint reads them
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool
    chat: ChatTemplateArgs = ChatTemplateArgs()  # the chat form's template arguments


@dataclass(frozen=True, slots=True)
class DetokenizeRequest:
    model: str | None
    tokens: list[int]


def _load(body: bytes) -> dict:
    try:
        d = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise _bad(f"request body is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise _bad("request body must be a JSON object")
    model = d.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    return d


def parse_tokenize(body: bytes, trusted_templates: bool = False) -> TokenizeRequest:
    """A ``/tokenize`` body, completion form (``prompt``) or chat form (``messages``); APIError(400) if bad."""
    d = _load(body)
    chat = "messages" in d
    if chat == ("prompt" in d):
        raise _bad("give either 'prompt' (a string) or 'messages' (a chat), not both or neither",
                   "messages" if chat else "prompt")
    strs = _optional_bool(d, "return_token_strs", False)
    if not chat:
        prompt = d["prompt"]
        if not isinstance(prompt, str):
            raise _bad("'prompt' must be a string", "prompt")
        return TokenizeRequest(d.get("model"), prompt, None, _optional_bool(d, "add_special_tokens", True), False, strs)
    for key, off in _CHAT_OFF.items():
        v = d.get(key)
        if v is not None and not any(type(v) is type(o) and v == o for o in off):
            raise _bad(f"'{key}' is not supported by /tokenize on this server (got {v!r})", key)
    # the messages and template arguments exactly as /v1/chat/completions reads them: both tokenize them alike
    fields = ("messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "documents",
              "tools", "chat_template")
    chat = parse_request(json.dumps({k: d[k] for k in fields if k in d}).encode(), RequestKind.CHAT,
                         trusted_templates)
    return TokenizeRequest(d.get("model"), None, chat.messages, _optional_bool(d, "add_special_tokens", False),
                           chat.chat.add_generation_prompt, strs, chat.chat)


def parse_detokenize(body: bytes) -> DetokenizeRequest:
    d = _load(body)
    tokens = d.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                               for t in tokens):
        raise _bad("'tokens' must be a list of non-negative integers", "tokens")
    return DetokenizeRequest(d.get("model"), tokens)


def check_model(model: str | None, served: str) -> None:
    if model is not None and model != served:
        raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model",
                       code="model_not_found")


def tokenize(tok: Any, req: TokenizeRequest, max_model_len: int) -> dict:
    """The ``/tokenize`` answer (run it off the event loop: a long prompt takes milliseconds)."""
    if req.messages is not None:
        if not getattr(tok, "chat_template", None) and req.chat.template is None:
            raise _bad("this model's tokenizer has no chat template; tokenize a 'prompt' instead", "messages")
        try:
            text = tok.apply_chat_template(req.messages, tokenize=False, **req.chat.as_kwargs())
        except Exception as e:  # a template's raise_exception, or what it trips on
            raise _bad(f"chat template failed on these messages: {e}", "messages") from None
    else:
        text = req.prompt
    ids = list(tok.encode(text, add_special_tokens=req.add_special_tokens))
    strs = [tok.backend_tokenizer.id_to_token(i) for i in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(tok: Any, req: DetokenizeRequest) -> dict:
    vocab = len(tok)
    bad = next((t for t in req.tokens if t >= vocab), None)
    if bad is not None:
        raise _bad(f"token id {bad} is not in the vocabulary [0, {vocab})", "tokens")
    return {"prompt": tok.decode(req.tokens)}


def version_response(version: str) -> dict:
    return {"version": version}
