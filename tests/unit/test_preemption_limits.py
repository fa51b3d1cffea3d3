"""A request that could never run on a worker, even with its whole KV cache (its prompt and one token need more
blocks than the pool has), is refused up front with a 400 naming both sizes: it is not admitted to be preempted
over and over. (A worker refuses to start with a cache smaller than --max-model-len, so only a pool made
smaller than the context, as here, meets such a request.) Engines stepped by hand, without a model."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tests.unit.fake_signal import FakeSignal, ready
from xpyd.colocated_worker.engine import ColocatedEngine
from xpyd.decode_worker.engine import DecodeEngine
from xpyd.model.kv_pool import KVLayout, KVPool
from xpyd.model.output import StopParams
from xpyd.model.sampling import SamplingParams, TorchSampler
from xpyd.signal import messages as m
from xpyd.signal.request_id import RequestId
from xpyd.transfer.fake import FakeTransferBackend
from xpyd.worker.config import WorkerConfig
from xpyd.worker.work_item import ErrorEvent, EventDispatch, OutputSink, WorkItem

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", num_blocks=2, block_size=4)  # 8 tokens
PREFILL, DECODE = "127.0.0.1:7000", "127.0.0.1:7001"
REFUSAL = "the request needs the KV of 9 tokens, more than this worker's whole KV cache holds (8 tokens)"


def _runner():
    return SimpleNamespace(pool=KVPool(LAYOUT), max_model_len=32, eos_token_ids=frozenset(), sampler=TorchSampler())


def _item(rid: RequestId, prompt: list[int], local: bool = False) -> WorkItem:
    return WorkItem(rid, prompt, SamplingParams(), StopParams(max_tokens=4),
                    OutputSink(EventDispatch(asyncio.get_running_loop())), local_prefill=local)


async def _error(item: WorkItem) -> ErrorEvent:
    event = await asyncio.wait_for(item.sink.queue.get(), 5)
    assert isinstance(event, ErrorEvent)
    return event


async def test_decode_refuses_a_prompt_its_pool_cannot_hold_and_releases_prefill():
    transfer = FakeTransferBackend()
    engine = DecodeEngine(_runner(), None, WorkerConfig(role="decode", port=8100), transfer, "m")
    transfer.register(engine.pool.buffer())
    engine.signal = FakeSignal()
    item = _item(RequestId.new(PREFILL, DECODE), [])
    engine._add(item)
    rid = str(item.request_id)
    engine.signal.replies = [(PREFILL, m.Notify((ready(rid, 42, 8),)))]  # 8 prompt tokens + 1 > 8
    engine.step()
    event = await _error(item)
    assert (event.status, event.message) == (400, REFUSAL)
    assert engine.signal.released == [rid] and not engine.sched.has_work() and engine.pool.num_used == 0
    transfer.close()


async def test_decode_refuses_a_local_prompt_its_pool_cannot_hold():
    transfer = FakeTransferBackend()
    engine = DecodeEngine(_runner(), None, WorkerConfig(role="decode", port=8100), transfer, "m")
    engine.identity = DECODE
    item = _item(RequestId.new(DECODE, DECODE), list(range(1, 9)), local=True)
    engine._add(item)
    event = await _error(item)
    assert (event.status, event.message) == (400, REFUSAL) and not engine.sched.has_work()
    transfer.close()


async def test_colocated_refuses_a_prompt_its_pool_cannot_hold():
    engine = ColocatedEngine(_runner(), None, WorkerConfig(role="colocated", port=8100), "m")
    item = _item(RequestId.new(DECODE, DECODE), list(range(1, 9)))
    engine._add(item)
    event = await _error(item)
    assert (event.status, event.message) == (400, REFUSAL) and not engine.sched.has_work()
    fits = _item(RequestId.new(DECODE, DECODE), list(range(1, 8)))  # 7 + 1: the whole pool, alone
    engine._add(fits)
    assert engine.sched.num_waiting == 1
