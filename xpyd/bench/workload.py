"""What the benchmark sends: request specs and their arrival times.

Prompts of an exact token length come from a ``PromptBuilder``: with the served model's tokenizer
(``TokenizerPromptBuilder``, exact) or from a fixed list of common English words that are one token
each in the usual BPE vocabularies (``WordPromptBuilder``, about one token per word). Every prompt is
drawn from a seeded ``random.Random``, so a run is reproducible and prompts do not share prefixes,
except in the shared-prefix workload (``shared_prefix_requests``), where that is the point.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

# Common words, each a single token after a space in GPT-2 / Llama-3 / SmolLM vocabularies.
WORDS: tuple[str, ...] = tuple("""
the of and to in is that for it as was with be by on not he this are or his from at which but have
an had they you were their one all we can her has there been if more when will would who so no time
people year way day man world life hand part child eye woman place work week case point house number
group problem fact water room city story money night home school state family book word business side
kind head service friend power hour game line end member law car name page light air music form paper
river field ship tree road plan food sea table door bed cat dog girl boy king queen garden window horse
voice letter heart mind body color fire wind rain snow star moon sun green blue red black white small
large old new good great high long little young right left early late open best free full sure clear
""".split())

LABEL_ALL = "all"
LABEL_SHORT = "short"
LABEL_LONG = "long"


class WorkloadError(ValueError):
    """A workload that cannot be built (bad prompt file, impossible length): the message says why."""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send. Exactly one of ``prompt`` / ``messages`` is set; a prompt is text or
    token ids (the completions API takes either)."""

    max_tokens: int
    prompt: str | tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None
    input_len: int | None = None  # prompt tokens as built here (None: unknown, e.g. from a file)
    label: str = LABEL_ALL  # the request class the report groups by
    turn: int | None = None  # multi-turn: the 1-based turn of its conversation
    trace_line: int | None = None  # trace replay: the request's line in the trace file

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a request has exactly one of prompt or messages")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


class PromptBuilder(Protocol):
    """Builds prompt text of a token length. ``separator`` joins two built texts so that the result
    has (about, or with a tokenizer exactly) the sum of their lengths."""

    separator: str

    def build(self, num_tokens: int, rng: random.Random) -> str: ...


class WordPromptBuilder:
    """Random words from ``WORDS``: about one token per word, with no tokenizer at hand."""

    separator = " "

    def build(self, num_tokens: int, rng: random.Random) -> str:
        return " ".join(rng.choices(WORDS, k=num_tokens))


class TokenizerPromptBuilder:
    """Exact token counts with a Hugging Face tokenizer (``add_special_tokens=False``).

    A prompt is a run of vocabulary entries that are a space plus a lowercase word and encode back
    to themselves alone, so the concatenation encodes to one token each (BPE pre-tokenizers split on
    the spaces). The result is checked and, for tokenizers where that does not hold, trimmed or
    extended until it encodes to exactly the requested length.
    """

    _WORD = re.compile(r"^ [a-z]{2,12}$")
    _MAX_FIXES = 20
    separator = ""  # every built text starts with a space-led word

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self._pool = self._single_token_words()

    @classmethod
    def from_path(cls, path: str | Path) -> TokenizerPromptBuilder:
        from transformers import AutoTokenizer  # heavy: only when --tokenizer is given

        try:
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise WorkloadError(f"cannot load a tokenizer from {path}: {e}") from e
        return cls(tok)

    def token_ids(self) -> list[int]:
        """The ids of the words prompts are built from, each one token alone (trace replay sends
        prompts as ids, so they need not survive re-tokenization next to each other)."""
        ids = [e[0] for e in self._tok(self._pool, add_special_tokens=False)["input_ids"] if len(e) == 1]
        if len(ids) < 50:
            raise WorkloadError("this tokenizer has fewer than 50 single-token words to build prompts from")
        return ids

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def _single_token_words(self) -> list[str]:
        ids = list(range(len(self._tok)))
        texts = self._tok.batch_decode([[i] for i in ids])
        cands = [(i, t) for i, t in zip(ids, texts) if self._WORD.match(t)]
        if cands:
            enc = self._tok([t for _, t in cands], add_special_tokens=False)["input_ids"]
            pool = [t for (i, t), e in zip(cands, enc) if e == [i]]
        else:
            pool = []
        if len(pool) < 50:  # e.g. SentencePiece, whose lone tokens decode without their space
            pool = [" " + w for w in WORDS]
        return pool

    def build(self, num_tokens: int, rng: random.Random) -> str:
        text = "".join(rng.choices(self._pool, k=num_tokens))
        for _ in range(self._MAX_FIXES):
            ids = self._tok.encode(text, add_special_tokens=False)
            if len(ids) == num_tokens:
                return text
            if len(ids) > num_tokens:
                text = self._tok.decode(ids[:num_tokens])
            else:
                text += "".join(rng.choices(self._pool, k=num_tokens - len(ids)))
        raise WorkloadError(f"could not build a prompt of exactly {num_tokens} tokens with this tokenizer")


def shared_prefix_requests(builder: PromptBuilder, n: int, num_prefixes: int, prefix_len: int,
                           suffix_len: int, output_len: int, rng: random.Random,
                           chat: bool) -> list[RequestSpec]:
    """The shared-prefix workload (the shape of ``vllm bench serve --dataset-name prefix_repetition``).

    ``num_prefixes`` prefixes of ``prefix_len`` tokens are drawn first; request ``i`` takes prefix
    ``i % num_prefixes`` (round-robin: the first ``num_prefixes`` requests are a cold cache's misses,
    and each prefix serves n / num_prefixes requests, give or take one) followed by a suffix of
    ``suffix_len`` tokens that no other request has. Completions: one prompt, prefix then suffix;
    chat: the prefix is the system message and the suffix the user message."""
    if num_prefixes < 1 or prefix_len < 1 or suffix_len < 1:
        raise WorkloadError("shared-prefix needs --num-prefixes, --prefix-len and --input-len >= 1")
    prefixes = [builder.build(prefix_len, rng) for _ in range(num_prefixes)]
    suffixes = _distinct(builder, n, suffix_len, rng)
    out = []
    for i, suffix in enumerate(suffixes):
        prefix = prefixes[i % num_prefixes]
        if chat:
            messages = ({"role": "system", "content": prefix}, {"role": "user", "content": suffix})
            out.append(RequestSpec(messages=messages, max_tokens=output_len, input_len=prefix_len + suffix_len))
        else:
            out.append(RequestSpec(prompt=prefix + builder.separator + suffix, max_tokens=output_len,
                                   input_len=prefix_len + suffix_len))
    return out


def _distinct(builder: PromptBuilder, n: int, num_tokens: int, rng: random.Random) -> list[str]:
    """``n`` different texts: a repeated suffix would make a whole prompt a cache hit."""
    seen: set[str] = set()
    out = []
    while len(out) < n:
        for _ in range(100):
            text = builder.build(num_tokens, rng)
            if text not in seen:
                break
        else:
            raise WorkloadError(f"cannot draw {n} different suffixes of {num_tokens} tokens: raise --input-len")
        seen.add(text)
        out.append(text)
    return out


def parse_range(text: str) -> tuple[int, int]:
    """``"A:B"`` -> ``(A, B)`` with 1 <= A <= B (both ends included when sampling)."""
    parts = text.split(":")
    try:
        lo, hi = (int(p) for p in parts)
    except ValueError:
        raise WorkloadError(f"expected a range A:B of two integers, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise WorkloadError(f"range {text!r} needs 1 <= A <= B")
    return lo, hi


def iter_fixed(builder: PromptBuilder, input_len: int, output_len: int, rng: random.Random,
               label: str = LABEL_ALL) -> Iterator[RequestSpec]:
    """An endless stream of requests of one shape (take what you need with ``islice``)."""
    while True:
        yield RequestSpec(prompt=builder.build(input_len, rng), max_tokens=output_len,
                          input_len=input_len, label=label)


def fixed_requests(builder: PromptBuilder, n: int, input_len: int, output_len: int,
                   rng: random.Random, label: str = LABEL_ALL) -> list[RequestSpec]:
    it = iter_fixed(builder, input_len, output_len, rng, label)
    return [next(it) for _ in range(n)]


def random_requests(builder: PromptBuilder, n: int, input_range: tuple[int, int],
                    output_range: tuple[int, int], rng: random.Random) -> list[RequestSpec]:
    """Input and output lengths uniform over the inclusive ranges."""
    out = []
    for _ in range(n):
        il, ol = rng.randint(*input_range), rng.randint(*output_range)
        out.append(RequestSpec(prompt=builder.build(il, rng), max_tokens=ol, input_len=il))
    return out


def load_jsonl(path: str | Path, chat: bool, default_max_tokens: int) -> list[RequestSpec]:
    """Prompts from a file: one JSON object a line, ``{"prompt": str}`` or ``{"messages": [...]}``
    (chat endpoint only), with an optional positive integer ``max_tokens``. Blank lines are skipped."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise WorkloadError(f"cannot read prompts file {path}: {e.strerror or e}") from e
    specs = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{where}: invalid JSON: {e.msg}") from None
        specs.append(_spec_from_object(obj, where, chat, default_max_tokens))
    if not specs:
        raise WorkloadError(f"{path}: no prompts (expected one JSON object a line)")
    return specs


def _spec_from_object(obj: object, where: str, chat: bool, default_max_tokens: int) -> RequestSpec:
    if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
        raise WorkloadError(f"{where}: expected an object with exactly one of 'prompt' (a string) "
                            f"or 'messages' (a list)")
    max_tokens = obj.get("max_tokens", default_max_tokens)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise WorkloadError(f"{where}: 'max_tokens' must be a positive integer, got {max_tokens!r}")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise WorkloadError(f"{where}: 'prompt' must be a non-empty string")
        return RequestSpec(prompt=obj["prompt"], max_tokens=max_tokens)
    messages = obj["messages"]
    if not chat:
        raise WorkloadError(f"{where}: 'messages' needs --endpoint chat")
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
        raise WorkloadError(f"{where}: 'messages' must be a non-empty list of objects with a 'role'")
    return RequestSpec(messages=tuple(messages), max_tokens=max_tokens)


def cycle_to(specs: list[RequestSpec], n: int) -> list[RequestSpec]:
    """The first ``n`` of ``specs`` repeated in order (a short file is reused)."""
    return [specs[i % len(specs)] for i in range(n)]


def poisson_offsets(rate: float, n: int, seed: int) -> list[float]:
    """Send times (seconds from the start) of ``n`` Poisson arrivals at ``rate`` per second:
    exponential gaps drawn from ``random.Random(seed)``; the first request goes at 0."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def iter_poisson_gaps(rate: float, seed: int) -> Iterator[float]:
    """Endless exponential gaps (seconds) for an open-ended Poisson process."""
    rng = random.Random(seed)
    while True:
        yield rng.expovariate(rate)
