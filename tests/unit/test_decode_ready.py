"""The decode worker takes the prompt's length from prefill's "ready" (here without tokens of its own): it sizes an
open-ended request by it, and refuses one that would overrun the context (prefill refuses those first; this
is the safety net). Engine stepped by hand with a fake signal client."""

from __future__ import annotations

import asyncio

from tests.unit.fake_signal import FakeSignal, ready
from tests.unit.test_request_failures import DECODE, LAYOUT, PREFILL, _runner
from xpyd.decode_worker.engine import DecodeEngine
from xpyd.model.output import StopParams
from xpyd.model.sampling import SamplingParams
from xpyd.signal import messages as m
from xpyd.signal.request_id import RequestId, transfer_id_of
from xpyd.transfer.fake import FakeTransferBackend
from xpyd.worker.config import WorkerConfig
from xpyd.worker.work_item import ErrorEvent, EventDispatch, OutputSink, WorkItem


def _engine(tokenizer) -> tuple[DecodeEngine, FakeTransferBackend]:
    transfer = FakeTransferBackend()
    engine = DecodeEngine(_runner(), tokenizer, WorkerConfig(role="decode", port=8100), transfer, "m")
    transfer.register(engine.pool.buffer())
    engine.signal = FakeSignal()
    return engine, transfer


def _submit(engine: DecodeEngine, max_tokens: int, open_ended: bool) -> WorkItem:
    item = WorkItem(RequestId.new(PREFILL, DECODE), [], SamplingParams(), StopParams(max_tokens=max_tokens),
                    OutputSink(EventDispatch(asyncio.get_running_loop())), open_ended=open_ended)
    engine._add(item)
    return item


async def test_an_open_ended_request_gets_the_rest_of_the_context_and_its_pull_the_prompts_length(smollm_dir):
    from transformers import AutoTokenizer

    engine, transfer = _engine(AutoTokenizer.from_pretrained(str(smollm_dir)))
    limit = 8  # 8 tokens
    item = _submit(engine, max_tokens=limit - 1, open_ended=True)
    rid = str(item.request_id)
    engine.signal.replies = [(PREFILL, m.Notify((ready(rid, 42, 5),)))]
    engine.step()
    seq = engine.sched.get(rid)
    assert seq.prompt_len == 5 and item.stop.max_tokens == limit - 5
    assert transfer.expected == [transfer_id_of(rid)]  # the pull of 5 tokens' KV started
    engine._abort(rid)
    engine.step()
    assert not engine.sched.has_work() and engine.pool.num_used == 0
    transfer.close()


async def test_a_prompt_too_long_for_its_max_tokens_fails_with_400_and_releases_prefill():
    engine, transfer = _engine(None)
    item = _submit(engine, max_tokens=4, open_ended=False)
    rid = str(item.request_id)
    engine.signal.replies = [(PREFILL, m.Notify((ready(rid, 42, 6),)))]
    engine.step()  # 6 + 4 > 8
    event = await asyncio.wait_for(item.sink.queue.get(), 5)
    assert isinstance(event, ErrorEvent) and event.status == 400 and "context length" in event.message
    assert engine.signal.released == [rid] and not engine.sched.has_work() and engine.pool.num_used == 0
    transfer.close()
