"""Structured output: a request's grammar as a mask of the tokens it allows next (torch-free).

A request asks for its output to follow a `GrammarSpec`: any JSON object (OpenAI's ``response_format``
json_object), a JSON schema (json_schema, vLLM's ``guided_json``), a regular expression (``guided_regex``, Rust
``regex`` syntax: no look-around, no back-references), one of a list of strings (``guided_choice``) or a
context-free grammar in Lark or llama.cpp's GBNF (``guided_grammar``). Each worker has one `Grammars` (the
tokenizer's view for the engine, built once, and an LRU cache of compiled grammars); each request has one
`Matcher`. Every step the sampler asks ``matcher.allowed()`` for a mask, sets the logits of the tokens it does not
allow to -inf (`xpyd.model.grammar_torch.apply_mask` on a torch row; `mask_allows` for the simulated engine's
candidates), samples, and calls ``matcher.accept(token)``.

On P/D the prefill worker masks and samples token 1; the decode worker makes its own matcher from the same spec
and ``accept``s token 1 before masking token 2 on. A False there means the two workers disagree (another
engine version or tokenizer): the request fails rather than goes on unconstrained.

The engine is llguidance (measured against xgrammar and outlines-core in scripts/bench_grammar.py, results in
docs/benchmarks.md): it imports no torch, compiles every spec kind in about a millisecond, and fills a mask
and accepts a token in ~2.5 us (p50) on SmolLM2's 49,152-token vocabulary.

A mask is ``bytes``: ceil(vocab_size / 32) little-endian int32 words (llguidance's, xgrammar's and vLLM's packed
layout), token t allowed iff ``mask[t >> 3] >> (t & 7) & 1`` (every host xpyd runs on is little-endian).

Vocabulary sizes: ``vocab_size`` is the model's logits row, which may be padded past the tokenizer (SmolLM2: both
49,152; many models round the lm_head up). The mask always has exactly vocab_size bits; ids with no token
(len(tokenizer) <= id < vocab_size) have no text, so no grammar allows them: padded logits are masked off. A
tokenizer larger than the logits row has its extra ids cleared from every mask (the model cannot produce them).

End of sequence: the end-of-sequence ids are allowed exactly when the output so far is complete under the
grammar (``\\d+`` after "12" allows more digits and EOS; an incomplete JSON object never allows EOS); when the
grammar admits nothing more (`Matcher.is_terminated`, e.g. after a JSON object's closing brace) only EOS is
allowed. A sampler must therefore not forbid EOS on its own while a grammar is terminated (``min_tokens``): the
row would have no token left.
"""

from __future__ import annotations

import copy
import ctypes
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance

__all__ = ["KINDS", "CompiledGrammar", "GrammarError", "GrammarSpec", "Grammars", "Matcher", "mask_allows",
           "mask_tokens"]

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
_ANY_OBJECT = '{"type": "object"}'


class GrammarError(ValueError):
    """A spec the engine cannot compile (the message starts with its kind), or a matcher the engine put in an error
    state (a grammar past llguidance's parser limits mid-output)."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a request's output must follow; plain strings (hashable: the cache key; wire-safe).

    kind: one of KINDS. value: "" for json_object; the schema as JSON text; the regex; the choices as a JSON list
    of strings; the grammar text (Lark, or GBNF with a ``root ::=`` rule)."""

    kind: str
    value: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if not isinstance(self.value, str):
            raise GrammarError(f"{self.kind}: the value must be a string, not {type(self.value).__name__}")
        if self.kind == "json_object" and self.value:
            raise GrammarError("json_object: takes no value (any JSON object)")


def _grammar_text(spec: GrammarSpec) -> str:
    """The spec as llguidance's grammar, with the spec's own mistakes as GrammarErrors."""
    kind, value = spec.kind, spec.value
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT)
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except ValueError as e:
            raise GrammarError(f"json_schema: not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"json_schema: a schema is a JSON object, not {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(value)
    if kind == "regex":
        if not value:
            raise GrammarError("regex: empty")
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        try:
            choices = json.loads(value)
        except ValueError as e:
            raise GrammarError(f"choice: not a JSON list: {e}") from None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("choice: expected a non-empty JSON list of non-empty strings")
        return llguidance.grammar_from("choice", value)
    if not value.strip():
        raise GrammarError("grammar: empty")
    try:
        return llguidance.grammar_from("grammar", value)  # Lark as is; GBNF converted to Lark
    except ValueError as e:
        raise GrammarError(f"grammar: {e}") from None


@dataclass(frozen=True, slots=True)
class _Vocab:
    size: int  # the logits row
    eos: frozenset[int]
    nbytes: int  # of llguidance's mask (its vocabulary: the larger of the tokenizer and the logits row)
    cut: int  # > 0: the tokenizer is larger than the logits row; masks are cut to this many bytes


class CompiledGrammar:
    """A spec compiled against one worker's tokenizer: a pristine matcher that each request's matcher copies."""

    __slots__ = ("spec", "_template", "_vocab")

    def __init__(self, spec: GrammarSpec, template: llguidance.LLMatcher, vocab: _Vocab) -> None:
        self.spec = spec
        self._template = template
        self._vocab = vocab

    def matcher(self) -> Matcher:
        return Matcher(self._template.deep_copy(), self._vocab)


class Grammars:
    """One per worker: the tokenizer's info (built once) and a bounded LRU cache of compiled grammars.

    ``tokenizer``: a transformers tokenizer or `xpyd.tokenization`'s (anything with ``backend_tokenizer``, a
    ``tokenizers.Tokenizer``); ``vocab_size``: the model's logits row (config.vocab_size); ``eos_token_ids``: the
    ids that end a sequence (the tokenizer's EOS and the generation config's). Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int], cache_size: int = 256) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        eos = sorted(eos_token_ids)
        if not eos or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in eos):
            raise ValueError(f"eos_token_ids must be a non-empty set of ids in [0, {vocab_size}), "
                             f"got {eos_token_ids!r}")
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
            raise ValueError(f"cache_size must be an int >= 1, got {cache_size!r}")
        backend = copy.copy(tokenizer.backend_tokenizer)  # as llguidance.hf: the JSON without padding/truncation
        backend.no_padding()
        backend.no_truncation()
        tokens = backend.get_vocab_size(with_added_tokens=True)
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos)
        words = max(vocab_size, tokens)
        self._tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=words, eos_token=eos)
        # a tokenizer larger than the logits row: masks are cut to vocab_size bits (see the module docstring)
        cut = (vocab_size + 31) // 32 * 4 if tokens > vocab_size else 0
        self._vocab = _Vocab(vocab_size, self.eos_token_ids, (words + 31) // 32 * 4, cut)
        self._cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The spec compiled (cached by spec, least recently used dropped past cache_size); GrammarError if the
        engine cannot compile it. Errors are not cached."""
        if not isinstance(spec, GrammarSpec):
            raise TypeError(f"compile takes a GrammarSpec, not {type(spec).__name__}")
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        try:
            text = _grammar_text(spec)
        except GrammarError:
            raise
        except ValueError as e:  # llguidance's own checks
            raise GrammarError(f"{spec.kind}: {e}") from None
        template = llguidance.LLMatcher(self._tokenizer, text, log_level=0)  # drops the GIL while it compiles
        if template.is_error():
            raise GrammarError(f"{spec.kind}: {template.get_error()}")
        compiled = CompiledGrammar(spec, template, self._vocab)
        with self._lock:
            compiled = self._cache.setdefault(spec, compiled)  # another thread may have compiled it meanwhile
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: GrammarSpec) -> Matcher:
        """A fresh matcher for one request (GrammarError if the spec does not compile)."""
        return self.compile(spec).matcher()


class Matcher:
    """One request's grammar state (one thread at a time)."""

    __slots__ = ("_m", "_vocab", "_buf", "_view", "_ptr")

    def __init__(self, m: llguidance.LLMatcher, vocab: _Vocab) -> None:
        self._m = m
        self._vocab = vocab
        # the mask is computed into this buffer (0.8 us; llguidance's compute_bitmask, which returns new bytes,
        # takes 4 us) and copied out; the ctypes view pins the buffer, so its address stays valid
        self._buf = bytearray(vocab.nbytes)
        self._view = (ctypes.c_char * vocab.nbytes).from_buffer(self._buf)
        self._ptr = ctypes.addressof(self._view)

    def allowed(self) -> bytes:
        """The tokens allowed next, as a mask (the module docstring's layout). GrammarError if the engine gave
        up (a parser limit), so that the request fails instead of sampling from no token."""
        self._m.unsafe_compute_mask_ptr(self._ptr, self._vocab.nbytes)
        mask = bytes(self._buf)
        if self._m.is_error():
            raise GrammarError(f"grammar matcher failed: {self._m.get_error()}")
        if self._vocab.cut:
            mask = _cut(mask, self._vocab.cut, self._vocab.size)
        return mask

    def accept(self, token: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it."""
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self._vocab.size:
            return False
        if token in self._vocab.eos and self.is_terminated():  # llguidance's try/validate refuse EOS once stopped
            return self._m.consume_token(token)
        return self._m.try_consume_tokens([token]) == 1

    def is_terminated(self) -> bool:
        """The grammar is complete and admits nothing more: only EOS may follow (or EOS was accepted)."""
        return self._m.is_stopped() and not self._m.is_error()

    def fork(self) -> Matcher:
        """An independent copy in the same state (for n > 1)."""
        return Matcher(self._m.deep_copy(), self._vocab)


def _cut(mask: bytes, nbytes: int, vocab_size: int) -> bytes:
    out = bytearray(mask[:nbytes])
    for t in range(vocab_size, nbytes * 8):
        out[t >> 3] &= ~(1 << (t & 7)) & 0xFF
    return bytes(out)


def mask_allows(mask: bytes, token: int) -> bool:
    """Whether ``mask`` allows ``token`` (False past its end)."""
    return 0 <= token < len(mask) * 8 and (mask[token >> 3] >> (token & 7)) & 1 == 1


_BITS = tuple(tuple(i for i in range(8) if b >> i & 1) for b in range(256))


def mask_tokens(mask: bytes) -> list[int]:
    """Every id ``mask`` allows, increasing (the simulated engine's pick when none of its candidates is allowed;
    ~2 ms for a mask allowing most of a 49k vocabulary, far less for the few ids of a constrained step)."""
    out: list[int] = []
    for i, byte in enumerate(mask):
        if byte:
            base = i << 3
            out.extend(base + j for j in _BITS[byte])
    return out
