"""Decode re-asks its prefill worker about every request it claimed and has no last word on, whatever its
state, SAFETY_REASK after the last news of it (one lookup in flight at a time): a notify lost on the way
(a ROUTER at its high-water mark drops it) costs one such interval, not the request. Every pull is sent,
in as many lookups as the signal plane's limits need. Decode engine stepped by hand with a clock the test
moves (decode_harness)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.unit.decode_harness import LAYOUT, S, add_request, facts, make_engine
from xpyd.decode_worker.lookups import FRAME_BUDGET, SAFETY_REASK, lookup_frames
from xpyd.signal import messages as m
from xpyd.signal.request_id import part_transfer_ids, transfer_id_of
from xpyd.transfer.auth import new_secret
from xpyd.worker.request import RequestState
from xpyd.worker.work_item import ErrorEvent


def _status(entries) -> list[str]:
    """The ids a lookup asks about without a destination (claims, re-asks)."""
    return [e.request_id for e in entries if e.dest_blocks is None]


@pytest.mark.parametrize("answer", ["facts", "first token alone"])
def test_a_lost_ready_notify_of_a_streamed_pull_costs_one_reask(monkeypatch, answer):
    """Prefill answers the re-ask with the prompt's facts while it sends, or (its send done) with how the
    request ended there: the first token alone."""
    engine, transfer, sender, clock = make_engine(monkeypatch)
    rid, payload = add_request(engine, clock)
    engine.step()
    assert _status(engine.signal.lookups[-1]) == [rid]  # claimed
    engine.signal.answer(facts(rid, S.PREFILLING, 12, part_blocks=1))
    engine.step()  # pulled while it computes: 3 parts
    (pull,) = engine.signal.lookups[-1]
    assert pull.dest_blocks is not None and engine.sched.get(rid).state is RequestState.TRANSFERRING
    engine.signal.answer(facts(rid, S.PREFILLING, 12, part_blocks=1))
    for tid in part_transfer_ids(rid, 3):
        transfer.complete(tid)
    engine.step()  # every part landed; prefill's READY notify (the first token) is lost on the way
    asked = len(engine.signal.lookups)
    clock.now += SAFETY_REASK - 0.01
    engine.step()
    assert len(engine.signal.lookups) == asked  # not before SAFETY_REASK without news
    clock.now += 0.01
    engine.step()
    assert _status(engine.signal.lookups[-1]) == [rid]  # the re-ask
    if answer == "facts":
        engine.signal.answer(facts(rid, S.SENDING, 12, first_token=42))
    else:
        engine.signal.answer(m.LookupResult(rid, S.SENDING, 42))
    engine.step()
    seq = engine.sched.get(rid)
    assert seq.state is RequestState.RUNNING and payload.output.token_ids == [42, 7]
    assert engine.stats()["status_polls"] == 1 and engine.stats()["claims"] == 1
    engine._abort(rid)
    engine.step()
    assert not engine.sched.has_work() and engine.pool.num_used == 0 and transfer.outstanding() == set()


def test_a_lost_failed_notify_of_a_pulled_request_fails_it_at_the_reask(monkeypatch):
    engine, transfer, sender, clock = make_engine(monkeypatch)
    rid, payload = add_request(engine, clock)
    engine.step()
    engine.signal.answer(facts(rid, S.READY, 12, first_token=42))
    engine.step()  # pulled
    engine.signal.answer(facts(rid, S.SENDING, 12, first_token=42))
    engine.step()  # its send fails on prefill; the FAILED notify is lost on the way
    clock.now += SAFETY_REASK
    engine.step()
    assert _status(engine.signal.lookups[-1]) == [rid]
    engine.signal.answer(m.LookupResult(rid, S.FAILED, error="KV send failed: connection reset"))
    engine.step()
    (event,) = payload.sink.events
    assert isinstance(event, ErrorEvent) and event.status == 502 and "connection reset" in event.message
    assert not engine.sched.has_work() and engine.pool.num_used == 0 and transfer.outstanding() == set()


def test_a_reask_answered_unknown_after_the_kv_landed_lets_the_request_join(monkeypatch):
    """The re-ask crossed the end of the send: prefill, done with the request, no longer knows it."""
    engine, transfer, sender, clock = make_engine(monkeypatch)
    rid, payload = add_request(engine, clock)
    engine.step()
    engine.signal.answer(facts(rid, S.READY, 12, first_token=42))
    engine.step()
    engine.signal.answer(facts(rid, S.SENDING, 12, first_token=42))
    engine.step()
    clock.now += SAFETY_REASK
    engine.step()
    assert _status(engine.signal.lookups[-1]) == [rid]
    transfer.complete(transfer_id_of(rid))
    engine.signal.answer(m.LookupResult(rid, S.UNKNOWN))
    engine.step()
    assert engine.sched.get(rid).state is RequestState.RUNNING and payload.sink.events[-1].text == "t"
    engine._abort(rid)
    engine.step()
    assert not engine.sched.has_work() and engine.pool.num_used == 0


def test_reasks_wait_for_the_lookup_in_flight_and_stop_at_the_last_word(monkeypatch):
    engine, transfer, sender, clock = make_engine(monkeypatch)
    rid, _ = add_request(engine, clock)
    engine.step()
    clock.now += 3 * SAFETY_REASK
    engine.step()
    assert len(engine.signal.lookups) == 1  # the claim is not answered yet: nothing more goes
    engine.signal.answer(m.LookupResult(rid, S.NOT_READY))  # queued there
    engine.step()
    clock.now += SAFETY_REASK
    engine.step()
    assert _status(engine.signal.lookups[-1]) == [rid] and len(engine.signal.lookups) == 2
    engine.signal.answer(m.LookupResult(rid, S.NOT_READY))
    engine.signal.notify(facts(rid, S.READY, 12, first_token=42))
    engine.sched.batch_size = 0  # (no slot: it stays waiting, ready)
    engine.step()
    assert engine.sched.get(rid).ready and engine.sched.get(rid).state is RequestState.WAITING
    clock.now += 3 * SAFETY_REASK
    engine.step()
    assert len(engine.signal.lookups) == 2  # ready: prefill's answer is in, nothing to ask


def test_more_pulls_than_one_lookup_holds_are_all_sent(monkeypatch):
    n = m.MAX_ENTRIES + 100
    layout = replace(LAYOUT, num_blocks=2 * n)
    engine, transfer, sender, clock = make_engine(monkeypatch, batch_size=n, layout=layout)
    rids = [add_request(engine, clock)[0] for _ in range(n)]
    for rid in rids:
        engine.sched.mark_ready(rid, 42)  # (3 prompt tokens, 2 to decode: one block pulled, two held)
        seq = engine.sched.get(rid)
        seq.prompt_len, seq.final_len, seq.tail = 3, 5, (1, 2, 3)
    engine.step()
    pulled = [e.request_id for frame in engine.signal.lookups for e in frame if e.dest_blocks is not None]
    assert sorted(pulled) == sorted(rids) and len(pulled) == n
    assert all(len(frame) <= m.MAX_ENTRIES for frame in engine.signal.lookups)
    assert engine.lookups.pending_pulls == 0


def test_lookup_frames_fit_the_signal_planes_frame_cap():
    rid = "r" * m.MAX_REQUEST_ID_LEN
    big = [m.LookupEntry(rid, tuple(range(1 << 24, (1 << 24) + m.MAX_BLOCKS)), 0, new_secret())] * 20
    frames = lookup_frames(big + [m.LookupEntry(rid)] * 3000)
    assert [e for f in frames for e in f] == big + [m.LookupEntry(rid)] * 3000  # every entry, in order
    for frame in frames:
        assert len(frame) <= m.MAX_ENTRIES
        assert len(m.encode(1 << 30, m.LookupAll("d" * 512, tuple(frame)))) <= m.MAX_FRAME_BYTES
    assert FRAME_BUDGET < m.MAX_FRAME_BYTES
