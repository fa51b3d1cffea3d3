"""A decode engine stepped by hand (no engine thread, no model): a fake transfer backend, a signal client
double whose prefill peer is connected and records every lookup, a clock the test moves, and requests with
an output that records its tokens."""

from __future__ import annotations

import time
from types import SimpleNamespace

from tests.unit.fake_signal import FakeSignal
from xpyd.model.sampling import TorchSampler
from xpyd.decode_worker import batch as batch_module
from xpyd.decode_worker import engine as engine_module
from xpyd.decode_worker.engine import DecodeEngine
from xpyd.decode_worker.seq import DecodeSeq
from xpyd.model.kv_pool import KVLayout, KVPool
from xpyd.model.output import FinishReason, StopParams
from xpyd.signal import messages as m
from xpyd.signal.client import PeerState
from xpyd.signal.request_id import RequestId
from xpyd.transfer.fake import FakeNetwork, FakeTransferBackend
from xpyd.worker.config import WorkerConfig
from xpyd.worker.phases import PhaseStamps

# What a reduced WorkItem needs of a migrated request's fields (none: not one)
WORK_ITEM_RESUME = {"resumed": (), "reported": 0, "prompt_tokens": lambda n: n, "new_ids": lambda: ()}

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", num_blocks=16, block_size=4)
PREFILL, DECODE = "127.0.0.1:7000", "127.0.0.1:7001"
S = m.LookupStatus


class Clock:
    """``time.monotonic`` for the engine: moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now


class LookupSignal(FakeSignal):
    """The prefill peer is connected (READY, unless the test sets ``prefill.state``); each lookup sent is
    recorded (``lookups``, one list of entries per frame) and stays in flight until ``answer`` puts its
    reply on the next poll; releases are recorded (``released``) when they go out."""

    def __init__(self) -> None:
        super().__init__()
        self.prefill = SimpleNamespace(state=PeerState.READY, lookup_in_flight=False, proved=None)
        self.lookups: list[list[m.LookupEntry]] = []

    def peer(self, addr: str):
        return self.prefill

    def get(self, addr: str):
        return self.prefill

    def send_lookup(self, addr: str, entries: list[m.LookupEntry]) -> None:
        self.prefill.lookup_in_flight = True
        self.lookups.append(list(entries))

    def answer(self, *results: m.LookupResult) -> None:
        self.prefill.lookup_in_flight = False
        self.replies.append((PREFILL, m.LookupReply(tuple(results))))

    def notify(self, *results: m.LookupResult) -> None:
        self.replies.append((PREFILL, m.Notify(tuple(results))))

    def send_release(self, addr: str, request_ids: list[str]) -> None:
        """Recorded if it goes out: as the real client, only on a ready connection (else it is dropped)."""
        if self.prefill.state is PeerState.READY:
            super().send_release(addr, request_ids)


class Output:
    """Records its tokens; finishes (length) at its request's ``stop.max_tokens`` (read at each token: an
    open-ended request's is settled by the prompt's facts)."""

    def __init__(self, stop_of) -> None:
        self._stop_of = stop_of
        self.token_ids: list[int] = []

    def append(self, token: int):
        self.token_ids.append(token)
        return "t", FinishReason.LENGTH if len(self.token_ids) >= self._stop_of().max_tokens else None


class Sink:
    def __init__(self) -> None:
        self.events: list = []
        self.ended = False

    def put(self, event) -> None:
        self.events.append(event)


def make_engine(monkeypatch, batch_size: int = 8, layout: KVLayout = LAYOUT):
    """(engine, its fake transfer backend, the prefill side's auto-completing fake, the clock)."""
    clock = Clock()
    monkeypatch.setattr(engine_module, "time", clock)
    monkeypatch.setattr(batch_module, "time", clock)
    # A decode step without a model: every running request gets token 7.
    monkeypatch.setattr(batch_module, "decode_and_sample", lambda runner, kv, running: [7] * len(running))
    net = FakeNetwork()
    transfer, sender = FakeTransferBackend(net), FakeTransferBackend(net, auto_complete=True)
    runner = SimpleNamespace(pool=KVPool(layout), max_model_len=32, eos_token_ids=frozenset(), sampler=TorchSampler())
    engine = DecodeEngine(runner, None, WorkerConfig(role="decode", port=8100), transfer, "m")
    engine.sched.batch_size = batch_size
    transfer.register(engine.pool.buffer())
    sender.register(memoryview(bytearray([0x5A]) * layout.total_bytes))
    engine.signal = LookupSignal()
    return engine, transfer, sender, clock


def add_request(engine: DecodeEngine, clock: Clock, max_tokens: int = 4,
                open_ended: bool = False) -> tuple[str, SimpleNamespace]:
    """A request as ``_add`` takes it (claimed at the next step), with a recording output and sink."""
    rid = str(RequestId.new(PREFILL, DECODE))
    payload = SimpleNamespace(stamps=PhaseStamps(),
                              arrival=clock.now, sink=Sink(), sampling=SimpleNamespace(temperature=0),
                              open_ended=open_ended, stop=StopParams(max_tokens=max_tokens), cache_salt=None,
                              prompt_ids=[], start_output=lambda tokenizer, sampler: None,  # (no ids: prefill's names taken)
                              take_logprobs=lambda: (), grammar=None, **WORK_ITEM_RESUME)
    payload.output = Output(lambda: payload.stop)
    engine.sched.add(DecodeSeq(rid, PREFILL, payload=payload, deadline=clock.now + 30))
    return rid, payload


def facts(rid: str, status: m.LookupStatus, num_tokens: int, first_token: int | None = None,
          part_blocks: int = 0) -> m.LookupResult:
    """Prefill's answer with the prompt's facts (made-up block hashes, its tail)."""
    full = num_tokens // LAYOUT.block_size
    return m.LookupResult(rid, status, first_token, num_tokens, block_hashes=m.pack_hashes(range(1000, 1000 + full)),
                          tail=tuple(range(num_tokens % LAYOUT.block_size)), part_blocks=part_blocks)
