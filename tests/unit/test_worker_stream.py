"""A worker's SSE body: its shape (named by the proxy or not), and it drops its request whenever it stops
before the end: also when it never ran (the client went between the handler returning the response and
the body's first iteration)."""

from __future__ import annotations

import asyncio
import gc
import json
import threading

from xpyd.api.openai import RequestKind
from xpyd.api.responses import chunk_head
from xpyd.worker.answers import StreamShape, stream_events
from xpyd.worker.work_item import ErrorEvent, EventDispatch, OutputSink, TokenEvent


class _Engine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _body(engine: _Engine, sink: OutputSink):
    shape = StreamShape(RequestKind.COMPLETION, "rid-1", 0, "m", include_usage=True, role_chunk=True)
    return stream_events(engine, "rid-1", shape, sink, single_event=False)


async def _run(shape: StreamShape, *events: TokenEvent) -> list[bytes]:
    sink = OutputSink(EventDispatch(asyncio.get_running_loop()))
    for ev in events:
        sink.queue.put_nowait(ev)
    return [c async for c in stream_events(_Engine(), "xpyd-rid", shape, sink, single_event=False)]


async def test_a_stream_the_proxy_named_is_the_rest_of_its_stream():
    """Named by the proxy: every chunk carries its id, created and model (not the request id), a chat
    stream opens with no role chunk (the proxy sent it), and the usage chunk comes only if asked."""
    events = (TokenEvent(" a", None, 3, 2), TokenEvent("", None, 3, 3), TokenEvent(" b", "length", 3, 4))
    for kind in RequestKind:
        for include_usage in (True, False):
            shape = StreamShape(kind, "chatcmpl-x", 1700000000, "served/name", include_usage, role_chunk=False)
            chunks = await _run(shape, *events)
            assert chunks[-1] == b"data: [DONE]\n\n"
            head = b"data: " + chunk_head("chatcmpl-x", 1700000000, "served/name", kind)
            assert all(c.startswith(head) for c in chunks[:-1])  # what the proxy's relay checks
            objs = [json.loads(c[6:]) for c in chunks[:-1]]
            if include_usage:
                assert objs.pop()["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                                  "prompt_tokens_details": {"cached_tokens": 0}}
            assert [o["choices"][0]["finish_reason"] for o in objs] == [None, "length"]  # no empty chunk
            texts = [o["choices"][0]["delta"]["content"] if kind is RequestKind.CHAT else o["choices"][0]["text"]
                     for o in objs]
            assert texts == [" a", " b"]


async def test_an_unnamed_chat_stream_opens_with_the_role_chunk():
    shape = StreamShape(RequestKind.CHAT, "xpyd-rid", 5, "m", include_usage=False, role_chunk=True)
    chunks = await _run(shape, TokenEvent("hi", "stop", 3, 2))
    objs = [json.loads(c[6:]) for c in chunks[:-1]]
    assert [o["choices"][0]["delta"] for o in objs] == [{"role": "assistant", "content": ""}, {"content": "hi"}]
    assert {o["id"] for o in objs} == {"xpyd-rid"}


async def test_a_body_that_never_ran_drops_its_request_when_it_goes():
    engine = _Engine()
    body = _body(engine, OutputSink(EventDispatch(asyncio.get_running_loop())))
    assert engine.aborted == []
    del body
    gc.collect()
    assert engine.aborted == ["rid-1"]


async def test_a_body_cut_midway_drops_its_request_once():
    engine, sink = _Engine(), OutputSink(EventDispatch(asyncio.get_running_loop()))
    body = _body(engine, sink)
    sink.queue.put_nowait(TokenEvent(" hi", None, 3, 2))
    assert b" hi" in await body.__anext__()
    await body.aclose()  # what the server does when the client goes
    del body
    gc.collect()
    assert engine.aborted == ["rid-1"]


async def test_a_body_that_ran_to_its_end_or_an_error_drops_nothing():
    for last in (TokenEvent("!", "length", 3, 3), ErrorEvent(504, "prefill not ready")):
        engine, sink = _Engine(), OutputSink(EventDispatch(asyncio.get_running_loop()))
        body = _body(engine, sink)
        sink.queue.put_nowait(last)
        chunks = [c async for c in body]
        assert chunks[-1] == b"data: [DONE]\n\n"
        del body
        gc.collect()
        assert engine.aborted == []


async def test_events_of_one_engine_step_reach_the_loop_in_one_wake_up_in_order():
    """While the loop is busy (here: blocked until the engine's step ended), every event of the step rides
    on the one flush the first event scheduled."""
    loop = asyncio.get_running_loop()
    dispatch = EventDispatch(loop)
    sinks = [OutputSink(dispatch) for _ in range(8)]
    scheduled = []
    real = loop.call_soon_threadsafe

    def counting(callback, *args):
        if getattr(callback, "__self__", None) is dispatch:
            scheduled.append(callback)
        return real(callback, *args)

    loop.call_soon_threadsafe = counting
    try:
        for step in (1, 2):
            def engine_step() -> None:  # (the engine thread: every request gets a token)
                for i, sink in enumerate(sinks):
                    sink.put(TokenEvent(f"{step}.{i}", None, 3, step))

            thread = threading.Thread(target=engine_step)
            thread.start()
            thread.join()  # the loop is busy meanwhile
            await asyncio.sleep(0)  # the flush runs
            assert len(scheduled) == step  # one wake-up for the 8 events of the step
        for i, sink in enumerate(sinks):
            assert [(await sink.queue.get()).text for _ in range(2)] == [f"1.{i}", f"2.{i}"]
    finally:
        del loop.call_soon_threadsafe


async def test_a_silent_stream_writes_keepalive_comments_and_then_its_tokens():
    shape = StreamShape(RequestKind.COMPLETION, "cmpl-x", 1, "m", include_usage=False, role_chunk=False)
    sink = OutputSink(EventDispatch(asyncio.get_running_loop()))
    body = stream_events(_Engine(), "xpyd-rid", shape, sink, single_event=False, keepalive=0.02)
    assert await asyncio.wait_for(body.__anext__(), 5) == b": keep-alive\n\n"
    assert await asyncio.wait_for(body.__anext__(), 5) == b": keep-alive\n\n"
    sink.queue.put_nowait(TokenEvent(" a", "length", 3, 2))
    rest = [c async for c in body]
    assert json.loads(rest[0][6:])["choices"][0]["text"] == " a" and rest[-1] == b"data: [DONE]\n\n"
