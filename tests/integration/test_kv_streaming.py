"""KV streamed while prefill runs, over real transfer backends (tcp, shm and, where installed, nixl).

A prefill side (its scheduler, chunked, over a real KV pool registered with the sending backend) and a
decode side (a real pool registered with the receiving backend): decode expects the request's blocks in
parts, as its engine does, and sends the pull while the prompt is still computing; each "forward pass"
writes a known pattern into the chunk's blocks, and the prefill side sends every part whose blocks are
done (`handover.send_due`, what the engine calls after each step). The model is not needed for what is
tested here: which bytes move when, and what is left after an abort.

- Without an abort, every part lands while later chunks compute, and the decode blocks hold exactly the
  prefill blocks' bytes.
- With an abort after each possible chunk boundary (decode aborts its receives, prefill releases the
  request, as an abort does on both engines): both sides end with no transfer outstanding, the prefill
  request's blocks are released, and nothing lands late: the decode blocks stay byte for byte as they were
  when the abort returned, and the parts that had landed hold the right bytes.
"""

from __future__ import annotations

import importlib.util
import time

import pytest

from xpyd.model.kv_pool import KVLayout, KVPool
from xpyd.prefill_worker.handover import abort_sends, plan_pull, send_due
from xpyd.prefill_worker.peers import PeerMap
from xpyd.prefill_worker.scheduler import PrefillScheduler, PrefillSeq
from xpyd.signal import messages as m
from xpyd.signal.request_id import RequestId, part_transfer_ids, transfer_id_of
from xpyd.transfer import make_backend
from xpyd.transfer.auth import new_secret
from xpyd.transfer.base import AllOf, Region
from xpyd.worker.kv_cache import KVCache
from xpyd.worker.request import RequestState

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", num_blocks=64, block_size=4)
PROMPT = 30  # tokens: 8 blocks (the last one partly filled)
CHUNK = 8  # tokens a step computes: 4 chunks
PART_BLOCKS = 2  # blocks a part moves: 4 parts (the last holding the partly filled block)
WAIT = 10.0


class Side:
    def __init__(self, backend: str, sender: bool) -> None:
        self.transfer = make_backend(backend, io_timeout=5.0)
        allocate = getattr(self.transfer, "allocate", None) if sender else None
        self.pool = KVPool(LAYOUT, allocate(LAYOUT.total_bytes) if allocate else None)
        self.desc = self.transfer.register(self.pool.buffer())

    def blocks_bytes(self, blocks) -> bytes:
        return b"".join(bytes(self.pool.buffer()[r[0]:r[0] + r[1]]) for r in self.pool.byte_ranges(blocks))


NIXL = pytest.param("nixl", marks=pytest.mark.skipif(importlib.util.find_spec("nixl") is None,
                                                     reason="NIXL is not installed (pip install --no-deps nixl nixl-cu13)"))
_LIVE: list[Side] = []  # the sides of the running test: waits call their progress() as the engines do


@pytest.fixture(params=["tcp", "shm", NIXL])
def sides(request):
    prefill, decode = Side(request.param, sender=True), Side(request.param, sender=False)
    _LIVE[:] = [prefill, decode]
    yield prefill, decode
    _LIVE.clear()
    prefill.transfer.close()
    decode.transfer.close()


def until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, what
        for side in _LIVE:
            side.transfer.progress()  # (nixl moves bytes in these calls; tcp and shm in their own threads)
        time.sleep(0.002)


def compute(prefill: Side, seq: PrefillSeq, start: int, end: int) -> None:
    """What a forward pass over prompt tokens [start, end) does to the pool: writes their rows (here a
    pattern naming the block and token)."""
    t = prefill.pool.tensor
    for pos in range(start, end):
        block, row = seq.kv.blocks[pos // LAYOUT.block_size], pos % LAYOUT.block_size
        t[block, :, :, :, row, :] = float(1000 * block + pos + 1)


def start(prefill: Side, decode: Side):
    """The request admitted on prefill, its first chunk computed; decode's receives expected and its pull
    taken (as the engines do on PREFILLING). Returns what the test steps on."""
    kv = KVCache(prefill.pool.blocks, LAYOUT.block_size, seed=0)
    sched = PrefillScheduler(batch_size=2, kv=kv, chunk=CHUNK)
    rid = str(RequestId.new("127.0.0.1:1", "127.0.0.1:2"))
    seq = PrefillSeq(rid, list(range(1, PROMPT + 1)), peer="127.0.0.1:2")
    sched.add(seq)
    dest = decode.pool.blocks.allocate(LAYOUT.blocks_for(PROMPT))
    ids = part_transfer_ids(rid, -(-len(dest) // PART_BLOCKS))
    secret = new_secret()
    tokens = [decode.transfer.expect(tid, [Region(*r) for r in decode.pool.byte_ranges(dest[i * PART_BLOCKS:(i + 1) * PART_BLOCKS])],
                                     secret=secret) for i, tid in enumerate(ids)]
    recv = AllOf(transfer_id_of(rid), tokens)
    entry = m.LookupEntry(rid, tuple(dest), 0, secret, part_blocks=PART_BLOCKS)
    return sched, seq, dest, ids, tokens, recv, entry


def step(prefill: Side, sched: PrefillScheduler, seq: PrefillSeq) -> None:
    (chunk,) = sched.plan()
    compute(prefill, seq, chunk.start, chunk.end)
    if chunk.last:
        sched.prefilled(seq, 7)
    else:
        sched.chunk_done(chunk)
    if seq.pull is not None and not seq.state.is_final:
        send_due(prefill.transfer, sched, seq, lambda: None)


def settle(sched: PrefillScheduler, seq: PrefillSeq) -> None:
    """Poll the prefill scheduler (as its engine does every step) until the request ended."""
    until(lambda: sched.poll() is not None and seq.state.is_final, f"{seq.request_id} ended on prefill")


def test_parts_land_while_later_chunks_compute(sides):
    prefill, decode = sides
    sched, seq, dest, ids, tokens, recv, entry = start(prefill, decode)
    step(prefill, sched, seq)  # chunk 1 (tokens 0-7: blocks 0-1 full): before the pull
    source_blocks = list(seq.kv.blocks)
    plan = plan_pull(prefill.pool, seq, entry, PeerMap(decode.desc, LAYOUT.block_bytes, LAYOUT.num_blocks), 0.0)
    assert [p.ready_at for p in plan.parts] == [8, 16, 24, 30]
    sched.start_pull(seq.request_id, len(plan.parts), plan)
    assert send_due(prefill.transfer, sched, seq, lambda: None) == 1  # part 0 goes at once
    until(tokens[0].done, "part 0 landed")
    assert not recv.finished() and seq.state is RequestState.RUNNING  # the prompt is still computing
    step(prefill, sched, seq)  # chunk 2: part 1
    until(tokens[1].done, "part 1 landed while chunks 3-4 were still to compute")
    assert seq.state is RequestState.RUNNING and not tokens[2].finished()
    step(prefill, sched, seq)
    step(prefill, sched, seq)  # the last chunk: parts 2 and 3 (3 holds the partly filled last block)
    until(recv.done, "every part landed")
    settle(sched, seq)
    assert seq.state is RequestState.FINISHED and prefill.pool.blocks.num_referenced == 0
    assert decode.blocks_bytes(dest) == prefill.blocks_bytes(source_blocks)
    for pos in range(PROMPT):  # every token's rows hold what its chunk's forward pass wrote
        block, row = pos // LAYOUT.block_size, pos % LAYOUT.block_size
        assert bool((decode.pool.tensor[dest[block], :, :, :, row] == 1000 * source_blocks[block] + pos + 1).all())
    assert prefill.transfer.outstanding() == set() and decode.transfer.outstanding() == set()
    decode.pool.blocks.release(dest)


@pytest.mark.parametrize("abort_after", range(5))
def test_abort_after_each_chunk_boundary_leaks_nothing_and_lands_nothing_late(sides, abort_after):
    """Abort after ``abort_after`` chunks were computed (0: right after the pull, before any part; 4: after
    the last chunk, while the last parts are on their way)."""
    prefill, decode = sides
    sched, seq, dest, ids, tokens, recv, entry = start(prefill, decode)
    step(prefill, sched, seq)
    source_blocks = list(seq.kv.blocks)
    plan = plan_pull(prefill.pool, seq, entry, PeerMap(decode.desc, LAYOUT.block_bytes, LAYOUT.num_blocks), 0.0)
    sched.start_pull(seq.request_id, len(plan.parts), plan)
    if abort_after > 0:
        send_due(prefill.transfer, sched, seq, lambda: None)
    for _ in range(1, abort_after):
        step(prefill, sched, seq)
    # the abort, on both sides (decode: abort its receives; prefill: release, abort the sends in flight)
    for tid in ids:
        decode.transfer.abort(tid)
    landed_then = decode.blocks_bytes(dest)
    landed_parts = [i for i, t in enumerate(tokens) if t.done()]
    sched.release(seq.request_id)
    abort_sends(prefill.transfer, seq)
    settle(sched, seq)
    assert seq.state is RequestState.ABORTED
    assert prefill.pool.blocks.num_referenced == 0 and not sched.has_work()
    until(lambda: prefill.transfer.outstanding() == set(), "no send outstanding")
    assert decode.transfer.outstanding() == set() and recv.finished() and not recv.done()
    time.sleep(0.2)  # (what could still land would land now)
    assert decode.blocks_bytes(dest) == landed_then, "bytes landed after the abort returned"
    for i in landed_parts:  # what had landed is right
        part = slice(i * PART_BLOCKS, (i + 1) * PART_BLOCKS)
        assert decode.blocks_bytes(dest[part]) == prefill.blocks_bytes(source_blocks[part])
    decode.pool.blocks.release(dest)
    assert decode.pool.blocks.num_referenced == 0
