"""The SSE parser the proxy and the bench client read streams with (xpyd.api.sse)."""

from __future__ import annotations

import pytest

from xpyd.api.sse import SSEParser, sse_batches, sse_data

# What a worker sends, plus what other servers may: comments, named fields, multi-line data.
SAMPLE = (
    b": keep-alive\n"
    b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n'
    b"\n"
    b"event: message\n"
    b"id: 7\n"
    b"retry: 1000\n"
    b"data: first line\n"
    b"data:second line, no space\n"
    b"data:  two spaces\n"
    b"\n"
    b": a comment alone is no event\n"
    b"id: 8\n"
    b"\n"
    b"data\n"
    b"\n"
    b'data: {"choices": [], "usage": {"completion_tokens": 2}}\n'
    b"\n"
    b"data: [DONE]\n"
    b"\n"
)
EXPECTED = [
    b'{"choices": [{"delta": {"role": "assistant"}}]}',
    b"first line\nsecond line, no space\n two spaces",
    b"",  # a `data` line without a colon: an empty data line
    b'{"choices": [], "usage": {"completion_tokens": 2}}',
    b"[DONE]",
]
ENDINGS = {"LF": b"\n", "CRLF": b"\r\n", "CR": b"\r"}


def parse(*chunks: bytes) -> list[bytes]:
    p = SSEParser()
    events = [data for chunk in chunks for data in p.feed(chunk)]
    return events + p.close()


@pytest.mark.parametrize("ending", ENDINGS)
def test_one_chunk(ending: str):
    assert parse(SAMPLE.replace(b"\n", ENDINGS[ending])) == EXPECTED


@pytest.mark.parametrize("ending", ENDINGS)
def test_split_at_every_byte(ending: str):
    stream = SAMPLE.replace(b"\n", ENDINGS[ending])
    for i in range(len(stream) + 1):
        assert parse(stream[:i], stream[i:]) == EXPECTED, f"split at {i}: {stream[:i][-10:]!r}"
    assert parse(*(stream[i:i + 1] for i in range(len(stream)))) == EXPECTED


def test_crlf_split_between_cr_and_lf_is_one_line_end():
    p = SSEParser()
    assert p.feed(b"data: a\r") == []
    assert p.feed(b"\ndata: b\r") == []  # not a blank line: the event goes on
    assert p.feed(b"\n\r") == [b"a\nb"]  # CRLF, then a CR that is a blank line
    assert p.feed(b"\ndata: c\n\n") == [b"c"]  # that CR's LF is skipped, not a second blank line


def test_mixed_line_endings():
    assert parse(b"data: a\r\ndata: b\rdata: c\n\r\ndata: d\r\r") == [b"a\nb\nc", b"d"]


def test_events_are_returned_as_they_complete():
    p = SSEParser()
    assert p.feed(b"data: 1\n\ndata: 2\n\ndata: 3") == [b"1", b"2"]
    assert p.feed(b"\n") == []
    assert p.feed(b"\n") == [b"3"]
    assert p.close() == []


@pytest.mark.parametrize("tail, expected", [
    (b"data: [DONE]\n", [b"[DONE]"]),  # no blank line after the last event: dispatched at close
    (b"data: [DONE]", [b"[DONE]"]),  # nor a line ending
    (b"data: a\ndata: b", [b"a\nb"]),
    (b"id: 3\n", []),  # no data: no event
    (b": bye", []),
    (b"", []),
])
def test_end_of_stream(tail: bytes, expected: list[bytes]):
    assert parse(b"data: x\n\n", tail) == [b"x", *expected]


def test_an_event_over_the_limit_is_an_error():
    p = SSEParser(max_event_bytes=100)
    assert p.feed(b"data: " + b"x" * 90 + b"\n\n") == [b"x" * 90]  # the limit is per event
    assert p.feed(b"data: " + b"y" * 60 + b"\n") == []
    with pytest.raises(ValueError, match="larger than 100 bytes"):
        p.feed(b"data: " + b"y" * 60 + b"\n")  # two data lines of one event
    with pytest.raises(ValueError, match="larger than 100 bytes"):
        SSEParser(max_event_bytes=100).feed(b"data: " + b"z" * 200)  # one line that never ends
    p = SSEParser(max_event_bytes=100)
    for _ in range(50):  # comments are not kept
        assert p.feed(b": " + b"c" * 80 + b"\n") == []


async def test_sse_data_over_async_chunks():
    async def chunks():
        for i in range(0, len(SAMPLE), 7):
            yield SAMPLE[i:i + 7]

    assert [data async for data in sse_data(chunks())] == EXPECTED


async def test_sse_batches_are_the_events_each_chunk_completed():
    async def chunks():
        yield b"data: 1\n\ndata: 2\n\ndata: "  # two events and the start of a third
        yield b"3\n"  # completes none
        yield b"\ndata: 4"
        yield b"\n\n"
        yield b"data: 5"  # ended by the end of the stream

    assert [batch async for batch in sse_batches(chunks())] == [[b"1", b"2"], [b"3"], [b"4"], [b"5"]]
    assert [b async for b in sse_batches(_one(SAMPLE))] == [EXPECTED]


async def test_with_empty_each_chunk_is_a_batch_and_idle_says_a_keepalive_from_part_of_an_event():
    parser = SSEParser()
    seen = []

    async def chunks():
        for chunk in (b": keep-alive\n\n", b"data: 1\n\ndata: ", b": not a comment\n", b"\n", b": keep-alive\n\n"):
            yield chunk
            seen.append(parser.idle)

    batches = [b async for b in sse_batches(chunks(), parser=parser, empty=True)]
    assert batches == [[], [b"1"], [], [b": not a comment"], []]
    assert seen == [True, False, False, True, True]  # (after the second: part of an event is held)


async def _one(chunk: bytes):
    yield chunk
