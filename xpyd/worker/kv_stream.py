"""``GET /xpyd/kv_events/stream?epoch=&since=``: the worker's KV events pushed to a router as they happen.

One long-lived response per following router, chunked NDJSON, one ``KVUpdate``-shaped object a line::

    connect          -> {"epoch", "seq", "events": [...]} after the cursor (or "snapshot": [...] when the
                        cursor is not served: new reader, another process, fell out of the bounded log)
    engine records   -> woken (KVEventLog.subscribe) -> the events after the last line's seq, at most
                        MAX_FRAME_EVENTS a line (a backlog goes as several lines)
    nothing happened -> every KEEP_ALIVE_SECONDS: {"epoch", "seq", "events": []} (a reader that hears
                        nothing for a few of these knows the stream is dead)
    worker stopping  -> the stream ends (KVEventLog.close)

Bounds: at most MAX_STREAMS at once (more: 503, the router polls ``GET /xpyd/kv_events`` meanwhile); nothing
is queued per reader (each line is read from the log at the reader's cursor when it can be sent, so a slow
reader costs a socket buffer, and one that fell out of the log gets a snapshot); a line that the reader has
not taken within SEND_STALL_SECONDS cuts the stream. Authenticated as every ``/xpyd/*`` route is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from collections.abc import AsyncIterator

from quart import Quart, Response, request

from xpyd.worker.kv_events import KVEventLog

log = logging.getLogger(__name__)

STREAM_PATH = "/xpyd/kv_events/stream"
MAX_STREAMS = 16  # routers following one worker at once (a proxy process holds one)
MAX_FRAME_EVENTS = 4096  # events a line (~120 KB)
KEEP_ALIVE_SECONDS = 5.0
SEND_STALL_SECONDS = 30.0
NDJSON = "application/x-ndjson"


class KVEventStreams:
    """The streams one worker serves (see the module's docstring)."""

    def __init__(self, events: KVEventLog, max_streams: int = MAX_STREAMS,
                 keep_alive: float = KEEP_ALIVE_SECONDS, stall: float = SEND_STALL_SECONDS) -> None:
        if max_streams < 1 or keep_alive <= 0 or stall <= 0:
            raise ValueError("max_streams must be >= 1, keep_alive and stall > 0")
        self._events = events
        self.max_streams = max_streams
        self._keep_alive = keep_alive
        self._stall = stall
        self.active = 0

    def open(self, epoch: str | None, seq: int | None) -> AsyncIterator[bytes] | None:
        """The stream's lines from the cursor on; None when MAX_STREAMS are open already."""
        if self.active >= self.max_streams:
            return None
        self.active += 1
        slot = _Slot(self)
        lines = self._lines(epoch, seq, slot)
        weakref.finalize(lines, slot.release)  # (a stream never started: its handler was cancelled first)
        return lines

    async def _lines(self, epoch: str | None, seq: int | None, slot: _Slot) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        unsubscribe = self._events.subscribe(lambda: loop.call_soon_threadsafe(wake.set))
        task = asyncio.current_task()  # the one that sends each line (the server's handler)
        try:
            while not self._events.closed:
                wake.clear()  # (before reading the log: a record after this wakes the wait below)
                update = self._events.since(epoch, seq, MAX_FRAME_EVENTS)
                if "snapshot" not in update and not update["events"]:
                    try:
                        await asyncio.wait_for(wake.wait(), self._keep_alive)
                        continue
                    except TimeoutError:
                        pass  # a keep-alive: the empty update
                epoch, seq = update["epoch"], update["seq"]
                cut = loop.call_later(self._stall, self._cut, task)
                try:
                    yield json.dumps(update, separators=(",", ":")).encode() + b"\n"
                finally:
                    cut.cancel()
        finally:
            unsubscribe()
            slot.release()

    def _cut(self, task: asyncio.Task | None) -> None:
        log.warning("a KV event stream's reader took no line for %gs: cut", self._stall)
        if task is not None:
            task.cancel()


class _Slot:
    """One stream's place among ``max_streams``, given back once."""

    __slots__ = ("_streams",)

    def __init__(self, streams: KVEventStreams) -> None:
        self._streams: KVEventStreams | None = streams

    def release(self) -> None:
        if self._streams is not None:
            self._streams.active -= 1
            self._streams = None


def register_kv_stream(app: Quart, events: KVEventLog) -> KVEventStreams:
    """Serve ``STREAM_PATH`` on ``app`` from ``events``."""
    streams = KVEventStreams(events)

    @app.get(STREAM_PATH)
    async def kv_event_stream() -> Response:
        since = request.args.get("since")
        if since is not None and not since.isdigit():
            return Response(json.dumps({"error": {"message": "since must be a non-negative integer",
                                                  "type": "invalid_request_error", "param": "since"}}),
                            status=400, mimetype="application/json")
        lines = streams.open(request.args.get("epoch"), int(since) if since is not None else None)
        if lines is None:
            resp = Response(json.dumps({"error": {"message": f"this worker serves {streams.max_streams} KV event "
                                                  "streams already; poll GET /xpyd/kv_events",
                                                  "type": "service_unavailable"}}),
                            status=503, mimetype="application/json")
            resp.headers["Retry-After"] = "30"
            return resp
        resp = Response(lines, mimetype=NDJSON)
        resp.headers["Cache-Control"] = "no-cache"
        resp.timeout = None
        return resp

    return streams
