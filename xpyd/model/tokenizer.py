"""Tokenizer loading and prompt encoding, shared by both workers so they agree on token ids.

The functions take a transformers tokenizer or anything offering the same few names (``tok(text).input_ids``,
``apply_chat_template``, ``len(tok)``, ``chat_template``, ``backend_tokenizer``, the special tokens' strings):
the simulated engine's workers pass ``xpyd.tokenization``'s, and never import transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """The model's transformers tokenizer (imports transformers: the real engine's workers only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")



def describe_tokenizer(tok: PreTrainedTokenizerBase) -> dict:
    """What another process needs to tokenize exactly as ``encode_prompt`` / ``encode_chat`` do without
    transformers: the fast tokenizer's JSON, the chat template and the special tokens' strings."""
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one is what apply_chat_template uses
        template = template.get("default")
    special = {}
    for name in SPECIAL_TOKENS:
        value = getattr(tok, name, None)
        special[name] = value if isinstance(value, str) else None
    return {"tokenizer": tok.backend_tokenizer.to_str(), "chat_template": template, "special_tokens": special}


def encode_prompt(tok: PreTrainedTokenizerBase, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
    """A text prompt is tokenized as `generate` users would (`tok(prompt)`, special tokens on unless
    ``add_special_tokens`` is False); a list of token ids is used as is after checking every id is in the
    vocabulary."""
    if isinstance(prompt, str):
        ids = list(tok(prompt, add_special_tokens=add_special_tokens).input_ids)
    elif isinstance(prompt, list):
        vocab = len(tok)
        for i in prompt:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab:
                raise ValueError(f"prompt token id {i!r} is not in the vocabulary [0, {vocab})")
        ids = list(prompt)
    else:
        raise ValueError(f"prompt must be a string or a list of token ids, not {type(prompt).__name__}")
    if not ids:
        raise ValueError("prompt is empty")
    return ids


def encode_chat(tok: PreTrainedTokenizerBase, messages: list[dict], add_special_tokens: bool = False,
                template_args: dict | None = None) -> list[int]:
    """Chat messages -> prompt ids through the model's chat template; the rendered text is tokenized without
    special tokens (the template writes them) unless ``add_special_tokens`` (vLLM's chat field of that name).
    ``template_args``: apply_chat_template's (``ChatTemplateArgs.as_kwargs``: add_generation_prompt,
    continue_final_message, tools, documents, chat_template_kwargs); default: ending with the assistant turn."""
    args = dict(template_args) if template_args is not None else {"add_generation_prompt": True}
    if not getattr(tok, "chat_template", None) and not args.get("chat_template"):
        raise ValueError("this model's tokenizer has no chat template; use a text completion instead")
    normalized = [_check_message(i, m) for i, m in enumerate(_check_list(messages))]
    try:
        if add_special_tokens:
            text = tok.apply_chat_template(normalized, tokenize=False, **args)
            return list(tok(text, add_special_tokens=True).input_ids)
        encoded = tok.apply_chat_template(normalized, tokenize=True, return_dict=True, **args)
    except Exception as e:  # jinja2 TemplateError (raise_exception in templates), KeyError, TypeError
        raise ValueError(f"chat template failed on these messages: {e}") from e
    return list(encoded["input_ids"])


def _check_list(messages: Any) -> list:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    return messages


def _check_message(index: int, message: Any) -> dict:
    if not isinstance(message, dict):
        raise ValueError(f"messages[{index}] must be an object, not {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"messages[{index}].role must be a non-empty string")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: only text parts are supported
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{index}].content parts must be {{'type': 'text', 'text': str}}")
            texts.append(part["text"])
        content = "".join(texts)
    elif not isinstance(content, str):
        raise ValueError(f"messages[{index}].content must be a string or a list of text parts")
    return {**message, "role": role, "content": content}
