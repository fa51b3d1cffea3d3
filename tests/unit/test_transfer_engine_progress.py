"""Both engines call the transfer backend's ``progress()`` every loop iteration while one of their
transfers is in flight. A backend whose threads move the bytes (``progress_tick`` None) lets the engine
sleep until the transfer's token finishes, which wakes it; one that needs its ``progress()`` called (nixl)
is called every ``progress_tick``. With none in flight they neither call it nor wake early. Engines are
stepped by hand (no engine thread), with a fake backend that counts calls.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from tests.unit.fake_signal import FakeSignal
from tests.unit.kv_fixtures import next_prefill
from xpyd.model.sampling import TorchSampler
from xpyd.decode_worker.engine import DecodeEngine
from xpyd.decode_worker.seq import DecodeSeq
from xpyd.worker.config import WorkerConfig
from xpyd.model.kv_pool import KVLayout, KVPool
import os

import pytest

from xpyd.worker.loop import IDLE_SLEEP
from xpyd.prefill_worker.engine import PrefillEngine
from xpyd.prefill_worker.scheduler import PrefillSeq
from xpyd.signal import messages as m
from xpyd.signal.request_id import RequestId, transfer_id_of
from xpyd.transfer.auth import new_secret
from xpyd.transfer.fake import FakeNetwork, FakeTransferBackend
from xpyd.worker.phases import PhaseStamps

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", num_blocks=6, block_size=4)
PREFILL, DECODE = "127.0.0.1:7000", "127.0.0.1:7001"


def _runner():
    return SimpleNamespace(pool=KVPool(LAYOUT), max_model_len=8, eos_token_ids=frozenset(), sampler=TorchSampler())


TICK = 0.001


def _woken(engine) -> bool:
    """Did something post to the engine (its wake pipe has a byte)? Consumes the wake."""
    try:
        return bool(os.read(engine.wake_fd, 4096))
    except BlockingIOError:
        return False


@pytest.mark.parametrize("tick", [None, TICK])
def test_prefill_engine_drives_progress_while_a_send_is_in_flight(tick):
    net = FakeNetwork()
    transfer, decode_side = FakeTransferBackend(net), FakeTransferBackend(net)
    transfer.progress_tick = tick
    engine = PrefillEngine(_runner(), None, WorkerConfig(role="prefill", port=8100), transfer, "m")
    transfer.register(engine.pool.buffer())
    decode_desc = decode_side.register(memoryview(bytearray(LAYOUT.total_bytes)))
    assert engine.step() == IDLE_SLEEP and transfer.progress_calls == 0

    rid = str(RequestId.new(PREFILL, DECODE))
    engine.sched.add(PrefillSeq(rid, [1, 2, 3], peer=DECODE))
    engine.sched.prefilled(next_prefill(engine.sched), 42, time.monotonic())  # (its forward pass: not tested here)
    assert engine.step() == IDLE_SLEEP and transfer.progress_calls == 0  # KV held, nobody pulls yet
    # The decode worker pulls it, through the signal plane's handlers.
    assert engine.on_handshake(DECODE, m.Handshake(DECODE, "m", engine.peer_compat())).ok
    init = m.KVMapInit(DECODE, decode_desc.to_dict(), LAYOUT.block_bytes, LAYOUT.num_blocks)
    assert engine.on_kv_map_init(DECODE, init).ok
    reply = engine.on_lookup_all(DECODE, m.LookupAll(DECODE, (m.LookupEntry(rid, (0,), 0, new_secret()),)))
    assert reply.results[0].status is m.LookupStatus.SENDING
    for calls in (1, 2, 3):
        assert engine.step() == (IDLE_SLEEP if tick is None else tick) and transfer.progress_calls == calls

    _woken(engine)
    transfer.complete(transfer_id_of(rid))
    assert _woken(engine)  # the finished send wakes the loop
    engine.step()  # sees the send finish
    calls = transfer.progress_calls
    assert engine.step() == IDLE_SLEEP and transfer.progress_calls == calls
    assert engine.sched.num_transferring == 0 and engine.pool.num_used == 0  # nothing left behind
    transfer.close()


@pytest.mark.parametrize("tick", [None, TICK])
def test_decode_engine_drives_progress_while_a_pull_is_in_flight(tick):
    transfer = FakeTransferBackend()
    transfer.progress_tick = tick
    engine = DecodeEngine(_runner(), None, WorkerConfig(role="decode", port=8100), transfer, "m")
    transfer.register(engine.pool.buffer())
    engine.signal = signal = FakeSignal()
    engine.step()
    assert signal.timeouts[-1] == IDLE_SLEEP * 1000 and transfer.progress_calls == 0

    rid = str(RequestId.new(PREFILL, DECODE))
    payload = SimpleNamespace(stamps=PhaseStamps(), arrival=time.monotonic())
    engine.sched.add(DecodeSeq(rid, PREFILL, prompt_len=3, payload=payload, deadline=time.monotonic() + 60))
    engine.sched.mark_ready(rid, 42)  # (prefill's lookup reply is not this test's subject)
    engine.step()  # gives it a slot and announces the receive
    assert transfer.expected == [transfer_id_of(rid)]
    for _ in range(3):
        calls = transfer.progress_calls
        engine.step()
        expected = IDLE_SLEEP * 1000 if tick is None else tick * 1000
        assert signal.timeouts[-1] == expected and transfer.progress_calls == calls + 1

    _woken(engine)
    transfer.fail(transfer_id_of(rid), "test: the pull ends")  # finishing the token wakes the loop
    assert _woken(engine)
    engine._abort(rid)  # the client went away: the receive is cancelled
    assert signal.released == [rid]
    calls = transfer.progress_calls
    engine.step()
    assert signal.timeouts[-1] == IDLE_SLEEP * 1000 and transfer.progress_calls == calls
    assert engine.sched.num_transferring == 0 and engine.pool.num_used == 0 and transfer.outstanding() == set()
    transfer.close()


def test_a_decode_step_that_took_posted_work_polls_without_waiting():
    """What the inbox brought is acted on after the step's signal poll (a new request's claim goes out then):
    that poll must not sleep IDLE_SLEEP first. An idle decode worker sent every claim 50 ms late, so token 2
    of every request at low load waited 50 ms for prefill's word however fast prefill was."""
    from xpyd.worker.engine import Abort

    transfer = FakeTransferBackend()
    engine = DecodeEngine(_runner(), None, WorkerConfig(role="decode", port=8100), transfer, "m")
    transfer.register(engine.pool.buffer())
    engine.signal = signal = FakeSignal()
    engine.step()
    assert signal.timeouts[-1] == IDLE_SLEEP * 1000  # (idle: nothing posted, nothing to do)
    engine.post(Abort(str(RequestId.new(PREFILL, DECODE))))
    engine.step()
    assert signal.timeouts[-1] == 0
    engine.step()
    assert signal.timeouts[-1] == IDLE_SLEEP * 1000
    transfer.close()
