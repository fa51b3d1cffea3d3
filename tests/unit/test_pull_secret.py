"""A transfer's secret travels in its pull: the decode engine expects each receive with a fresh secret and
sends that secret, and only it, to the prefill worker in the pull; the prefill engine starts the send with
the secret it got. Engines stepped by hand with fake backends and a recording signal client (the real
signal plane carrying it, and refusing a pull without one: tests/integration/test_signal_plane.py; the
listeners refusing anyone without it: tests/integration/test_transfer_door.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from tests.unit.fake_signal import FakeSignal
from tests.unit.kv_fixtures import next_prefill
from xpyd import TRANSFER_SECRET_BYTES
from xpyd.model.sampling import TorchSampler
from xpyd.decode_worker.engine import DecodeEngine
from xpyd.decode_worker.seq import DecodeSeq
from xpyd.model.kv_pool import KVLayout, KVPool
from xpyd.prefill_worker.engine import PrefillEngine
from xpyd.prefill_worker.scheduler import PrefillSeq
from xpyd.signal import messages as m
from xpyd.signal.client import PeerState
from xpyd.signal.request_id import RequestId, transfer_id_of
from xpyd.transfer.auth import new_secret
from xpyd.transfer.fake import FakeNetwork, FakeTransferBackend
from xpyd.worker.config import WorkerConfig
from xpyd.worker.phases import PhaseStamps

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", num_blocks=6, block_size=4)
PREFILL, DECODE = "127.0.0.1:7000", "127.0.0.1:7001"


def _runner():
    return SimpleNamespace(pool=KVPool(LAYOUT), max_model_len=8, eos_token_ids=frozenset(), sampler=TorchSampler())


class RecordingSignal(FakeSignal):
    """Every prefill peer is connected and idle; the lookups sent are recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.lookups: list[tuple[str, list[m.LookupEntry]]] = []

    def get(self, addr: str):
        return SimpleNamespace(state=PeerState.READY, lookup_in_flight=False, proved=None)

    def send_lookup(self, addr: str, entries: list[m.LookupEntry]) -> None:
        self.lookups.append((addr, list(entries)))


def test_decode_sends_each_pull_the_fresh_secret_its_receive_expects():
    transfer = FakeTransferBackend()
    engine = DecodeEngine(_runner(), None, WorkerConfig(role="decode", port=8100), transfer, "m")
    transfer.register(engine.pool.buffer())
    engine.signal = signal = RecordingSignal()
    rids = [str(RequestId.new(PREFILL, DECODE)) for _ in range(2)]
    for rid in rids:
        engine.sched.add(DecodeSeq(rid, PREFILL, prompt_len=3, payload=SimpleNamespace(stamps=PhaseStamps(),
                                                                                       arrival=time.monotonic()),
                                   deadline=time.monotonic() + 60))
        engine.sched.mark_ready(rid, 42)  # (prefill's ready is not this test's subject)
    engine.step()  # slots for both: their receives are expected and their pulls sent
    pulls = [e for addr, entries in signal.lookups for e in entries if e.dest_blocks is not None]
    assert [e.request_id for e in pulls] == rids and {addr for addr, _ in signal.lookups} == {PREFILL}
    for e in pulls:
        assert len(e.secret) == TRANSFER_SECRET_BYTES and e.secret == transfer.secrets[transfer_id_of(e.request_id)]
    assert pulls[0].secret != pulls[1].secret  # one per transfer
    claims = [e for _, entries in signal.lookups for e in entries if e.dest_blocks is None]
    assert all(e.secret is None for e in claims)  # (a claim moves nothing: it carries none)
    transfer.close()


def test_prefill_sends_with_the_secret_the_pull_carried():
    net = FakeNetwork()
    transfer, decode_side = FakeTransferBackend(net), FakeTransferBackend(net)
    engine = PrefillEngine(_runner(), None, WorkerConfig(role="prefill", port=8100), transfer, "m")
    transfer.register(engine.pool.buffer())
    decode_desc = decode_side.register(memoryview(bytearray(LAYOUT.total_bytes)))
    rid = str(RequestId.new(PREFILL, DECODE))
    engine.sched.add(PrefillSeq(rid, [1, 2, 3]))
    engine.sched.prefilled(next_prefill(engine.sched), 42, time.monotonic())
    assert engine.on_handshake(DECODE, m.Handshake(DECODE, "m", engine.peer_compat())).ok
    init = m.KVMapInit(DECODE, decode_desc.to_dict(), LAYOUT.block_bytes, LAYOUT.num_blocks)
    assert engine.on_kv_map_init(DECODE, init).ok
    secret = new_secret()
    reply = engine.on_lookup_all(DECODE, m.LookupAll(DECODE, (m.LookupEntry(rid, (0,), 0, secret),)))
    assert reply.results[0].status is m.LookupStatus.SENDING
    assert transfer.sent == [transfer_id_of(rid)] and transfer.secrets[transfer_id_of(rid)] == secret
    transfer.abort(transfer_id_of(rid))
    engine.step()
    assert engine.sched.num_transferring == 0 and engine.pool.num_used == 0
    transfer.close()
