"""A response's logprobs and echoed prompt in the OpenAI shapes, as vLLM writes them.

Completions (``logprobs: k``)::

    {"text_offset": [..], "token_logprobs": [..], "tokens": [..], "top_logprobs": [{token: logprob}, ..]}

each top dict holding the chosen token and the k most likely (by their text: two ids with one text keep the
later); an echoed prompt's first token has ``null`` logprob and top. Chat (``logprobs: true, top_logprobs: k``)::

    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ..]}, ..]}

whose ``top_logprobs`` are, as vLLM's, the first k of the chosen token followed by the most likely others.
vLLM's ``prompt_logprobs``: per prompt token ``null`` (the first) or ``{"<id>": {"logprob", "rank",
"decoded_token"}}`` for the prompt's token and the k most likely. A token's text is its id decoded alone; a
logprob below -9999 (or -inf) is written as -9999.0, as vLLM does.

Text offsets: a token's offset is the summed length of the texts of the tokens before it in the response
(the echoed prompt's, then the output's), so the two workers of a P/D request write the offsets of one
response: decode counts the prompt's tokens (when echoed) and prefill's first token before its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from xpyd.api.openai import CompletionRequest, RequestKind
from xpyd.model.logprobs import TokenLogprob

FLOOR = -9999.0


def _lp(value: float) -> float:
    return value if value > FLOOR else FLOOR


class TokenTexts:
    """Each token id's text as a logprob names it (decoded alone; ``as_ids``: ``token_id:<id>``, vLLM's
    return_tokens_as_token_ids), memoized per request."""

    __slots__ = ("_tokenizer", "_memo", "_as_ids")

    def __init__(self, tokenizer, as_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._memo: dict[int, str] = {}
        self._as_ids = as_ids

    def __call__(self, token: int) -> str:
        text = self._memo.get(token)
        if text is None:
            text = f"token_id:{token}" if self._as_ids else (self._tokenizer.decode([token]) or "")
            self._memo[token] = text
        return text

    def length(self, tokens: Sequence[int]) -> int:
        return sum(len(self(t)) for t in tokens)


class LogprobWriter:
    """One request's logprobs in its kind's shape: ``chunk`` for each event's tokens (a stream), or all of
    them at once. ``offset``: the text offset of the first token written next (completions)."""

    def __init__(self, kind: RequestKind, top: int, texts: TokenTexts, offset: int = 0) -> None:
        self.kind = kind
        self.top = top
        self.texts = texts
        self.offset = offset

    def write(self, tokens: Sequence[int], entries: Sequence[TokenLogprob | None]) -> dict:
        """The logprobs object for ``tokens`` (their entries: None for an echoed prompt's first token)."""
        if self.kind is RequestKind.CHAT:
            return {"content": [self._chat(e) for e in entries if e is not None]}
        offsets, logprobs, names, tops = [], [], [], []
        for token, entry in zip(tokens, entries):
            name = self.texts(token)
            offsets.append(self.offset)
            self.offset += len(name)
            names.append(name)
            if entry is None:
                logprobs.append(None)
                tops.append(None)
                continue
            logprobs.append(_lp(entry.logprob))
            top = {name: _lp(entry.logprob)}
            for t, lp in entry.top[: self.top]:
                top[self.texts(t)] = _lp(lp)
            tops.append(top)
        return {"text_offset": offsets, "token_logprobs": logprobs, "tokens": names, "top_logprobs": tops}

    def _chat(self, entry: TokenLogprob) -> dict:
        name = self.texts(entry.token)
        listed, seen = [], {entry.token}
        if self.top:
            listed.append(self._named(entry.token, entry.logprob))
            for t, lp in entry.top:
                if len(listed) >= self.top:
                    break
                if t not in seen:
                    seen.add(t)
                    listed.append(self._named(t, lp))
        return {"token": name, "logprob": _lp(entry.logprob), "bytes": list(name.encode("utf-8", "replace")),
                "top_logprobs": listed}

    def _named(self, token: int, logprob: float) -> dict:
        name = self.texts(token)
        return {"token": name, "logprob": _lp(logprob), "bytes": list(name.encode("utf-8", "replace"))}


def prompt_logprobs(prompt_ids: Sequence[int], scores: Sequence[TokenLogprob], top: int,
                    texts: TokenTexts) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: None for the first token, then each token's entry and the ``top`` most likely."""
    out: list[dict | None] = [None]
    for entry in scores[: max(0, len(prompt_ids) - 1)]:
        d = {str(entry.token): {"logprob": _lp(entry.logprob), "rank": entry.rank,
                                "decoded_token": texts(entry.token)}}
        for rank, (t, lp) in enumerate(entry.top[:top], start=1):
            d.setdefault(str(t), {"logprob": _lp(lp), "rank": rank, "decoded_token": texts(t)})
        out.append(d)
    return out


class ResponseExtras:
    """What a worker adds to a request's choices beyond the text: the echoed prompt (text, and its logprobs
    when asked), each token's logprobs, vLLM's ``prompt_logprobs``.

    ``echo_here``: this worker writes the response's start (prefill, colocated), so the echo and the prompt's
    logprobs are its; a decode worker writes only its tokens' logprobs, their offsets after the prompt's and
    the first token's texts. The engine fills ``item.prompt_logprobs`` before the request's first event, and
    appends every token to ``item.output.token_ids`` before the event that carries it."""

    def __init__(self, req: CompletionRequest, item, tokenizer, echo_here: bool, tools=None) -> None:
        self.req = req
        self.tools = tools  # a colocated answer's ToolOutput (content and tool calls), when tools are in play
        self.item = item
        self.echo_here = echo_here
        self.texts = TokenTexts(tokenizer, req.tokens_as_ids)
        self.tokenizer = tokenizer
        self._writer: LogprobWriter | None = None
        self._started = False  # the first event was written

    @property
    def active(self) -> bool:
        return self.req.logprobs is not None or (self.req.echo and self.echo_here) or self._prompt_wanted

    @property
    def _prompt_wanted(self) -> bool:
        return self.echo_here and self.req.prompt_logprobs is not None

    def echo_text(self) -> str:
        """The echoed prompt's text (nothing unless echoing here): a text prompt as sent, token ids decoded."""
        if not (self.req.echo and self.echo_here):
            return ""
        prompt = self.req.prompt
        if isinstance(prompt, str) and self.req.truncate_prompt_tokens is None:
            return prompt
        return self.tokenizer.decode(self.item.prompt_ids)

    def first_text(self, text: str) -> str:
        """The text of the response's first event (with the echoed prompt before it)."""
        return self.echo_text() + text

    def event_logprobs(self, completion_tokens: int, entries: Sequence[TokenLogprob]) -> dict | None:
        """The logprobs of one event's tokens (the last ``len(entries)`` of the ``completion_tokens`` so far);
        the first event of a request echoed here starts with its prompt's."""
        if self.req.logprobs is None:
            self._started = True
            return None
        writer = self._writer_now(completion_tokens - len(entries))
        tokens: list[int] = []
        scored: list[TokenLogprob | None] = []
        if not self._started and self.req.echo and self.echo_here:
            ids = self.item.prompt_ids
            tokens.extend(ids)
            scored.append(None)
            scored.extend(self.item.prompt_logprobs[: len(ids) - 1])
            scored.extend([None] * (len(tokens) - len(scored)))  # (never: every position is scored)
        self._started = True
        tokens.extend(e.token for e in entries)
        scored.extend(entries)
        return writer.write(tokens, scored)

    def _writer_now(self, first_output: int) -> LogprobWriter:
        """The writer, its offset at the output's token ``first_output`` (decode: after prefill's first)."""
        if self._writer is None:
            offset = 0
            if self.req.echo and not self.echo_here:
                offset += self.texts.length(self.item.prompt_ids)
            offset += self.texts.length(self.item.output.token_ids[:first_output])
            self._writer = LogprobWriter(self.req.kind, self.req.logprobs, self.texts, offset)
        return self._writer

    def prompt_logprobs(self) -> list[dict | None] | None:
        """vLLM's ``prompt_logprobs`` of the response (None unless asked and computed here)."""
        if not self._prompt_wanted:
            return None
        texts = TokenTexts(self.tokenizer) if self.req.tokens_as_ids else self.texts  # (decoded, as vLLM's)
        return prompt_logprobs(self.item.prompt_ids, self.item.prompt_logprobs, self.req.prompt_logprobs, texts)

