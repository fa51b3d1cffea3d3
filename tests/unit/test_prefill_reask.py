"""A prefill worker answers a decode worker's re-ask about a request it already sent: its READY push may have
been lost on the way (a streamed pull started while the prompt computed, so decode has the KV but not the
first token), and once the send ended the request is no longer held. The re-ask is answered with how the
request ended here (SENDING, the first token), so decode goes on with it instead of failing it. Prefill
engine stepped by hand (no engine thread, no model: every prompt's first token is 42), fake transfers."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tests.unit.decode_harness import WORK_ITEM_RESUME
from xpyd.model.sampling import TorchSampler
from xpyd.model.kv_pool import KVLayout, KVPool
from xpyd.prefill_worker import engine as engine_module
from xpyd.prefill_worker.engine import PrefillEngine
from xpyd.prefill_worker.scheduler import PrefillSeq
from xpyd.signal import messages as m
from xpyd.signal.request_id import RequestId, part_transfer_ids, transfer_id_of
from xpyd.transfer.auth import new_secret
from xpyd.transfer.fake import FakeNetwork, FakeTransferBackend
from xpyd.worker.config import WorkerConfig
from xpyd.worker.phases import PhaseStamps

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", num_blocks=8, block_size=4)
PREFILL, DECODE = "127.0.0.1:7000", "127.0.0.1:7001"
S = m.LookupStatus
FIRST = 42


class _Output:
    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.finished = None

    def append(self, token: int):
        self.token_ids.append(token)
        return "t", None


class _Sink:
    def __init__(self) -> None:
        self.events: list = []
        self.ended = False

    def put(self, event) -> None:
        self.events.append(event)


@pytest.fixture
def prefill(monkeypatch):
    """(engine, its fake transfer backend, the pushes it made); a decode worker has shaken hands and
    registered its pool. Prompts run in chunks of one block, their KV streamed."""
    monkeypatch.setattr(engine_module, "prefill_chunks", lambda runner, chunks: [None] * len(chunks))
    monkeypatch.setattr(engine_module, "sample_first", lambda runner, last: [FIRST] * len(last))
    net = FakeNetwork()
    transfer, decode_side = FakeTransferBackend(net), FakeTransferBackend(net)
    runner = SimpleNamespace(pool=KVPool(LAYOUT), max_model_len=32, eos_token_ids=frozenset(), sampler=TorchSampler())
    config = WorkerConfig(role="prefill", port=8100, prefill_chunk=LAYOUT.block_size)
    engine = PrefillEngine(runner, None, config, transfer, "m")
    pushed: list[m.LookupResult] = []
    engine.notify = lambda peer, msg: pushed.extend(msg.results)
    transfer.register(engine.pool.buffer())
    desc = decode_side.register(memoryview(bytearray(LAYOUT.total_bytes)))
    assert engine.on_handshake(DECODE, m.Handshake(DECODE, "m", engine.peer_compat())).ok
    assert engine.on_kv_map_init(DECODE, m.KVMapInit(DECODE, desc.to_dict(), LAYOUT.block_bytes,
                                                     LAYOUT.num_blocks)).ok
    yield engine, transfer, pushed
    transfer.close()
    decode_side.close()


def _add(engine: PrefillEngine, prompt: list[int]) -> str:
    rid = str(RequestId.new(PREFILL, DECODE))
    payload = SimpleNamespace(stamps=PhaseStamps(), arrival=time.monotonic(), sink=_Sink(), output=_Output(),
                              take_logprobs=lambda: (), **WORK_ITEM_RESUME)
    engine.sched.add(PrefillSeq(rid, prompt, payload=payload, peer=DECODE, hashes=engine.kv_cache.hashes(prompt)))
    return rid


def _ask(engine: PrefillEngine, *entries: m.LookupEntry) -> list[m.LookupResult]:
    return list(engine.on_lookup_all(DECODE, m.LookupAll(DECODE, entries)).results)


def test_a_reask_after_the_send_ended_gets_the_first_token_its_lost_ready_push_carried(prefill):
    engine, transfer, pushed = prefill
    rid = _add(engine, list(range(1, 9)))  # two blocks: two chunks
    (claim,) = _ask(engine, m.LookupEntry(rid))
    assert claim.status is S.NOT_READY and engine.sched.get(rid).claimed
    engine.step()  # the first chunk: its decode worker is told the prompt's facts
    assert [(r.request_id, r.status) for r in pushed] == [(rid, S.PREFILLING)]
    (pull,) = _ask(engine, m.LookupEntry(rid, (3, 5), 0, new_secret(), part_blocks=1))  # pulled as it computes
    assert pull.status is S.PREFILLING and transfer.sent == part_transfer_ids(rid, 2)[:1]
    engine.notify = lambda peer, msg: None  # the READY push is lost on the way
    engine.step()  # the last chunk: the first token; the last part goes
    assert transfer.sent == part_transfer_ids(rid, 2)
    for tid in transfer.sent:
        transfer.complete(tid)
    engine.step()  # the send ended: the request is no longer held here
    assert engine.sched.get(rid) is None and not engine.sched.has_work()
    assert engine.stats()["transfers_in_flight"] == 0

    (again,) = _ask(engine, m.LookupEntry(rid))  # decode's safety re-ask
    assert (again.status, again.first_token, again.num_tokens, again.error) == (S.SENDING, FIRST, 8, None)
    assert _ask(engine, m.LookupEntry(rid)) == [again]  # (as often as it asks, while remembered)


def test_a_request_sent_whole_is_answered_the_same_after_its_send(prefill):
    engine, transfer, pushed = prefill
    rid = _add(engine, [1, 2, 3])  # one chunk: prefilled, then pulled whole
    engine.step()
    (pull,) = _ask(engine, m.LookupEntry(rid, (0,), 0, new_secret()))
    assert (pull.status, pull.first_token) == (S.SENDING, FIRST)
    transfer.complete(transfer_id_of(rid))
    engine.step()
    assert engine.sched.get(rid) is None
    (again,) = _ask(engine, m.LookupEntry(rid))
    assert (again.status, again.first_token, again.num_tokens) == (S.SENDING, FIRST, 3)
    # A release that comes after the send ended (decode's, or the proxy's abort) changes nothing.
    assert engine.on_release(DECODE, m.Release(DECODE, (rid,))).released == 0
    assert rid not in engine.held.memory.released_early


def test_a_claim_then_an_abort_before_the_request_tells_the_claimant_at_once(prefill):
    """Decode claimed a request prefill has not seen, then the proxy's abort (its client left) reached prefill
    before the request itself: the claimant is told FAILED now, not at its prefill-wait timeout, and the request
    is still dropped when it arrives."""
    from xpyd.prefill_worker.held import RELEASED_EARLY
    from xpyd.worker.engine import Abort

    engine, _, pushed = prefill
    rid = str(RequestId.new(PREFILL, DECODE))
    assert [r.status for r in _ask(engine, m.LookupEntry(rid, None))] == [S.UNKNOWN]  # claimed early
    engine.post(Abort(rid))
    engine.step()
    assert [(r.request_id, r.status, r.error) for r in pushed] == [(rid, S.FAILED, RELEASED_EARLY)]
    assert rid in engine.held.memory.released_early  # (the request is refused when it arrives)
    assert [r.status for r in _ask(engine, m.LookupEntry(rid, None))] == [S.FAILED]  # a re-ask: the same


@pytest.mark.parametrize("same_host", [False, True], ids=["network", "same-host"])
def test_a_streamed_pull_computes_its_last_part_alone_only_across_a_network(prefill, monkeypatch, same_host):
    """The last chunk computes just the last KV part when the parts cross a network (only it is left to move once
    the first token is out); on the same host moving another part costs less than the extra step would."""
    engine, transfer, _ = prefill
    monkeypatch.setattr(transfer, "same_host", lambda peer: same_host)
    rid = _add(engine, list(range(1, 13)))  # three blocks
    (claim,) = _ask(engine, m.LookupEntry(rid))
    assert claim.status is S.NOT_READY
    engine.step()  # the first chunk
    (pull,) = _ask(engine, m.LookupEntry(rid, (3, 5, 7), 0, new_secret(), part_blocks=1))
    assert pull.status is S.PREFILLING
    assert engine.sched.get(rid).split_at == (0 if same_host else 8)  # (the last part starts at token 8)
