"""A pull streamed in parts whose one part fails: the request fails, and the parts still expected are
withdrawn before its blocks are freed, so a later part (its sender reconnected and sent on the next chunk)
is refused and nothing lands in blocks that may already hold another request's KV. Decode engine stepped
by hand with fake transfer backends (the prefill side's copies the bytes of what it sends)."""

from __future__ import annotations

import torch

from tests.unit.decode_harness import LAYOUT, S, add_request, facts, make_engine
from xpyd.model.kv_pool import KVPool
from xpyd.signal.request_id import part_transfer_ids
from xpyd.transfer.auth import new_secret
from xpyd.transfer.base import Region, expect_parts
from xpyd.transfer.fake import FakeNetwork, FakeTransferBackend
from xpyd.worker.kv_staging import StagedTransfer, stage_pool
from xpyd.worker.request import RequestState
from xpyd.worker.work_item import ErrorEvent


def test_a_part_sent_after_another_part_failed_lands_nowhere(monkeypatch):
    engine, transfer, sender, clock = make_engine(monkeypatch)
    rid, payload = add_request(engine, clock)
    engine.step()  # claimed
    engine.signal.answer(facts(rid, S.PREFILLING, 12, part_blocks=1))  # 3 full blocks, pulled in 3 parts
    engine.step()
    seq = engine.sched.get(rid)
    assert seq.state is RequestState.TRANSFERRING and engine.signal.lookups[-1][0].dest_blocks is not None
    parts = part_transfer_ids(rid, 3)
    assert transfer.expected == parts
    blocks = list(seq.kv.blocks[:3])
    dst = [[Region(*r) for r in engine.pool.byte_ranges([b])] for b in blocks]

    def send(i: int):  # what prefill sends for part i (the secret came in the pull)
        return sender.send(parts[i], dst[i], transfer.descriptor, dst[i], secret=transfer.secrets[parts[i]])

    assert send(0).done()
    transfer.fail(parts[1], "sender connection lost mid-transfer")  # part 1 broke mid-way
    engine.step()
    assert engine.sched.get(rid) is None and engine.pool.num_used == 0
    (event,) = payload.sink.events
    assert isinstance(event, ErrorEvent) and event.status == 502 and "connection lost" in event.message
    assert engine.signal.released == [rid] and transfer.outstanding() == set()
    freed = bytes(engine.pool.buffer())

    late = send(2)  # the sender reconnected and sends the chunk it had queued
    assert late.failed() and "unexpected transfer id" in late.error
    assert bytes(engine.pool.buffer()) == freed  # nothing landed in the freed blocks
    engine.step()
    engine.sched.check_invariants()
    assert not engine.sched.has_work() and engine.pool.num_used == 0 and transfer.outstanding() == set()
    transfer.close()
    sender.close()


def test_a_staged_receive_in_parts_withdraws_its_parts_from_the_staging_too():
    """A device pool (its bytes staged in a host copy): the parts still expected leave the backend and the
    staging, so a late part lands neither in the host copy nor in the pool, and nothing stays outstanding."""
    net, secret = FakeNetwork(), new_secret()
    pool = KVPool(LAYOUT, device=torch.device("cpu"))
    receiver = StagedTransfer(FakeTransferBackend(net), stage_pool(pool, pin=False))
    desc = receiver.register(pool.buffer())
    sender = FakeTransferBackend(net, auto_complete=True)
    sender.register(memoryview(bytearray([0x5A]) * LAYOUT.total_bytes))
    parts = [(f"r.{i}", [Region(*r) for r in pool.byte_ranges([i])]) for i in range(3)]
    recv = expect_parts(receiver, "r", parts, secret=secret)
    assert sender.send("r.0", parts[0][1], desc, parts[0][1], secret=secret).done()
    receiver.inner.fail("r.1", "sender connection lost mid-transfer")
    assert recv.failed() and receiver.outstanding() == set()
    host, device = bytes(pool.buffer()), pool.tensor.clone()
    late = sender.send("r.2", parts[2][1], desc, parts[2][1], secret=secret)
    assert late.failed() and "unexpected transfer id" in late.error
    assert bytes(pool.buffer()) == host and torch.equal(pool.tensor, device)
    receiver.close()
    sender.close()
