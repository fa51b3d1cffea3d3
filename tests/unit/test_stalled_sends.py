"""A KV send to a decode worker is aborted, and its blocks freed, when that worker's signal session ends (its
connection closed, or answered no ZMTP heartbeat for ``peer_timeout``: a cut link), whatever the transfer
backend's connection does meanwhile (a cut link leaves a tcp send waiting for acknowledgements that never
come); not because the worker sent nothing for a while (its engine thread may be starved on a loaded machine);
a decode worker that left the cluster and is listed again is a peer like any other. The prefill engine is
stepped by hand with fake backends; its clock is the argument of ``_expire``. Across real hosts with a real
cut: tests/multihost/test_network_faults.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

from tests.unit.kv_fixtures import next_prefill
from xpyd.model.sampling import TorchSampler
from xpyd.model.kv_pool import KVLayout, KVPool
from xpyd.prefill_worker.engine import PrefillEngine
from xpyd.prefill_worker.scheduler import PrefillSeq
from xpyd.signal import messages as m
from xpyd.signal.request_id import RequestId, transfer_id_of
from xpyd.transfer.auth import new_secret
from xpyd.transfer.fake import FakeNetwork, FakeTransferBackend
from xpyd.worker.config import WorkerConfig

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", num_blocks=6, block_size=4)
PREFILL, DECODE = "127.0.0.1:7000", "127.0.0.1:7001"
PEER_TIMEOUT = 3.0


def _sending_engine():
    """A prefill engine with one request whose KV send to DECODE is in flight (the fake never finishes it)."""
    runner = SimpleNamespace(pool=KVPool(LAYOUT), max_model_len=8, eos_token_ids=frozenset(), sampler=TorchSampler())
    net = FakeNetwork()
    transfer, decode_side = FakeTransferBackend(net), FakeTransferBackend(net)
    engine = PrefillEngine(runner, None, WorkerConfig(role="prefill", port=8100, peer_timeout=PEER_TIMEOUT),
                           transfer, "m")
    pushed: list[tuple[str, m.Message]] = []
    engine.notify = lambda peer, msg: pushed.append((peer, msg))
    transfer.register(engine.pool.buffer())
    decode_desc = decode_side.register(memoryview(bytearray(LAYOUT.total_bytes)))
    rid = str(RequestId.new(PREFILL, DECODE))
    payload = SimpleNamespace(output=SimpleNamespace(finished=None))
    engine.sched.add(PrefillSeq(rid, [1, 2, 3], payload=payload, peer=DECODE))
    engine.sched.prefilled(next_prefill(engine.sched), 42, time.monotonic())
    assert engine.on_handshake(DECODE, m.Handshake(DECODE, "m", engine.peer_compat())).ok
    init = m.KVMapInit(DECODE, decode_desc.to_dict(), LAYOUT.block_bytes, LAYOUT.num_blocks)
    assert engine.on_kv_map_init(DECODE, init).ok
    claim = engine.on_lookup_all(DECODE, m.LookupAll(DECODE, (m.LookupEntry(rid, None),)))
    assert claim.results[0].status is m.LookupStatus.READY
    secret = new_secret()
    reply = engine.on_lookup_all(DECODE, m.LookupAll(DECODE, (m.LookupEntry(rid, (0,), 0, secret),)))
    assert reply.results[0].status is m.LookupStatus.SENDING
    assert engine.pool.num_used > 0 and transfer.outstanding() == {transfer_id_of(rid)}
    return engine, transfer, rid, pushed


def test_a_send_to_a_decode_worker_whose_session_ended_is_aborted_and_its_blocks_freed():
    engine, transfer, rid, pushed = _sending_engine()
    heard = engine._peers.last_heard(DECODE)
    with engine._lock:
        engine._expire(heard + 10 * PEER_TIMEOUT)  # quiet for long, its session open: the send goes on
    assert transfer.outstanding() == {transfer_id_of(rid)} and engine.sched.num_transferring == 1
    engine.on_session_closed(DECODE, "no ZMTP heartbeat answered for 3s")
    assert transfer.outstanding() == set()  # aborted in the backend: no byte of it is read any more
    engine.step()  # its token is polled: the request ends and its blocks are free
    assert engine.sched.num_transferring == 0 and engine.pool.num_used == 0
    assert engine.on_handshake(DECODE, m.Handshake(DECODE, "m", engine.peer_compat())).ok  # its next session
    reply = engine.on_lookup_all(DECODE, m.LookupAll(DECODE, (m.LookupEntry(rid, None),)))
    (result,) = reply.results
    assert result.status is m.LookupStatus.FAILED and "signal session ended" in result.error
    transfer.close()


def test_a_send_to_a_quiet_decode_worker_with_its_session_open_is_left_alone():
    engine, transfer, rid, _ = _sending_engine()
    t0 = engine._peers.last_heard(DECODE)
    for dt in (2.0, 40.0, 400.0):  # nothing heard from it, its connection answers the server's pings
        with engine._lock:
            engine._expire(t0 + dt)
        engine.step()
    assert transfer.outstanding() == {transfer_id_of(rid)} and engine.sched.num_transferring == 1
    transfer.close()


def test_a_decode_worker_listed_again_after_it_left_is_a_peer_like_any_other():
    """Cut off from etcd, a decode worker's lease expires and discovery says it left: the KV it has not
    pulled then expires after a short grace. Registered again (same address, no new handshake: its
    signal-plane connection never broke), it is back for good, not for the rest of kv_ttl."""
    engine, transfer, _, _ = _sending_engine()
    engine.peers_left({DECODE})
    engine.step()
    assert engine._peers.left_at(DECODE) is not None
    assert engine._peers.live() == 0
    engine.peers_left(set(), {DECODE})  # listed again
    engine.step()
    assert engine._peers.left_at(DECODE) is None
    assert engine._peers.live() == 1
    transfer.close()
