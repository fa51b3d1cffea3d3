"""Turn generated token ids into streamed text: incremental detokenization, stop strings, stop token ids,
finish reasons and the ``stop_reason`` (vLLM's: the stop string or stop token id that ended the output; None
for an end-of-sequence token, a length cap, or an output still going).

Detokenization follows vLLM's prefix/read offsets: each step decodes only a short window
`ids[prefix_offset:]` and emits what it adds over `ids[prefix_offset:read_offset]`, so the cost per
token does not grow with the output. Text is held back while it ends in an incomplete UTF-8 sequence
(U+FFFD) or while its tail could be the start of a stop string; everything is flushed on finish.

As vLLM: the token that ended the output (EOS, or one of ``stop_token_ids``) and a matched stop string are
left out of the text unless ``include_stop_str_in_output``; no stop string is matched that ends within the
text of the first ``min_tokens`` tokens; ``skip_special_tokens`` and ``spaces_between_special_tokens`` are the
tokenizer's decode options (the latter: with special tokens shown, an added token that follows another added
token is written as it is, with no space the decoder would put before it).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

_REPLACEMENT = "\ufffd"


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"


def _ints(name: str, ids) -> frozenset[int]:
    if isinstance(ids, (str, bytes)) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                for t in ids):
        raise ValueError(f"{name} must be token ids (ints >= 0), got {ids!r}")
    return frozenset(ids)


@dataclass(frozen=True, slots=True)
class StopParams:
    max_tokens: int
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # no stop string is matched within the text of this many first tokens
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a sequence of non-empty strings, got {self.stop!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "eos_token_ids", _ints("eos_token_ids", self.eos_token_ids))
        object.__setattr__(self, "stop_token_ids", _ints("stop_token_ids", self.stop_token_ids))


class OutputProcessor:
    def __init__(self, tokenizer, params: StopParams) -> None:
        self._tok = tokenizer
        self._params = params
        self._max_stop = max((len(s) for s in params.stop), default=0)
        self.token_ids: list[int] = []  # every generated id, eos included (it counts as a completion token)
        self.finished: FinishReason | None = None
        self.stop_reason: str | int | None = None  # the stop string or stop token id that ended it
        self.text = ""  # emitted so far
        self._ids: list[int] = []  # ids that carry text (the eos that ends the request is left out)
        self._prefix_offset = 0
        self._read_offset = 0
        self._committed = ""  # decoded text of self._ids[:read_offset]: complete characters only
        self._pending = ""  # decoded text after read_offset that still ends in an incomplete character
        self._stop_checked = 0  # no stop string starts before this index of the committed text
        self._stop_floor = 0  # a stop string must end after this index (the first min_tokens tokens' text)
        self._added: dict[int, str] | None = None  # added tokens' strings (spaces_between_special_tokens off)
        if not params.skip_special_tokens and not params.spaces_between_special_tokens:
            self._added = _added_tokens(tokenizer)

    def append(self, token_id: int) -> tuple[str, FinishReason | None]:
        """Add one generated token; return (text that may be emitted now, finish reason or None)."""
        if self.finished is not None:
            raise RuntimeError("append after the output finished")
        p = self._params
        self.token_ids.append(token_id)
        eos = token_id in p.eos_token_ids and not p.ignore_eos
        if eos or token_id in p.stop_token_ids:
            self.stop_reason = None if eos else token_id
            if p.include_stop_str_in_output:
                self._ids.append(token_id)
                self._detokenize()
            return self._finish(FinishReason.STOP)
        self._ids.append(token_id)
        self._detokenize()
        if len(self.token_ids) <= p.min_tokens:
            self._stop_floor = self._stop_checked = len(self._committed) + len(self._pending)
        else:
            end = self._find_stop(self._committed)
            if end is not None:
                return self._emit_until(self._committed, end, FinishReason.STOP)
        if len(self.token_ids) >= p.max_tokens:
            return self._finish(FinishReason.LENGTH)
        safe = len(self._committed) - self._stop_prefix_len(self._committed)
        return self._emit_until(self._committed, safe, None)

    def end_without_output(self) -> tuple[str, FinishReason]:
        """End an output that has no token (max_tokens 0: the prompt alone): no text, finish reason length."""
        if self.finished is not None or self.token_ids:
            raise RuntimeError("end_without_output after the output started")
        self.finished = FinishReason.LENGTH
        return "", FinishReason.LENGTH

    def _decode(self, ids: list[int]) -> str:
        skip = self._params.skip_special_tokens
        added = self._added
        if added is None or not ids:
            return self._tok.decode(ids, skip_special_tokens=skip)
        # An added token right after another is written as it is (no space the decoder would put before it).
        parts, run, last_added = [], [], False
        for t in ids:
            is_added = t in added
            if is_added and last_added:
                if run:
                    parts.append(self._tok.decode(run, skip_special_tokens=skip))
                    run = []
                parts.append(added[t])
            else:
                run.append(t)
            last_added = is_added
        if run:
            parts.append(self._tok.decode(run, skip_special_tokens=skip))
        return "".join(parts)

    def _detokenize(self) -> None:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            # Nothing new yet (e.g. a special token) or an incomplete UTF-8 tail: wait for more tokens.
            self._pending = new_text[len(prefix_text) :]
            return
        self._committed += new_text[len(prefix_text) :]
        self._pending = ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)

    def _find_stop(self, text: str) -> int | None:
        """Where the output ends at the earliest stop string in `text`, if any (its start, or its end with
        ``include_stop_str_in_output``); sets ``stop_reason`` to it."""
        if not self._max_stop:
            return None
        start = max(0, self._stop_checked - self._max_stop + 1)
        floor = self._stop_floor
        found = [(i, s) for s in self._params.stop if (i := text.find(s, max(start, floor - len(s) + 1))) >= 0]
        self._stop_checked = len(text)
        if not found:
            return None
        i, s = min(found, key=lambda f: f[0])
        self.stop_reason = s
        return i + len(s) if self._params.include_stop_str_in_output else i

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that could begin a stop string."""
        for n in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._params.stop):
                return n
        return 0

    def _finish(self, reason: FinishReason) -> tuple[str, FinishReason]:
        """Flush everything held back, including an incomplete character (as decode() would show it)."""
        text = self._committed + self._pending
        if len(self.token_ids) > self._params.min_tokens:
            stop_reason = self.stop_reason
            end = self._find_stop(text)
            if end is not None:
                return self._emit_until(text, end, FinishReason.STOP)
            self.stop_reason = stop_reason
        return self._emit_until(text, len(text), reason)

    def _emit_until(self, text: str, end: int, reason: FinishReason | None) -> tuple[str, FinishReason | None]:
        delta = text[len(self.text) : end] if end > len(self.text) else ""
        self.text += delta
        self.finished = reason
        return delta, reason


def _added_tokens(tokenizer) -> dict[int, str]:
    """The tokenizer's added tokens (id -> string), from its tokenizers backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return {}
    return {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
