"""`LightTokenizer`: a model's tokenizer without transformers, token for token what transformers gives.

Built from a model folder (``from_folder``: tokenizer.json, the chat template of chat_template.jinja or
tokenizer_config.json, the special tokens of tokenizer_config.json and special_tokens_map.json) or from what a
worker describes (``from_parts``: ``GET /xpyd/tokenizer``). What the worker uses of a transformers tokenizer
it offers under the same names, so ``xpyd.model.tokenizer`` and ``xpyd.model.output`` take either:
``tok(text).input_ids`` (special tokens added), ``apply_chat_template`` (rendered, then encoded without special
tokens), ``decode``, ``len(tok)`` (vocabulary with added tokens), ``chat_template``, ``backend_tokenizer`` and
the special tokens' strings (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``).

What transformers does to tokenizer.json when it loads a folder, done here too: no truncation or padding;
named special tokens missing from the vocabulary added; ``clean_up_tokenization_spaces`` on decode (not for
BPE models, as transformers). tokenizer.json's post-processor is kept as it is (transformers 5 does not
rebuild it from ``add_bos_token``). A model whose tokenizer class rewrites the pipeline in Python is not
covered.
"""

from __future__ import annotations

import functools

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from tokenizers import AddedToken, Tokenizer

from xpyd.tokenization.chat import compile_template, render

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Encoded(NamedTuple):
    input_ids: list[int]


class LightTokenizer:
    """A tokenizers ``Tokenizer`` with its chat template and special tokens (see the module docstring)."""

    def __init__(self, backend: Tokenizer, chat_template: str | None, special_tokens: Mapping[str, str],
                 clean_up_spaces: bool = False) -> None:
        # transformers encodes without truncation or padding unless asked; tokenizer.json may carry either.
        backend.no_truncation()
        backend.no_padding()
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in special_tokens.items() if isinstance(v, str)}
        self._template = compile_template(chat_template) if chat_template is not None else None
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._clean_up = clean_up_spaces and type(backend.model).__name__ != "BPE"

    @classmethod
    def from_parts(cls, tokenizer_json: str, chat_template: str | None,
                   special_tokens: Mapping[str, str]) -> LightTokenizer:
        """From a tokenizer.json's text as a worker serves it (transformers' changes already in it)."""
        try:
            backend = Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # tokenizers raises plain Exception on a bad tokenizer.json
            raise ValueError(f"tokenizer.json: {e}") from None
        return cls(backend, chat_template, special_tokens)

    @classmethod
    def from_folder(cls, folder: Path) -> LightTokenizer:
        """From a Hugging Face model folder's tokenizer files (ValueError without a tokenizer.json)."""
        folder = Path(folder)
        config = _read_json(folder / "tokenizer_config.json")
        try:
            backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:
            raise ValueError(f"{folder}: no usable tokenizer.json ({e}); the simulated engine needs a fast "
                             "tokenizer's tokenizer.json") from None
        special = {k: v for k, v in _special_tokens(config).items() if v is not None}
        for name, value in _special_tokens(_read_json(folder / "special_tokens_map.json")).items():
            if value is not None and config.get(name) is None:
                special.setdefault(name, value)
        missing = [s for s in special.values() if backend.token_to_id(s) is None]
        if missing:
            backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in missing])
        return cls(backend, _chat_template(folder, config), special,
                   clean_up_spaces=bool(config.get("clean_up_tokenization_spaces", False)))

    # --- what the worker uses of a transformers tokenizer ------------------------------------------
    def __len__(self) -> int:
        return self._vocab_size

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoded:
        return Encoded(self.encode(text, add_special_tokens))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: only the batch call lets go of the GIL while it works, so a long
        # prompt tokenized in a thread does not stop an event loop (measured: 85 ms vs 5 ms for 32k tokens).
        return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self._clean_up else text

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = False, **template_args: Any) -> Any:
        text = self.render_chat(messages, add_generation_prompt, **template_args)
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids} if return_dict else ids

    def set_chat_template(self, source: str) -> None:
        """Use ``source`` as the chat template (``--chat-template``)."""
        self._template = compile_template(source)
        self.chat_template = source

    def render_chat(self, messages: list, add_generation_prompt: bool = True, **template_args: Any) -> str:
        """``messages`` through the chat template (ValueError without one, or when the template fails);
        ``template_args``: continue_final_message, tools, documents and more variables (``chat.render``)."""
        source = template_args.pop("chat_template", None)  # (a request's own template)
        template = _compiled(source) if source is not None else self._template
        if template is None:
            raise ValueError("this model's tokenizer has no chat template")
        return render(template, messages, self.special_tokens, add_generation_prompt, **template_args)

    # The special tokens' strings (None when the model has none), as transformers names them.
    bos_token = property(lambda self: self.special_tokens.get("bos_token"))
    eos_token = property(lambda self: self.special_tokens.get("eos_token"))
    unk_token = property(lambda self: self.special_tokens.get("unk_token"))
    pad_token = property(lambda self: self.special_tokens.get("pad_token"))


@functools.lru_cache(maxsize=64)
def _compiled(source: str):
    """A request's own chat template, compiled once (the same template comes with many requests)."""
    return compile_template(source)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _special_tokens(config: dict) -> dict[str, str | None]:
    """bos_token ... as strings; a serialized AddedToken ({"content": ...}) gives its content."""
    out: dict[str, str | None] = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        out[name] = value if isinstance(value, str) else None
    return out


def _chat_template(folder: Path, config: dict) -> str | None:
    """The default chat template: chat_template.jinja, else tokenizer_config.json's (a string, or the one
    named "default" of a list)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text
