"""The worker's KV event stream (``KVEventStreams``) over a real ``KVEventLog``, without HTTP: the first line, a
backlog split into lines, a push on record, keep-alives, the bound, and the end on close."""

from __future__ import annotations

import asyncio
import gc
import json

import pytest

from xpyd.worker import kv_stream
from xpyd.worker.kv_events import KVEventLog
from xpyd.worker.kv_stream import KVEventStreams


async def _line(lines) -> dict:
    return json.loads(await asyncio.wait_for(anext(lines), 10))


def test_since_with_a_limit_serves_the_oldest_events_first():
    log = KVEventLog()
    log.record([1, 2, 3], [])
    assert log.since(log.epoch, 0, 2) == {"epoch": log.epoch, "seq": 2, "events": [["stored", 1], ["stored", 2]]}
    assert log.since(log.epoch, 2, 2) == {"epoch": log.epoch, "seq": 3, "events": [["stored", 3]]}
    assert log.since(log.epoch, 3, 2) == {"epoch": log.epoch, "seq": 3, "events": []}


def test_subscribers_are_woken_by_changes_and_close_only():
    log = KVEventLog()
    woken = []
    unsubscribe = log.subscribe(lambda: woken.append(1))
    log.record([], [])
    assert woken == []
    log.record([5], [])
    assert woken == [1]
    log.close()
    assert woken == [1, 1] and log.closed
    unsubscribe()
    log.record([6], [])
    assert woken == [1, 1]


async def test_a_stream_sends_a_snapshot_then_pushes_each_batch(monkeypatch):
    monkeypatch.setattr(kv_stream, "MAX_FRAME_EVENTS", 2)
    log = KVEventLog()
    log.record([7], [])
    streams = KVEventStreams(log, max_streams=1, keep_alive=60)
    lines = streams.open(None, None)
    assert await _line(lines) == {"epoch": log.epoch, "seq": 1, "snapshot": [7]}
    assert streams.open(None, None) is None  # the bound
    pending = asyncio.ensure_future(_line(lines))
    await asyncio.sleep(0)
    assert not pending.done()  # nothing happened: nothing sent
    log.record([8, 9, 10], [7])  # from "another thread": woken through call_soon_threadsafe
    assert await pending == {"epoch": log.epoch, "seq": 3, "events": [["removed", 7], ["stored", 8]]}
    assert await _line(lines) == {"epoch": log.epoch, "seq": 5, "events": [["stored", 9], ["stored", 10]]}
    log.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(lines), 10)
    assert streams.active == 0


async def test_a_quiet_stream_sends_keep_alives_and_resumes_from_a_cursor():
    log = KVEventLog()
    log.record([1, 2], [])
    streams = KVEventStreams(log, keep_alive=0.01)
    lines = streams.open(log.epoch, 1)
    assert await _line(lines) == {"epoch": log.epoch, "seq": 2, "events": [["stored", 2]]}
    assert await _line(lines) == {"epoch": log.epoch, "seq": 2, "events": []}  # a keep-alive
    await lines.aclose()
    assert streams.active == 0


def test_a_stream_never_started_gives_its_place_back():
    streams = KVEventStreams(KVEventLog(), max_streams=1)
    lines = streams.open(None, None)
    assert streams.active == 1
    del lines
    gc.collect()
    assert streams.active == 0 and streams.open(None, None) is not None
