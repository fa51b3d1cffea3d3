"""The engine loop with a fake engine (its own engine thread, no model): an exception in one request's
work fails just that request and the loop goes on; one that escapes a step fails every request the
engine holds, marks it failed and ends the thread; the test-only fault injection (``XPYD_TEST_FAULT``).

Prompts are token-id lists whose first id says how the fake engine treats the request (see ``_Fake``).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from xpyd.model.output import StopParams
from xpyd.model.sampling import SamplingParams
from xpyd.signal.request_id import RequestId
from xpyd.worker.config import WorkerConfig
from xpyd.worker.engine import Abort, WorkerEngine
from xpyd.worker.faults import FAULT_ENV, FaultInjection, FaultSite
from xpyd.worker.work_item import ErrorEvent, EventDispatch, OutputSink, TokenEvent, WorkItem

FINISH, HOLD, BAD_OUTPUT, BAD_ADD = 1, 2, 3, 4  # first prompt id: finish at the next step / stay held / ...
WAIT = 2.0  # seconds an event may take (bounds a hang; the engine answers within milliseconds)


class _Tokenizer:
    def decode(self, ids: list[int]) -> str:
        return " ".join(f"<{i}>" for i in ids)


class _Runner:
    pool = None
    max_model_len = 64
    eos_token_ids = frozenset()


class _Fake(WorkerEngine):
    """Holds requests in a dict; each step finishes the FINISH ones. BAD_OUTPUT ones raise in their output
    handling, BAD_ADD ones while being added (before they are held); ``broken_step`` makes the step raise
    outside every request, ``broken_fail_path`` makes failing a request raise."""

    name = "fake-engine"

    def __init__(self) -> None:
        super().__init__(_Runner(), _Tokenizer(), WorkerConfig(role="decode", port=8100), "m")
        self.held: dict[str, WorkItem] = {}
        self.broken_step = False
        self.broken_fail_path = False
        self.shut_down = False

    def step(self) -> float:
        for item in self.drain_inbox():
            if isinstance(item, Abort):
                self.held.pop(item.request_id, None)
            else:
                self.admit(item, self._add)
        if self.broken_step:
            raise RuntimeError("scheduler state broken")
        for rid, item in list(self.held.items()):
            if item.prompt_ids[0] != HOLD:
                with self.isolate(rid, item):
                    self._output(rid, item)
        return 0.01

    def _add(self, item: WorkItem) -> None:
        if item.prompt_ids[0] == BAD_ADD:
            raise KeyError("cannot add")
        self.held[str(item.request_id)] = item

    def _output(self, rid: str, item: WorkItem) -> None:
        if item.prompt_ids[0] == BAD_OUTPUT:
            raise ValueError(f"bad output for {rid}")
        del self.held[rid]
        self.metrics.request_done("finished")
        item.sink.put(TokenEvent("x", "length", len(item.prompt_ids), 1))

    def fail_held(self, request_id: str, item: WorkItem | None, error: str) -> bool:
        if self.broken_fail_path:
            raise RuntimeError("fail path broken")
        held = self.held.get(request_id)
        if held is None or (item is not None and held is not item):
            return False
        del self.held[request_id]
        self.metrics.request_done("failed")
        held.sink.put(ErrorEvent(500, error))
        return True

    def idle(self) -> bool:
        return not self.held

    def shutdown(self) -> None:
        self.shut_down = True

    def outcomes(self) -> dict[str, float]:
        sample = self.metrics.registry.get_sample_value
        return {o: sample("xpyd_requests_total", {"role": "decode", "outcome": o}) for o in ("finished", "failed")}


def _item(*prompt_ids: int, mark: str | None = None) -> WorkItem:
    return WorkItem(RequestId.new("127.0.0.1:7000", "127.0.0.1:7001"), list(prompt_ids), SamplingParams(),
                    StopParams(max_tokens=4, stop=(mark,) if mark else ()),
                    OutputSink(EventDispatch(asyncio.get_running_loop())))


async def _next(item: WorkItem):
    return await asyncio.wait_for(item.sink.queue.get(), WAIT)


async def _holding(engine: _Fake, n: int) -> None:
    """Until the engine thread holds ``n`` requests (it adds them at its next step)."""
    deadline = time.monotonic() + WAIT
    while len(engine.held) != n:
        assert time.monotonic() < deadline, f"the engine holds {len(engine.held)} requests, not {n}"
        await asyncio.sleep(0.005)


@pytest.fixture
def engine():
    engine = _Fake()
    yield engine
    engine.stop()


async def test_a_request_whose_output_handling_raises_fails_alone_and_the_loop_goes_on(engine):
    engine.start_thread()
    a, bad, c = _item(FINISH, 5), _item(BAD_OUTPUT, 5), _item(FINISH, 6)
    for item in (a, bad, c):
        engine.submit(item)
    error = await _next(bad)
    assert isinstance(error, ErrorEvent) and error.status == 500
    assert "ValueError: bad output for" in error.message and str(bad.request_id) in error.message
    for item in (a, c):
        assert (await _next(item)).finish_reason == "length"
    d = _item(FINISH, 7)  # the loop goes on
    engine.submit(d)
    assert (await _next(d)).finish_reason == "length"
    assert engine.ready() and engine.failure() is None
    assert engine.held == {} and engine.outcomes() == {"finished": 3, "failed": 1}


async def test_a_request_that_raises_before_it_is_held_is_failed_from_its_item(engine):
    engine.start_thread()
    bad, ok = _item(BAD_ADD), _item(FINISH)
    engine.submit(bad)
    engine.submit(ok)
    error = await _next(bad)
    assert error.status == 500 and "KeyError: 'cannot add'" in error.message
    assert (await _next(ok)).finish_reason == "length"
    assert engine.ready() and engine.held == {} and engine.outcomes() == {"finished": 1, "failed": 1}


async def test_an_exception_out_of_a_step_fails_every_request_and_the_engine(engine):
    failed = []
    engine.on_failure(lambda: failed.append(time.monotonic()))
    engine.start_thread()
    held = [_item(HOLD, 1), _item(HOLD, 2)]
    for item in held:
        engine.submit(item)
    await _holding(engine, 2)
    assert engine.ready()
    engine.broken_step = True
    for item in held:
        error = await _next(item)
        assert error.status == 500 and "RuntimeError: scheduler state broken" in error.message
    engine._thread.join(WAIT)
    assert not engine._thread.is_alive() and engine.shut_down
    assert len(failed) == 1
    assert not engine.ready() and engine.failure() == "RuntimeError: scheduler state broken"
    assert engine.outcomes()["failed"] == 2
    late = _item(FINISH)  # refused at once: nothing would ever take it
    engine.submit(late)
    error = await _next(late)
    assert error.status == 503 and "engine failed" in error.message
    t0 = time.monotonic()
    assert engine.drain(10) is False and time.monotonic() - t0 < 1  # a failed engine is never idle: no wait
    engine.on_failure(lambda: failed.append(time.monotonic()))  # set after the failure: called at once
    assert len(failed) == 2


async def test_a_request_whose_fail_path_raises_fails_the_engine(engine):
    engine.start_thread()
    held, bad = _item(HOLD), _item(BAD_OUTPUT)
    engine.submit(held)
    await _holding(engine, 1)
    engine.broken_fail_path = True
    engine.submit(bad)
    for item in (held, bad):
        error = await _next(item)
        assert error.status == 500 and "RuntimeError: fail path broken" in error.message
    engine._thread.join(WAIT)
    assert not engine.ready() and "fail path broken" in engine.failure()


async def test_an_injected_add_fault_fails_just_the_marked_request(engine, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "add:<9>")
    engine.start_thread()
    marked, ok = _item(FINISH, mark="<9>"), _item(FINISH, mark="<8>")
    engine.submit(marked)
    engine.submit(ok)
    error = await _next(marked)
    assert error.status == 500 and f"InjectedFault: injected by {FAULT_ENV}=add:<9>" in error.message
    assert (await _next(ok)).finish_reason == "length"
    assert engine.ready() and engine.held == {}


async def test_an_injected_step_fault_fails_the_engine_with_every_request(engine, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "step:<9>")
    engine.start_thread()
    held = _item(HOLD)
    engine.submit(held)
    await _holding(engine, 1)
    marked = _item(HOLD, mark="<9>")
    engine.submit(marked)
    for item in (held, marked):
        error = await _next(item)
        assert error.status == 500 and "InjectedFault" in error.message
    engine._thread.join(WAIT)
    assert not engine.ready() and engine.failure().startswith("InjectedFault")


def test_fault_injection_values():
    assert FaultInjection.from_env({}) is None and FaultInjection.from_env({FAULT_ENV: ""}) is None
    fault = FaultInjection.from_env({FAULT_ENV: "add:needle:with colon"})
    assert (fault.site, fault.marker) == (FaultSite.ADD, "needle:with colon")
    for bad in ("add", "add:", "later:needle"):
        with pytest.raises(ValueError, match=FAULT_ENV):
            FaultInjection.from_env({FAULT_ENV: bad})


def test_a_step_fault_fires_once_an_add_fault_every_time():
    item = WorkItem(RequestId.new("127.0.0.1:7000", "127.0.0.1:7001"), [9], SamplingParams(),
                    StopParams(max_tokens=4, stop=("<9>",)), sink=None)
    step = FaultInjection(FaultSite.STEP, "<9>")
    assert [step.site_for(item) for _ in range(2)] == [FaultSite.STEP, None]
    add = FaultInjection(FaultSite.ADD, "<9>")
    assert [add.site_for(item) for _ in range(2)] == [FaultSite.ADD, FaultSite.ADD]
    assert FaultInjection(FaultSite.ADD, "<8>").site_for(item) is None


async def test_a_sink_has_ended_after_an_error_or_its_last_token():
    for events, ended in (([TokenEvent("a", None, 1, 1)], False), ([TokenEvent("a", "stop", 1, 1)], True),
                          ([ErrorEvent(502, "gone")], True)):
        sink = OutputSink(EventDispatch(asyncio.get_running_loop()))
        for ev in events:
            sink.put(ev)
        assert sink.ended is ended
