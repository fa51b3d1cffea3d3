"""Turn generated token ids into streamed text: incremental detokenization, stop strings, finish reasons.

Detokenization follows vLLM's prefix/read offsets: each step decodes only a short window
`ids[prefix_offset:]` and emits what it adds over `ids[prefix_offset:read_offset]`, so the cost per
token does not grow with the output. Text is held back while it ends in an incomplete UTF-8 sequence
(U+FFFD) or while its tail could be the start of a stop string; everything is flushed on finish.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

_REPLACEMENT = "\ufffd"


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"


@dataclass(frozen=True, slots=True)
class StopParams:
    max_tokens: int
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    eos_token_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a sequence of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "eos_token_ids", frozenset(self.eos_token_ids))


class OutputProcessor:
    def __init__(self, tokenizer, params: StopParams) -> None:
        self._tok = tokenizer
        self._params = params
        self._max_stop = max((len(s) for s in params.stop), default=0)
        self.token_ids: list[int] = []  # every generated id, eos included (it counts as a completion token)
        self.finished: FinishReason | None = None
        self.text = ""  # emitted so far
        self._ids: list[int] = []  # ids that carry text (the eos that ends the request is left out)
        self._prefix_offset = 0
        self._read_offset = 0
        self._committed = ""  # decoded text of self._ids[:read_offset]: complete characters only
        self._pending = ""  # decoded text after read_offset that still ends in an incomplete character
        self._stop_checked = 0  # no stop string starts before this index of the committed text

    def append(self, token_id: int) -> tuple[str, FinishReason | None]:
        """Add one generated token; return (text that may be emitted now, finish reason or None)."""
        if self.finished is not None:
            raise RuntimeError("append after the output finished")
        self.token_ids.append(token_id)
        if token_id in self._params.eos_token_ids and not self._params.ignore_eos:
            return self._finish(FinishReason.STOP)
        self._ids.append(token_id)
        self._detokenize()
        end = self._find_stop(self._committed)
        if end is not None:
            return self._emit_until(self._committed, end, FinishReason.STOP)
        if len(self.token_ids) >= self._params.max_tokens:
            return self._finish(FinishReason.LENGTH)
        safe = len(self._committed) - self._stop_prefix_len(self._committed)
        return self._emit_until(self._committed, safe, None)

    def _detokenize(self) -> None:
        decode = self._tok.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        new_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            # Nothing new yet (e.g. a special token) or an incomplete UTF-8 tail: wait for more tokens.
            self._pending = new_text[len(prefix_text) :]
            return
        self._committed += new_text[len(prefix_text) :]
        self._pending = ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)

    def _find_stop(self, text: str) -> int | None:
        """Index where the earliest stop string starts in `text`, if any."""
        if not self._max_stop:
            return None
        start = max(0, self._stop_checked - self._max_stop + 1)
        found = [i for i in (text.find(s, start) for s in self._params.stop) if i >= 0]
        self._stop_checked = len(text)
        return min(found) if found else None

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
        end = self._find_stop(text)
        if end is not None:
            return self._emit_until(text, end, FinishReason.STOP)
        return self._emit_until(text, len(text), reason)

    def _emit_until(self, text: str, end: int, reason: FinishReason | None) -> tuple[str, FinishReason | None]:
        delta = text[len(self.text) : end] if end > len(self.text) else ""
        self.text += delta
        self.finished = reason
        return delta, reason
