"""A decode worker with its prefix cache on names the blocks of the KV it pulls itself: it tokenized the
prompt (``build_work_item``), computes the keyed, salted chain hashes, and refuses a prefill worker's "ready"
that names the prompt otherwise (its length, a block hash or its tail): nothing is pulled or cached under a
name prefill chose. Engine stepped by hand with a fake signal client."""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.fake_signal import FakeSignal
from tests.unit.test_request_failures import DECODE, PREFILL, _runner
from xpyd.decode_worker.engine import DecodeEngine
from xpyd.model.output import StopParams
from xpyd.model.sampling import SamplingParams
from xpyd.prefix_hash import block_hashes
from xpyd.signal import messages as m
from xpyd.signal.request_id import RequestId, transfer_id_of
from xpyd.transfer.fake import FakeTransferBackend
from xpyd.worker.config import WorkerConfig
from xpyd.worker.work_item import ErrorEvent, EventDispatch, OutputSink, WorkItem

TOKEN = "a-cluster-token"
PROMPT = [11, 12, 13, 14, 15, 16]  # one full block of 4 and two tokens


def _engine(tokenizer=None) -> tuple[DecodeEngine, FakeTransferBackend]:
    transfer = FakeTransferBackend()
    engine = DecodeEngine(_runner(), tokenizer, WorkerConfig(role="decode", port=8100, cluster_token=TOKEN),
                          transfer, "m")
    transfer.register(engine.pool.buffer())
    engine.signal = FakeSignal()
    return engine, transfer


def _submit(engine: DecodeEngine, salt: str | None) -> WorkItem:
    item = WorkItem(RequestId.new(PREFILL, DECODE), list(PROMPT), SamplingParams(), StopParams(max_tokens=2),
                    OutputSink(EventDispatch(asyncio.get_running_loop())), cache_salt=salt)
    engine._add(item)
    return item


def _ready(rid: str, hashes: list[int], num_tokens: int = len(PROMPT), tail: tuple[int, ...] = (15, 16)):
    return m.LookupResult(rid, m.LookupStatus.READY, 42, num_tokens, block_hashes=m.pack_hashes(hashes), tail=tail)


async def test_prefills_names_that_match_decodes_own_are_taken(smollm_dir):
    from transformers import AutoTokenizer

    engine, transfer = _engine(AutoTokenizer.from_pretrained(str(smollm_dir)))
    item = _submit(engine, "alice")
    rid = str(item.request_id)
    own = engine.kv_cache.hashes(PROMPT, "alice")
    engine.signal.replies = [(PREFILL, m.Notify((_ready(rid, list(own)),)))]
    engine.step()
    seq = engine.sched.get(rid)
    assert seq.known and seq.hashes == own and seq.hashes.root == own.root
    assert transfer.expected == [transfer_id_of(rid)]  # the pull started
    engine._abort(rid)
    engine.step()
    assert not engine.sched.has_work() and engine.pool.num_used == 0
    transfer.close()


@pytest.mark.parametrize("case", ["forged hash", "another salt", "unkeyed", "length", "tail"])
async def test_a_ready_naming_another_prompt_is_refused_and_nothing_is_pulled(case):
    engine, transfer = _engine()
    item = _submit(engine, "alice")
    rid = str(item.request_id)
    own = list(engine.kv_cache.hashes(PROMPT, "alice"))
    result = {
        "forged hash": _ready(rid, [own[0] ^ 1]),
        "another salt": _ready(rid, list(engine.kv_cache.hashes(PROMPT, "bob"))),
        "unkeyed": _ready(rid, block_hashes(PROMPT, 4, engine.kv_cache.hashes(PROMPT, "alice").root)),
        "length": _ready(rid, own, num_tokens=7, tail=(15, 16, 17)),
        "tail": _ready(rid, own, tail=(15, 99)),
    }[case]
    engine.signal.replies = [(PREFILL, m.Notify((result,)))]
    engine.step()
    event = await asyncio.wait_for(item.sink.queue.get(), 5)
    assert isinstance(event, ErrorEvent) and event.status == 502 and "named another prompt" in event.message
    assert engine.signal.released == [rid]  # prefill lets go of its KV
    assert transfer.expected == [] and not engine.sched.has_work() and engine.pool.num_used == 0
    assert engine.kv_cache.allocator.num_cached == 0  # nothing cached under any name
    transfer.close()


@pytest.mark.parametrize("keyed_by,taken", [("the-next-token", True), (TOKEN, False)])
async def test_a_prefill_worker_on_the_other_token_of_a_rotation_names_blocks_with_its_key(keyed_by, taken,
                                                                                          smollm_dir):
    """In a rotation window the prefill worker proved the other token (its primary) at the handshake, and
    keys its block hashes with it: decode checks them under that key and caches the KV under its own names.
    Names under decode's own key from that peer do not match what it would compute, so they are refused."""
    from transformers import AutoTokenizer

    from xpyd.prefix_hash import hash_key

    engine, transfer = _engine(AutoTokenizer.from_pretrained(str(smollm_dir)))
    engine.signal.proved[PREFILL] = "the-next-token"
    item = _submit(engine, "alice")
    rid = str(item.request_id)
    own = engine.kv_cache.hashes(PROMPT, "alice")
    theirs = engine.kv_cache.hashes(PROMPT, "alice", key=hash_key(keyed_by))
    assert (list(theirs) != list(own)) == taken  # (another key names the same blocks otherwise)
    engine.signal.replies = [(PREFILL, m.Notify((_ready(rid, list(theirs)),)))]
    engine.step()
    if taken:
        seq = engine.sched.get(rid)
        assert seq.known and seq.hashes == own and seq.hashes.root == own.root  # cached under decode's names
        assert transfer.expected == [transfer_id_of(rid)]
        engine._abort(rid)
        engine.step()
    else:
        event = await asyncio.wait_for(item.sink.queue.get(), 5)
        assert isinstance(event, ErrorEvent) and "named another prompt" in event.message
        assert transfer.expected == []
    assert not engine.sched.has_work() and engine.pool.num_used == 0
    transfer.close()
