"""A request queued at its prefill worker waits as long as that queue moves: each answer to a re-ask carries
the prefill worker's forward passes so far, and a count that grew since the last answer starts the
``prefill_wait_timeout`` over. A queue that does not move fails the request at its deadline (504), as before.
The same for a request pulled while its prompt is computed (PREFILLING: its KV comes in parts, each as its
chunk is computed among other prompts' chunks): moving, its wait goes on; stalled, it fails.
Decode engine stepped by hand with a clock the test moves (decode_harness)."""

from __future__ import annotations

import msgspec

from tests.unit.decode_harness import S, add_request, facts, make_engine
from xpyd.decode_worker.lookups import SAFETY_REASK
from xpyd.signal import messages as m
from xpyd.worker.request import RequestState
from xpyd.worker.work_item import ErrorEvent

WAIT = 30.0  # the harness's deadline (arrival + 30 s) and the engine's default prefill_wait_timeout


def _wait_queued(engine, clock, rid, steps_per_answer: int, seconds: float, prefilling: bool = False) -> None:
    """Answer every re-ask for ``seconds`` with NOT_READY (``prefilling``: PREFILLING, with the prompt's facts),
    the prefill worker's step count growing by ``steps_per_answer`` each time."""
    steps, end = 100, clock.now + seconds
    engine.step()  # the claim goes
    while clock.now < end:
        if prefilling:
            answer = msgspec.structs.replace(facts(rid, S.PREFILLING, 20, part_blocks=2), steps=steps)
        else:
            answer = m.LookupResult(rid, S.NOT_READY, steps=steps)
        engine.signal.answer(answer)
        engine.step()
        steps += steps_per_answer
        clock.now += SAFETY_REASK
        engine.step()  # the re-ask goes (or the deadline passes)
        if engine.sched.get(rid) is None:
            return



def test_a_moving_queue_is_waited_out_past_the_timeout(monkeypatch):
    engine, _, _, clock = make_engine(monkeypatch)
    assert engine.config.prefill_wait_timeout == WAIT
    rid, payload = add_request(engine, clock)
    _wait_queued(engine, clock, rid, steps_per_answer=3, seconds=4 * WAIT)
    seq = engine.sched.get(rid)
    assert seq is not None and seq.state is RequestState.WAITING and not payload.sink.events
    # Its turn comes: ready, pulled, decoded.
    engine.signal.notify(facts(rid, S.READY, 12, first_token=42))
    engine.step()
    engine.step()
    assert engine.sched.get(rid).state in (RequestState.TRANSFERRING, RequestState.RUNNING)


def test_a_queue_that_does_not_move_fails_at_the_deadline(monkeypatch):
    engine, _, _, clock = make_engine(monkeypatch)
    rid, payload = add_request(engine, clock)
    start = clock.now
    _wait_queued(engine, clock, rid, steps_per_answer=0, seconds=4 * WAIT)
    assert engine.sched.get(rid) is None
    (event,) = [e for e in payload.sink.events if isinstance(e, ErrorEvent)]
    assert event.status == 504 and "did not have the request ready within 30s" in event.message
    assert clock.now - start <= WAIT + SAFETY_REASK  # at its first deadline, not later


def test_a_pulled_request_whose_prompt_keeps_computing_is_waited_out(monkeypatch):
    engine, _, _, clock = make_engine(monkeypatch)
    rid, payload = add_request(engine, clock)
    _wait_queued(engine, clock, rid, steps_per_answer=2, seconds=4 * WAIT, prefilling=True)
    seq = engine.sched.get(rid)
    assert seq is not None and seq.state is RequestState.TRANSFERRING and not payload.sink.events


def test_a_pulled_request_whose_prefill_stalls_fails_at_the_deadline(monkeypatch):
    engine, _, _, clock = make_engine(monkeypatch)
    rid, payload = add_request(engine, clock)
    start = clock.now
    _wait_queued(engine, clock, rid, steps_per_answer=0, seconds=4 * WAIT, prefilling=True)
    assert engine.sched.get(rid) is None
    (event,) = [e for e in payload.sink.events if isinstance(e, ErrorEvent)]
    assert "did not arrive within 30s" in event.message, event.message
    assert clock.now - start <= WAIT + 2 * SAFETY_REASK
