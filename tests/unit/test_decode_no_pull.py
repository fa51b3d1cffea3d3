"""A request whose first token is its last (max_tokens 1, given or left to an open-ended request by the
context) needs no KV on decode: prefill's first token ends it. Told "prefilling" first, decode does not
pull it while its prompt computes (its KV would move for nothing); it ends when the first token arrives,
and prefill is told to drop the KV. Only max_tokens makes this certain: an eos or a stop string in the
first token cannot be known before it. Decode engine stepped by hand (decode_harness)."""

from __future__ import annotations

import pytest

from tests.unit.decode_harness import S, add_request, facts, make_engine
from xpyd.signal.client import PeerState
from xpyd.worker.request import RequestState
from xpyd.worker.work_item import TokenEvent


def _pulls(engine) -> list[str]:
    return [e.request_id for frame in engine.signal.lookups for e in frame if e.dest_blocks is not None]


@pytest.mark.parametrize("max_tokens, open_ended, prompt", [
    (1, False, 12),
    (31, True, 31),  # open-ended: the context (32) leaves room for one token after the prompt
])
def test_a_request_ending_on_its_first_token_is_never_pulled(monkeypatch, max_tokens, open_ended, prompt):
    engine, transfer, sender, clock = make_engine(monkeypatch)
    rid, payload = add_request(engine, clock, max_tokens=max_tokens, open_ended=open_ended)
    engine.step()  # claimed
    engine.signal.answer(facts(rid, S.PREFILLING, prompt, part_blocks=1))
    engine.step()
    engine.step()
    seq = engine.sched.get(rid)
    assert seq.known and payload.stop.max_tokens == 1
    assert seq.state is RequestState.WAITING and _pulls(engine) == [] and transfer.expected == []
    assert engine.pool.num_used == 0
    engine.signal.notify(facts(rid, S.READY, prompt, first_token=42))
    engine.step()
    assert payload.output.token_ids == [42]
    (event,) = payload.sink.events
    assert isinstance(event, TokenEvent) and event.finish_reason == "length"
    assert engine.signal.released == [rid]  # prefill drops the KV
    assert _pulls(engine) == [] and transfer.expected == [] and engine.stats()["pulls"] == {}
    assert not engine.sched.has_work() and engine.pool.num_used == 0 and transfer.outstanding() == set()


def test_a_request_with_a_token_left_to_decode_is_pulled_while_its_prompt_computes(monkeypatch):
    engine, transfer, sender, clock = make_engine(monkeypatch)
    rid, payload = add_request(engine, clock, max_tokens=2)
    engine.step()
    engine.signal.answer(facts(rid, S.PREFILLING, 12, part_blocks=1))
    engine.step()
    assert _pulls(engine) == [rid] and engine.sched.get(rid).state is RequestState.TRANSFERRING
    engine._abort(rid)
    engine.step()
    assert not engine.sched.has_work() and engine.pool.num_used == 0 and transfer.outstanding() == set()


def test_a_release_while_the_connection_to_prefill_is_being_made_goes_once_it_is_ready(monkeypatch):
    """The proxy hangs up on decode as soon as prefill's first token ended the request, before decode's
    first connection to that prefill worker is ready: the release goes when it is, not never (the KV would
    wait there for kv_ttl)."""
    engine, transfer, sender, clock = make_engine(monkeypatch)
    engine.signal.prefill.state = PeerState.HANDSHAKING
    rid, payload = add_request(engine, clock, max_tokens=1)
    engine.step()
    engine._abort(rid)
    engine.step()
    assert engine.signal.released == [] and engine.signal.lookups == [] and not engine.sched.has_work()
    engine.signal.prefill.state = PeerState.READY
    engine.step()
    assert engine.signal.released == [rid]
    assert engine.signal.lookups == []  # (nothing to claim: the request is gone)
    engine.step()
    assert engine.signal.released == [rid]  # once
