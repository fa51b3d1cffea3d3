"""Each role engine fails just the request whose work raised: its blocks released through the scheduler's fail
path, a 500 on its sink, the peer told; the other requests in the same step go on. Engines are stepped
by hand (no engine thread) with a fake transfer backend that refuses chosen transfers; every test ends
with a leak check."""

from __future__ import annotations

import time
from types import SimpleNamespace

from tests.unit.fake_signal import FakeSignal, ready
from tests.unit.kv_fixtures import next_prefill
from tests.unit.decode_harness import WORK_ITEM_RESUME
from xpyd.model.sampling import TorchSampler
from xpyd.colocated_worker.engine import ColocatedEngine
from xpyd.colocated_worker.scheduler import ColocatedSeq
from xpyd.decode_worker.engine import DecodeEngine
from xpyd.decode_worker.seq import DecodeSeq
from xpyd.model.kv_pool import KVLayout, KVPool
from xpyd.prefill_worker.engine import PrefillEngine
from xpyd.prefill_worker.scheduler import PrefillSeq
from xpyd.signal import messages as m
from xpyd.signal.request_id import RequestId, transfer_id_of
from xpyd.transfer.base import TransferError
from xpyd.transfer.auth import new_secret
from xpyd.transfer.fake import FakeNetwork, FakeTransferBackend
from xpyd.worker.config import WorkerConfig
from xpyd.worker.work_item import ErrorEvent
from xpyd.worker.phases import PhaseStamps

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", num_blocks=6, block_size=4)
PREFILL, DECODE = "127.0.0.1:7000", "127.0.0.1:7001"
S = m.LookupStatus


def _runner():
    return SimpleNamespace(pool=KVPool(LAYOUT), max_model_len=8, eos_token_ids=frozenset(), sampler=TorchSampler())


class _Sink:
    def __init__(self) -> None:
        self.events: list = []
        self.ended = False

    def put(self, event) -> None:
        self.events.append(event)


class _Refusing(FakeTransferBackend):
    """Raises on ``send``/``expect`` for the transfer ids in ``refused``."""

    def __init__(self, network: FakeNetwork | None = None) -> None:
        super().__init__(network)
        self.refused: set[str] = set()

    def send(self, transfer_id, src, peer, dst, *, secret):
        if transfer_id in self.refused:
            raise TransferError(f"cannot send {transfer_id}")
        return super().send(transfer_id, src, peer, dst, secret=secret)

    def expect(self, transfer_id, dst, *, secret):
        if transfer_id in self.refused:
            raise TransferError(f"cannot expect {transfer_id}")
        return super().expect(transfer_id, dst, secret=secret)


def _failed_count(engine) -> float:
    return engine.metrics.registry.get_sample_value("xpyd_requests_total",
                                                    {"role": engine.config.role, "outcome": "failed"})


def _internal_error(sink: _Sink, role: str, exc: str) -> bool:
    return (len(sink.events) == 1 and isinstance(sink.events[0], ErrorEvent) and sink.events[0].status == 500
            and f"internal error in the {role} worker: {exc}" in sink.events[0].message)


def test_prefill_a_send_that_cannot_start_fails_just_its_request():
    net = FakeNetwork()
    transfer, decode_side = _Refusing(net), FakeTransferBackend(net)
    engine = PrefillEngine(_runner(), None, WorkerConfig(role="prefill", port=8100), transfer, "m")
    pushed: list[m.Notify] = []
    engine.notify = lambda peer, msg: pushed.append(msg)
    transfer.register(engine.pool.buffer())
    desc = decode_side.register(memoryview(bytearray(LAYOUT.total_bytes)))
    assert engine.on_handshake(DECODE, m.Handshake(DECODE, "m", engine.peer_compat())).ok
    assert engine.on_kv_map_init(DECODE, m.KVMapInit(DECODE, desc.to_dict(), LAYOUT.block_bytes, LAYOUT.num_blocks)).ok
    rids = [str(RequestId.new(PREFILL, DECODE)) for _ in range(2)]
    sinks = {rid: _Sink() for rid in rids}
    for rid in rids:  # prefilled, KV held, claimed by the decode worker
        payload = SimpleNamespace(sink=sinks[rid], output=SimpleNamespace(finished=None))
        engine.sched.add(PrefillSeq(rid, [1, 2, 3], payload=payload, peer=DECODE, claimed=True))
        engine.sched.prefilled(next_prefill(engine.sched), 42, time.monotonic())
    bad, good = rids
    transfer.refused.add(transfer_id_of(bad))

    entries = (m.LookupEntry(bad, (0,), 0, new_secret()), m.LookupEntry(good, (1,), 0, new_secret()))
    reply = engine.on_lookup_all(DECODE, m.LookupAll(DECODE, entries))
    assert [r.status for r in reply.results] == [S.FAILED, S.SENDING]
    assert "TransferError: cannot send" in reply.results[0].error
    assert _internal_error(sinks[bad], "prefill", "TransferError") and sinks[good].events == []
    assert [(r.request_id, r.status) for n in pushed for r in n.results] == [(bad, S.FAILED)]  # its claimant told
    assert engine.sched.get(bad) is None and engine.pool.num_used == 1 and _failed_count(engine) == 1
    again = engine.on_lookup_all(DECODE, m.LookupAll(DECODE, (m.LookupEntry(bad, (0,), 0, new_secret()),))).results[0]
    assert again.status is S.FAILED and "TransferError" in again.error  # remembered as failed here

    transfer.complete(transfer_id_of(good))
    engine.step()
    engine.sched.check_invariants()
    assert not engine.sched.has_work() and engine.pool.num_used == 0 and _failed_count(engine) == 1
    transfer.close()


class _Output:
    def __init__(self, broken: bool) -> None:
        self.broken = broken
        self.token_ids: list[int] = []

    def append(self, token: int):
        if self.broken:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        self.token_ids.append(token)
        return "", None


def _decode_engine():
    transfer = _Refusing()
    engine = DecodeEngine(_runner(), None, WorkerConfig(role="decode", port=8100), transfer, "m")
    transfer.register(engine.pool.buffer())
    engine.signal = FakeSignal()
    return engine, transfer


def _decode_request(engine, broken_output: bool = False) -> tuple[str, _Sink]:
    rid, sink = str(RequestId.new(PREFILL, DECODE)), _Sink()
    payload = SimpleNamespace(stamps=PhaseStamps(),
                              arrival=time.monotonic(), sink=sink, sampling=SimpleNamespace(temperature=0),
                              output=_Output(broken_output), open_ended=False, stop=SimpleNamespace(max_tokens=4),
                              cache_salt=None, prompt_ids=[], start_output=lambda tokenizer, sampler: None,  # (keeps its output)
                              grammar=None, take_logprobs=lambda: (), **WORK_ITEM_RESUME)
    engine.sched.add(DecodeSeq(rid, PREFILL, prompt_len=3, payload=payload, deadline=time.monotonic() + 60))
    return rid, sink


def test_decode_a_pull_that_cannot_start_fails_just_its_request():
    engine, transfer = _decode_engine()
    (bad, bad_sink), (good, good_sink) = _decode_request(engine), _decode_request(engine)
    for rid in (bad, good):
        engine.sched.mark_ready(rid, 42)
    transfer.refused.add(transfer_id_of(bad))
    engine.step()  # gives both a slot; announcing the first one's receive raises
    assert _internal_error(bad_sink, "decode", "TransferError: cannot expect") and good_sink.events == []
    assert engine.signal.released == [bad]  # its prefill worker drops the KV
    assert engine.sched.get(bad) is None and transfer.expected == [transfer_id_of(good)]
    assert engine.pool.num_used == 1 and engine.stats()["failures"] == {"internal": 1}

    engine._abort(good)
    engine.step()
    engine.sched.check_invariants()
    assert not engine.sched.has_work() and engine.pool.num_used == 0 and transfer.outstanding() == set()
    transfer.close()


def test_decode_a_notify_entry_that_raises_fails_just_its_request():
    engine, transfer = _decode_engine()
    (bad, bad_sink), (good, good_sink) = _decode_request(engine, broken_output=True), _decode_request(engine)
    results = tuple(ready(rid, 42, 3) for rid in (bad, good))
    engine.signal.replies = [(PREFILL, m.Notify(results))]
    engine.step()
    assert _internal_error(bad_sink, "decode", "UnicodeDecodeError") and good_sink.events == []
    assert engine.sched.get(bad) is None and engine.signal.released == [bad]
    assert engine.sched.get(good).ready and transfer.expected == [transfer_id_of(good)]  # its pull started
    assert _failed_count(engine) == 1

    engine._abort(good)
    engine.step()
    assert not engine.sched.has_work() and engine.pool.num_used == 0 and transfer.outstanding() == set()
    transfer.close()


def test_colocated_fails_a_waiting_or_running_request_and_frees_its_slot():
    engine = ColocatedEngine(_runner(), None, WorkerConfig(role="colocated", port=8100), "m")
    sinks = [_Sink(), _Sink()]
    running, waiting = (ColocatedSeq(str(RequestId.new(PREFILL, DECODE)), [1, 2], payload=SimpleNamespace(sink=s))
                        for s in sinks)
    engine.sched.add(running)
    engine.sched.add(waiting)
    assert engine.sched.next_prefill() is running and engine.pool.num_used == 1
    assert not engine.fail_held(running.request_id, SimpleNamespace(sink=_Sink()), "x")  # another request's item
    for seq, sink in zip((running, waiting), sinks):
        assert engine.fail_held(seq.request_id, None, "internal error in the colocated worker: E: x")
        assert _internal_error(sink, "colocated", "E: x")
    engine.sched.check_invariants()
    assert not engine.sched.has_work() and engine.pool.num_used == 0 and _failed_count(engine) == 2
