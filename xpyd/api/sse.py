# Our own code: PyPI's SSE clients send the request themselves (aiohttp-sse-client re-sends it) or block (sseclient-py).
"""Reading a server-sent-event stream (what ``xpyd.api.responses.sse`` writes): the ``data`` of each event.

``SSEParser`` is fed the body's bytes as they arrive, split anywhere, and returns the data of every
event completed so far; ``sse_data`` does that over an async iterable of chunks, and ``sse_batches``
too but as one list per chunk (what one read completed, for a relay that forwards it at once).
Per the SSE spec (html.spec.whatwg.org, "Parsing an event stream"): lines end with CRLF, LF or CR;
a blank line ends an event; ``data:`` loses one leading space; several ``data`` lines are joined
with ``\\n``; an event with no ``data`` line is not dispatched; comments (``:...``) and other fields
(``event``, ``id``, ``retry``) are skipped (a parser made with ``keep`` keeps the last comment line that
starts with it, in ``kept``: ``xpyd.api.timing``'s comment). Unlike the spec, an event the stream ends in (no blank
line after it) is dispatched at ``close()``, as a line-by-line reader would see it; a leading BOM is
not removed.

Data is returned as bytes, undecoded (``json.loads`` takes bytes). Only the standard library.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

MAX_EVENT_BYTES = 1 << 20  # one event's pending bytes; more is a broken or hostile stream


class SSEParser:
    """Incremental SSE parser: ``feed(chunk)`` -> data of the events it completed; ``close()`` at the end."""

    __slots__ = ("_line", "_data", "_held", "_skip_lf", "_max", "_keep", "kept")

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES, keep: bytes | None = None) -> None:
        self._line = b""  # an unfinished line (no line ending yet)
        self._data: list[bytes] = []  # the current event's data lines
        self._held = 0  # their bytes
        self._skip_lf = False  # the last chunk ended with CR: a LF opening the next one belongs to it
        self._max = max_event_bytes
        self._keep = keep  # comment lines starting with it are kept (the last one)
        self.kept: bytes | None = None

    def feed(self, chunk: bytes) -> list[bytes]:
        """The data of every event ``chunk`` completes. ValueError if one event exceeds the size limit."""
        if not chunk:
            return []
        if self._skip_lf and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._skip_lf = chunk[-1:] == b"\r"
        lines = (self._line + chunk).splitlines(keepends=True)  # bytes split only at CR, LF and CRLF
        self._line = lines.pop() if lines and lines[-1][-1:] not in (b"\n", b"\r") else b""
        events: list[bytes] = []
        for line in lines:
            self._line_done(line.rstrip(b"\r\n"), events)
        if self._held + len(self._line) > self._max:
            raise ValueError(f"an SSE event is larger than {self._max} bytes")
        return events

    @property
    def idle(self) -> bool:
        """Between events: no part of one is held (what the last chunk brought, if it completed none, was
        comments or blank lines: a keep-alive)."""
        return not self._data and not self._line

    def close(self) -> list[bytes]:
        """The end of the stream: the data of an event left without its blank line, if any."""
        events: list[bytes] = []
        if self._line:
            self._line_done(self._line, events)
            self._line = b""
        self._line_done(b"", events)
        self._skip_lf = False
        return events

    def _line_done(self, line: bytes, events: list[bytes]) -> None:
        if not line:  # blank: the event ends
            if self._data:
                events.append(b"\n".join(self._data))
                self._data, self._held = [], 0
            return
        name, _, value = line.partition(b":")  # no colon: the line is the name, the value empty
        if name == b"data":
            value = value[1:] if value[:1] == b" " else value
            self._data.append(value)
            self._held += len(value)
        elif self._keep is not None and line.startswith(self._keep):
            self.kept = line
        # else: a comment (empty name) or a field we do not use


async def sse_data(chunks: AsyncIterable[bytes], max_event_bytes: int = MAX_EVENT_BYTES,
                   parser: SSEParser | None = None) -> AsyncIterator[bytes]:
    """The data of each event in a stream of body chunks (e.g. ``resp.content.iter_any()``).
    Stop early inside ``contextlib.aclosing`` so the generator is closed at once. ``parser``: one of the
    caller's (to read its ``kept`` comment after an event); it then sets the size limit."""
    parser = parser or SSEParser(max_event_bytes)
    async for chunk in chunks:
        for data in parser.feed(chunk):
            yield data
    for data in parser.close():
        yield data


async def sse_batches(chunks: AsyncIterable[bytes], max_event_bytes: int = MAX_EVENT_BYTES,
                      parser: SSEParser | None = None, empty: bool = False) -> AsyncIterator[list[bytes]]:
    """As ``sse_data``, but the data of the events each chunk completed, together (chunks that complete
    none are skipped, or, with ``empty``, an empty list). Stop early inside ``contextlib.aclosing`` as well."""
    parser = parser or SSEParser(max_event_bytes)
    async for chunk in chunks:
        events = parser.feed(chunk)
        if events or empty:
            yield events
    events = parser.close()
    if events:
        yield events
