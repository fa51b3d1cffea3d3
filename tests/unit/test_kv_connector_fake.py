"""A decode engine end to end over the in-process fake KV connector (no sockets, no transfer backend): a
request is claimed, pulled, its KV copied in from another pool by the test playing prefill, decoded to its
last token, and nothing is left. A receive that fails, and one aborted while its KV is on its way, end the
request and lose nothing; the bytes of an aborted one never land."""

from __future__ import annotations

from types import SimpleNamespace

from tests.unit.decode_harness import LAYOUT, PREFILL, S, Clock, LookupSignal, add_request, facts
from xpyd.decode_worker import batch as batch_module
from xpyd.decode_worker import engine as engine_module
from xpyd.decode_worker.engine import DecodeEngine
from xpyd.model.kv_pool import KVPool
from xpyd.model.sampling import TorchSampler
from xpyd.worker.config import WorkerConfig
from xpyd.worker.kv_connector import KVReceiver
from xpyd.worker.kv_connector_fake import FAKE_ADDRESS, FakeReceiver
from xpyd.worker.request import RequestState
from xpyd.worker.work_item import ErrorEvent, TokenEvent


def _engine(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(engine_module, "time", clock)
    monkeypatch.setattr(batch_module, "time", clock)
    monkeypatch.setattr(batch_module, "decode_and_sample", lambda runner, kv, running: [7] * len(running))
    link = FakeReceiver()
    runner = SimpleNamespace(pool=KVPool(LAYOUT), max_model_len=32, eos_token_ids=frozenset(), sampler=TorchSampler())
    engine = DecodeEngine(runner, None, WorkerConfig(role="decode", port=8100), link, "m")
    engine.signal = LookupSignal()
    return engine, link, clock


def _prefill_pool(blocks: list[int]) -> KVPool:
    """Prefill's pool, its ``blocks`` each filled with a value of its own."""
    pool = KVPool(LAYOUT)
    for i, b in enumerate(blocks):
        pool.tensor[b] = 100.0 + i
    return pool


def _pulled(engine: DecodeEngine, rid: str, num_tokens: int):
    """Claim ``rid``, answer READY with its facts: the engine pulls it (returns the pull's entry)."""
    engine.step()  # claimed
    engine.signal.answer(facts(rid, S.READY, num_tokens, first_token=5))
    engine.step()  # ready: blocks given, the receive announced, the pull sent
    (pull,) = [e for frame in engine.signal.lookups for e in frame if e.dest_blocks is not None]
    return pull


def test_the_engine_takes_the_fake_connector_and_names_itself_by_its_address(monkeypatch):
    engine, link, _ = _engine(monkeypatch)
    assert isinstance(link, KVReceiver) and engine.connector is link
    assert link.register().address == FAKE_ADDRESS


def test_a_request_pulled_through_the_fake_connector_decodes_to_its_end(monkeypatch):
    engine, link, clock = _engine(monkeypatch)
    rid, payload = add_request(engine, clock, max_tokens=3)
    pull = _pulled(engine, rid, 10)  # 2 full blocks and 2 tokens: 3 blocks
    seq = engine.sched.get(rid)
    assert seq.state is RequestState.TRANSFERRING and list(pull.dest_blocks) == list(seq.kv.blocks)
    assert pull.first_block == 0 and pull.part_blocks == 0 and len(pull.secret) == 32
    assert link.in_flight() == 1 and engine.stats()["transfers_in_flight"] == 1

    source = [4, 5, 6]
    prefill = _prefill_pool(source)
    assert not link.send(rid, prefill, source, b"x" * 32)  # a wrong secret moves nothing
    assert link.send(rid, prefill, source, pull.secret)
    dest = list(pull.dest_blocks)
    for s, d in zip(source, dest):
        assert bool((engine.pool.tensor[d] == prefill.tensor[s]).all())
    engine.step()  # landed: joins the batch and decodes its second token
    assert link.in_flight() == 0 and link.received == [rid]
    engine.step()  # the third: max_tokens reached
    assert payload.output.token_ids == [5, 7, 7]
    assert isinstance(payload.sink.events[-1], TokenEvent) and payload.sink.events[-1].finish_reason == "length"
    engine.sched.check_invariants()
    assert not engine.sched.has_work() and engine.pool.num_used == 0 and engine.stats()["pulls"] == {PREFILL: 1}


def test_a_receive_the_fake_connector_fails_fails_the_request(monkeypatch):
    engine, link, clock = _engine(monkeypatch)
    rid, payload = add_request(engine, clock)
    _pulled(engine, rid, 8)
    link.fail(rid, "sender connection lost mid-transfer")
    engine.step()
    (event,) = payload.sink.events
    assert isinstance(event, ErrorEvent) and event.status == 502 and event.kv_path
    assert event.message == "KV transfer failed: sender connection lost mid-transfer"
    assert engine.signal.released == [rid] and engine.stats()["failures"] == {"transfer": 1}
    assert not engine.sched.has_work() and engine.pool.num_used == 0 and link.in_flight() == 0


def test_an_aborted_receive_takes_no_bytes(monkeypatch):
    engine, link, clock = _engine(monkeypatch)
    rid, payload = add_request(engine, clock)
    pull = _pulled(engine, rid, 8)
    engine._abort(rid)  # the client went away while its KV was on its way
    before = bytes(engine.pool.buffer())
    assert not link.send(rid, _prefill_pool([0, 1]), [0, 1], pull.secret)
    assert bytes(engine.pool.buffer()) == before and link.received == []
    engine.step()
    assert payload.sink.events == [] and engine.signal.released == [rid]
    assert not engine.sched.has_work() and engine.pool.num_used == 0 and link.in_flight() == 0
