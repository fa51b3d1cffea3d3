"""A request's prompt as the workers will see it: token ids, then the hashes that name its KV blocks.

The proxy tokenizes with the workers' own tokenizer, fetched from one of them (``GET /xpyd/tokenizer``,
read by ``xpyd.proxy.cache_feed``), without transformers (``xpyd.tokenization``, as simulated workers do)::

    completion: text   -> tokenizer.json's pipeline, special tokens added   (the worker: ``tok(prompt)``)
                ids    -> as they are
    chat:       messages -> the chat template, rendered as transformers renders it (sandboxed Jinja,
                trim_blocks + lstrip_blocks, its ``tojson``, ``raise_exception`` and ``strftime_now``,
                the special-token strings, ``tools``/``documents`` None, ``add_generation_prompt``)
                -> tokenizer.json's pipeline WITHOUT special tokens        (``apply_chat_template``)
    ids -> ``prefix_hash.block_hashes(ids, block_size, salted_seed(hash_seed, cache_salt, key), key)``: the
           names a worker gives the blocks (``key``: the deployment's block-hash key, which the proxy
           derives from its cluster token as the workers do; it is never sent)

Messages are those ``parse_request`` leaves (role, content, optional name), as the worker parses the
same body. Tokenizing costs CPU (~1.3 ms per 1,000 tokens, as on the worker): callers run
``PromptTokenizer.keys`` in a thread, and the tokenizer lets go of the GIL meanwhile. Every way a prompt
cannot be tokenized is a ValueError; the worker will answer the client about it, the proxy routes
that request without knowing its blocks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from xpyd.api.openai import CompletionRequest, RequestKind
from xpyd.prefix_hash import block_hashes, salted_seed
from xpyd.proxy.prefix_index import PromptKeys
from xpyd.tokenization.tokenizer import LightTokenizer

MAX_BLOCK_SIZE = 1 << 16
_HASH_LIMIT = 2**64


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """A worker's ``GET /xpyd/tokenizer``: how it turns a request into token ids and names their blocks."""

    tokenizer_json: str  # the HF fast tokenizer's backend, serialized (tokenizer.json)
    chat_template: str | None
    special_tokens: Mapping[str, str]  # e.g. bos_token -> "<s>"; tokens the worker has none of are left out
    block_size: int
    hash_seed: int

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer_json, str) or not self.tokenizer_json:
            raise ValueError("tokenizer: expected the tokenizer.json text")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ValueError("chat_template: expected a string or null")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.special_tokens.items()):
            raise ValueError("special_tokens: expected names mapped to strings")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size: expected an int in 1..{MAX_BLOCK_SIZE}, got {self.block_size!r}")
        if isinstance(self.hash_seed, bool) or not isinstance(self.hash_seed, int) \
                or not 0 <= self.hash_seed < _HASH_LIMIT:
            raise ValueError(f"hash_seed: expected an int in [0, 2**64), got {self.hash_seed!r}")

    @classmethod
    def from_json(cls, body: bytes | str) -> TokenizerSpec:
        try:
            d = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"not JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError("expected a JSON object")
        special = d.get("special_tokens") or {}
        if not isinstance(special, dict):
            raise ValueError("special_tokens: expected an object")
        try:
            return cls(d["tokenizer"], d.get("chat_template"),
                       {k: v for k, v in special.items() if v is not None}, d["block_size"], d["hash_seed"])
        except KeyError as e:
            raise ValueError(f"missing {e}") from None

    def digest(self) -> str:
        """Equal for specs that tokenize and name blocks the same way."""
        h = hashlib.sha256()
        for part in (self.tokenizer_json, self.chat_template or "", json.dumps(sorted(self.special_tokens.items())),
                     str(self.block_size), str(self.hash_seed)):
            data = part.encode()
            h.update(len(data).to_bytes(8, "little") + data)
        return h.hexdigest()


class PromptTokenizer:
    """The workers' tokenizer and chat template, rebuilt from a ``TokenizerSpec`` (build it in a thread:
    parsing a tokenizer.json takes ~0.1 s); ``key``: the deployment's block-hash key (``prefix_hash.hash_key``)."""

    def __init__(self, spec: TokenizerSpec, key: bytes = b"") -> None:
        self.spec = spec
        self.key = key
        self.digest = spec.digest()
        self._tokenizer = LightTokenizer.from_parts(spec.tokenizer_json, spec.chat_template, spec.special_tokens)
        self._vocab_size = len(self._tokenizer)

    @property
    def tokenizer(self) -> LightTokenizer:
        """The tokenizer itself (the proxy's ``/tokenize``: ``xpyd.proxy.vllm_routes``)."""
        return self._tokenizer

    def keys(self, req: CompletionRequest) -> PromptKeys:
        ids = self.token_ids(req)
        spec = self.spec
        root = salted_seed(spec.hash_seed, req.cache_salt, self.key)  # (the request's cache_salt starts its chain)
        return PromptKeys(len(ids), spec.block_size, tuple(block_hashes(ids, spec.block_size, root, key=self.key)))

    def token_ids(self, req: CompletionRequest) -> list[int]:
        if req.kind is RequestKind.CHAT:
            return self.encode_chat(req.messages or [], req.chat.as_kwargs(), bool(req.add_special_tokens))
        return self.encode_prompt(req.prompt if req.prompt is not None else "")

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self._encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, list):
            if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self._vocab_size
                       for i in prompt):
                raise ValueError(f"a prompt token id is not in the vocabulary [0, {self._vocab_size})")
            ids = list(prompt)
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, not {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty")
        return ids

    def encode_chat(self, messages: list[dict], template_args: dict | None = None,
                    add_special_tokens: bool = False) -> list[int]:
        return self._encode(self.render_chat(messages, template_args), add_special_tokens=add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)  # (lets go of the GIL)

    def render_chat(self, messages: list[dict], template_args: dict | None = None) -> str:
        args = dict(template_args) if template_args is not None else {"add_generation_prompt": True}
        if self._tokenizer.chat_template is None and not args.get("chat_template"):
            raise ValueError("this model's tokenizer has no chat template")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        return self._tokenizer.render_chat([_message(i, m) for i, m in enumerate(messages)], **args)


def _message(index: int, message: Any) -> dict:
    """One message as the worker hands it to the template: text parts joined, keys that are None left out."""
    if not isinstance(message, dict):
        raise ValueError(f"messages[{index}] must be an object")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise ValueError(f"messages[{index}].role must be a non-empty string")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ValueError(f"messages[{index}].content parts must be text parts")
        content = "".join(p["text"] for p in content)
    elif not isinstance(content, str):
        raise ValueError(f"messages[{index}].content must be a string or a list of text parts")
    return {k: v for k, v in {**message, "content": content}.items() if v is not None}
