"""The prefill worker's bounded memory of ended / released-early request ids.

Time is driven through the memory's injected timer (no sleeps); the engine test at the end uses the
real (monotonic) timer and checks only answers that do not depend on time.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from xpyd.model.sampling import TorchSampler
from xpyd.model.kv_pool import KVLayout, KVPool
from xpyd.prefill_worker.engine import PrefillEngine
from xpyd.prefill_worker.held import RELEASED_EARLY
from xpyd.prefill_worker.recent import recent_ids
from xpyd.signal import messages as m
from xpyd.signal.request_id import RequestId
from xpyd.transfer.fake import FakeNetwork, FakeTransferBackend
from xpyd.worker.config import WorkerConfig
from xpyd.worker.work_item import ErrorEvent


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_forgotten_after_retention_and_refreshed_when_set_again():
    clock = Clock()
    r = recent_ids(retention=10.0, max_entries=100, timer=clock)
    r["a"] = "va"
    clock.now = 3.0
    r["b"] = "vb"
    clock.now = 9.0
    r["a"] = "again"  # re-setting refreshes its age: now forgotten at 19
    clock.now = 12.9
    assert r.get("b") == "vb" and "b" in r
    clock.now = 13.0  # b was set at 3
    assert r.get("b") is None and "b" not in r and r.pop("b", None) is None
    assert r.get("a") == "again"
    clock.now = 19.0
    assert "a" not in r and len(r) == 0


def test_bounded_by_count_least_recently_used_first():
    clock = Clock()
    r = recent_ids(retention=10.0, max_entries=3, timer=clock)
    for i in range(3):
        r[f"id{i}"] = f"v{i}"
    assert r.get("id0") == "v0"  # a lookup counts as a use: id1 is now the least recently used
    r["id3"] = "v3"
    assert len(r) == 3 and "id1" not in r and r.get("id0") == "v0" and r.get("id3") == "v3"
    assert r.pop("id3", None) == "v3" and r.pop("id3", None) is None and len(r) == 2


def test_expire_drops_what_is_past_its_time():
    clock = Clock()
    r = recent_ids(retention=5.0, max_entries=10, timer=clock)
    r["old"], r["new"] = 1, 2
    clock.now = 2.0
    r["newer"] = 3
    clock.now = 5.0
    assert [k for k, _ in r.expire()] == ["old", "new"] and list(r) == ["newer"]


def test_default_timer_is_monotonic():
    r = recent_ids(retention=1.0, max_entries=1)
    assert abs(r.timer() - time.monotonic()) < 1.0  # (wall-clock time would be decades away)


def test_rejects_nonsense_limits():
    with pytest.raises(ValueError):
        recent_ids(retention=0, max_entries=1)
    with pytest.raises(ValueError):
        recent_ids(retention=1, max_entries=0)


# --- as the prefill engine uses it ------------------------------------------------------------------
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", num_blocks=6, block_size=4)
PREFILL, DECODE = "127.0.0.1:7000", "127.0.0.1:7001"


class _Sink:
    def __init__(self) -> None:
        self.events: list = []

    def put(self, event) -> None:
        self.events.append(event)


def _lookup(engine: PrefillEngine, rid: str) -> m.LookupResult:
    return engine.on_lookup_all(DECODE, m.LookupAll(DECODE, (m.LookupEntry(rid, None),))).results[0]


def test_engine_remembers_a_release_that_overtook_its_request():
    runner = SimpleNamespace(pool=KVPool(LAYOUT), max_model_len=8, eos_token_ids=frozenset(), sampler=TorchSampler())
    transfer = FakeTransferBackend(FakeNetwork())
    engine = PrefillEngine(runner, None, WorkerConfig(role="prefill", port=8100), transfer, "m")
    try:
        assert engine.on_handshake(DECODE, m.Handshake(DECODE, "m", engine.peer_compat())).ok
        rid = str(RequestId.new(PREFILL, DECODE))
        assert _lookup(engine, rid).status is m.LookupStatus.UNKNOWN
        assert engine.on_release(DECODE, m.Release(DECODE, (rid,))).released == 0  # not here yet: remembered
        assert (_lookup(engine, rid).status, _lookup(engine, rid).error) == (m.LookupStatus.FAILED, RELEASED_EARLY)

        sink = _Sink()  # the request arrives: refused, and remembered as ended
        engine.post(SimpleNamespace(request_id=rid, sink=sink, prompt_ids=[1, 2]))  # (a WorkItem, reduced)
        engine.step()
        assert [type(e) for e in sink.events] == [ErrorEvent] and sink.events[0].status == 409
        assert rid not in engine.held.memory.released_early and engine.stats()["released_on_arrival"] == 1
        assert (_lookup(engine, rid).status, _lookup(engine, rid).error) == (m.LookupStatus.FAILED, RELEASED_EARLY)
        assert engine.sched.get(rid) is None and engine.pool.num_used == 0  # nothing held for it
    finally:
        transfer.close()
