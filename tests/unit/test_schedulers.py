"""Both schedulers stepped through lifecycles with a fake transfer backend.

Invariants are checked after every step; every test ends with no slot held.
"""

from __future__ import annotations

import random

import pytest

from xpyd.decode_worker.scheduler import DecodeScheduler
from xpyd.decode_worker.seq import DecodeSeq
from xpyd.worker.request import IllegalTransition, RequestState
from tests.unit.kv_fixtures import kv_cache, next_prefill
from xpyd.prefill_worker.scheduler import PrefillScheduler, PrefillSeq
from xpyd.transfer.base import Region
from xpyd.transfer.fake import FakeTransferBackend
from xpyd.transfer.auth import new_secret

SECRET = new_secret()  # the transfers here that are not about their secret share one

S = RequestState


@pytest.fixture
def backend():
    b = FakeTransferBackend()
    b.register(memoryview(bytearray(1024)))
    yield b
    b.close()


def send(backend: FakeTransferBackend, rid: str):
    return backend.send(rid, [Region(0, 8)], backend.descriptor, [Region(8, 8)], secret=SECRET)


# --- prefill ----------------------------------------------------------------

def test_prefill_runs_one_at_a_time_and_holds_kv_until_sent(backend):
    slots = kv_cache(3)
    sched = PrefillScheduler(batch_size=3, kv=slots)
    seqs = [PrefillSeq(f"r{i}", [1, 2, 3]) for i in range(5)]
    for s in seqs:
        sched.add(s)
    sched.check_invariants()

    a = next_prefill(sched)
    assert a is seqs[0] and a.state is S.RUNNING and a.kv is not None
    with pytest.raises(ValueError):
        sched.plan()  # one prefill at a time: no new step before this one is reported back
    sched.prefilled(a, first_token=42)
    assert a.state is S.TRANSFERRING and a.first_token == 42
    sched.check_invariants()

    b = next_prefill(sched); sched.prefilled(b, 7)
    c = next_prefill(sched); sched.prefilled(c, 8)
    sched.check_invariants()
    # running + transferring <= batch: three KV held, the fourth must wait
    assert sched.num_transferring == 3 and next_prefill(sched) is None
    assert slots.allocator.num_referenced == 3

    tok = send(backend, "r0")
    sched.start_send("r0", tok)
    assert sched.poll() == ([], [])  # not finished: slot still held
    backend.complete("r0")
    assert sched.poll() == ([a], []) and a.state is S.FINISHED and a.kv is None
    sched.check_invariants()

    d = next_prefill(sched)
    assert d is seqs[3]
    sched.prefilled(d, 9)
    # release (decode no longer needs it) frees a held KV at once
    sched.release("r1")
    assert b.state is S.ABORTED
    e = next_prefill(sched); sched.prefilled(e, 1)
    for s in (c, d, e):
        sched.start_send(s.request_id, send(backend, s.request_id))
        backend.complete(s.request_id)
    sched.poll()
    sched.check_invariants()
    assert not sched.has_work() and slots.allocator.num_referenced == 0
    assert [s.state for s in seqs] == [S.FINISHED, S.ABORTED, S.FINISHED, S.FINISHED, S.FINISHED]


def test_prefill_failed_send_and_cancel_during_send(backend):
    slots = kv_cache(2)
    sched = PrefillScheduler(batch_size=2, kv=slots)
    a, b = PrefillSeq("a", [1]), PrefillSeq("b", [1])
    sched.add(a); sched.add(b)
    sched.prefilled(next_prefill(sched), 1)
    sched.prefilled(next_prefill(sched), 2)
    sched.start_send("a", send(backend, "a"))
    sched.start_send("b", send(backend, "b"))
    with pytest.raises(ValueError):
        sched.start_send("a", send(backend, "a2"))  # already sending
    backend.fail("a", "peer died")
    # cancelling a send in flight keeps the slot until the token finishes
    sched.release("b")
    assert b.state is S.TRANSFERRING and slots.allocator.num_referenced == 2
    sched.poll()
    assert a.state is S.FAILED and a.error == "peer died"
    assert b.state is S.TRANSFERRING
    backend.complete("b")
    sched.poll()
    assert b.state is S.ABORTED
    sched.check_invariants()
    assert slots.allocator.num_referenced == 0 and not sched.has_work()
    backend.complete("a2")


def test_prefill_abort_while_waiting_and_while_running():
    slots = kv_cache(2)
    sched = PrefillScheduler(batch_size=2, kv=slots)
    a, b = PrefillSeq("a", [1]), PrefillSeq("b", [1])
    sched.add(a); sched.add(b)
    sched.release("b")
    assert b.state is S.ABORTED
    run = next_prefill(sched)
    sched.release("a")  # mid-forward: ends when the forward returns
    assert a.state is S.RUNNING
    sched.prefilled(run, 5)
    assert a.state is S.ABORTED and slots.allocator.num_referenced == 0
    sched.check_invariants()
    assert sched.release("zzz") is None


def test_prefill_failed_forward_and_duplicates():
    slots = kv_cache(1)
    sched = PrefillScheduler(batch_size=1, kv=slots)
    a = PrefillSeq("a", [1])
    sched.add(a)
    with pytest.raises(ValueError):
        sched.add(PrefillSeq("a", [2]))
    sched.fail_running(next_prefill(sched), "boom")
    assert a.state is S.FAILED and slots.allocator.num_referenced == 0
    with pytest.raises(IllegalTransition):
        a.set_state(S.RUNNING)


# --- decode -----------------------------------------------------------------

def test_decode_runs_only_after_kv_arrived(backend):
    slots = kv_cache(2)
    sched = DecodeScheduler(batch_size=2, kv=slots)
    seqs = [DecodeSeq(f"r{i}", "p:1", prompt_len=2) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert sched.schedule_transfers() == []  # nothing ready yet: no slot taken
    assert slots.allocator.num_referenced == 0

    sched.mark_ready("r1", 11)
    started = sched.schedule_transfers()
    assert started == [seqs[1]] and seqs[1].state is S.TRANSFERRING
    sched.set_recv_token(seqs[1], backend.expect("r1", [Region(0, 8)], secret=SECRET))
    sched.check_invariants()
    assert sched.poll_transfers() == ([], [])
    assert sched.running() == []  # KV not here yet: does not run

    sched.mark_ready("r0", 10)
    sched.mark_ready("r2", 12)
    started = sched.schedule_transfers()
    assert started == [seqs[0]]  # batch of 2 full (1 transferring + 1 new)
    sched.set_recv_token(seqs[0], backend.expect("r0", [Region(8, 8)], secret=SECRET))
    sched.check_invariants()

    backend.complete("r0")
    joined, failed = sched.poll_transfers()
    assert joined == [seqs[0]] and failed == [] and sched.running() == [seqs[0]]
    sched.check_invariants()
    backend.fail("r1", "prefill died")
    joined, failed = sched.poll_transfers()
    assert failed == [seqs[1]] and seqs[1].state is S.FAILED and seqs[1].error == "prefill died"
    sched.check_invariants()

    started = sched.schedule_transfers()  # room again
    assert started == [seqs[2]]
    sched.set_recv_token(seqs[2], backend.expect("r2", [Region(16, 8)], secret=SECRET))
    sched.finish(seqs[0])
    backend.complete("r2")
    sched.poll_transfers()
    sched.check_invariants()
    assert sched.running() == [seqs[2]]
    sched.finish(seqs[2])
    assert not sched.has_work() and slots.allocator.num_referenced == 0


def test_decode_abort_in_every_state(backend):
    slots = kv_cache(4)
    sched = DecodeScheduler(batch_size=4, kv=slots)
    w, t, r = (DecodeSeq(name, "p:1", prompt_len=1) for name in "wtr")
    for s in (w, t, r):
        sched.add(s)
    sched.mark_ready("t", 1); sched.mark_ready("r", 1)
    for s in sched.schedule_transfers():
        sched.set_recv_token(s, backend.expect(s.request_id, [Region(0, 4)], secret=SECRET))
    backend.complete("r")
    sched.poll_transfers()
    assert (w.state, t.state, r.state) == (S.WAITING, S.TRANSFERRING, S.RUNNING)
    for rid in ("w", "t", "r"):
        sched.abort(rid)
    assert all(s.state is S.ABORTED for s in (w, t, r))
    assert slots.allocator.num_referenced == 0 and not sched.has_work()
    assert sched.abort("w") is None


def test_decode_random_lifecycles_keep_invariants(backend):
    """Many requests, random events; invariants hold at every step; nothing leaks."""
    rng = random.Random(1234)
    batch = 4
    slots = kv_cache(batch * 2)  # (4-token blocks: a 9-token prompt takes 3; the pool also limits the batch)
    sched = DecodeScheduler(batch_size=batch, kv=slots)
    seqs = [DecodeSeq(f"q{i}", "p:1", prompt_len=rng.randint(1, 9)) for i in range(60)]
    pending = list(seqs)
    steps = 0
    while steps < 5000 and (pending or sched.has_work()):
        steps += 1
        if pending and rng.random() < 0.3:
            sched.add(pending.pop(0))
        for s in sched.waiting():
            if not s.ready and rng.random() < 0.2:
                sched.mark_ready(s.request_id, 5)
        for s in sched.schedule_transfers():
            sched.set_recv_token(s, backend.expect(s.request_id, [Region(0, 4)], secret=SECRET))
        for s in sched.transferring():
            x = rng.random()
            if x < 0.3:
                backend.complete(s.request_id)
            elif x < 0.33:
                backend.fail(s.request_id, "x")
        sched.poll_transfers()
        for s in sched.running():
            if rng.random() < 0.2:
                sched.finish(s)
        if rng.random() < 0.02 and sched.has_work():
            victim = rng.choice(sched.waiting() + sched.transferring() + sched.running())
            if victim.state is S.TRANSFERRING:
                backend.abort(victim.request_id)
            sched.abort(victim.request_id)
        sched.check_invariants()
        held = sched.running() + sched.transferring()
        assert sum(len(s.kv.blocks) for s in held) == slots.allocator.num_referenced
        assert all(len(s.kv.blocks) == slots.blocks_for(s.prompt_len) for s in held)
    assert not pending and not sched.has_work()
    assert slots.allocator.num_referenced == 0 and backend.outstanding() == set()
    assert all(s.state.is_final for s in seqs)


# --- leases and deadlines ------------------------------------------------------

def test_prefill_kv_lease_expires_only_unpulled_kv(backend):
    slots = kv_cache(3)
    sched = PrefillScheduler(batch_size=3, kv=slots)
    a, b, c = PrefillSeq("a", [1]), PrefillSeq("b", [1]), PrefillSeq("c", [1])
    for s in (a, b, c):
        sched.add(s)
    sched.prefilled(next_prefill(sched), 1, now=10.0)
    sched.prefilled(next_prefill(sched), 2, now=11.0)
    assert sched.expired(now=12.9, ttl=3.0) == []
    sched.start_send("a", send(backend, "a"))  # a pull started: its lease no longer applies
    assert sched.expired(now=14.0, ttl=3.0) == [b]
    sched.release("b", S.FAILED)
    assert b.state is S.FAILED and slots.allocator.num_referenced == 1  # a still sending; c not prefilled yet
    assert c.state is S.WAITING and sched.expired(now=100.0, ttl=3.0) == []  # not prefilled: no lease
    backend.complete("a")
    sched.poll()
    sched.prefilled(next_prefill(sched), 3, now=50.0)
    sched.release("c")
    sched.check_invariants()
    assert a.state is S.FINISHED and c.state is S.ABORTED
    assert slots.allocator.num_referenced == 0 and not sched.has_work()


def test_decode_overdue_waiting_and_transferring_but_not_ready_waiting(backend):
    slots = kv_cache(1)
    sched = DecodeScheduler(batch_size=1, kv=slots)
    w = DecodeSeq("w", "p:1", prompt_len=1, deadline=5.0)  # prefill never ready
    r = DecodeSeq("r", "p:1", prompt_len=1, deadline=5.0)  # ready, waits for room (decode's own capacity)
    t = DecodeSeq("t", "p:1", prompt_len=1, deadline=5.0)  # pull started, KV never arrives
    for s in (t, w, r):
        sched.add(s)
    sched.mark_ready("t", 1)
    sched.mark_ready("r", 1)
    assert sched.schedule_transfers() == [t]
    sched.set_recv_token(t, backend.expect("t", [Region(0, 4)], secret=SECRET))
    t.deadline = 8.0
    assert sched.overdue(4.9) == []
    assert sched.overdue(5.0) == [w]
    assert sched.overdue(8.0) == [w, t]
    backend.abort("t")
    for s in sched.overdue(8.0):
        sched.fail(s, "late")
    sched.check_invariants()
    assert (w.state, t.state, r.state) == (S.FAILED, S.FAILED, S.WAITING) and slots.allocator.num_referenced == 0
    sched.abort("r")
    assert not sched.has_work() and backend.outstanding() == set()


def test_the_default_memory_admits_open_ended_requests_on_their_prompts_alone(backend):
    """The default pool (8 x 2,048 tokens = 1,024 blocks of 16) admits 48 requests of 256 tokens without
    max_tokens (each may grow to 2,048) at once: each takes the 16 blocks of its prompt now, nothing for the
    output to come. Reserving max_model_len each, the pool held 8."""
    cache = kv_cache(8 * 2048 // 16, block_size=16)
    sched = DecodeScheduler(batch_size=48, kv=cache)
    for i in range(56):
        seq = DecodeSeq(f"r{i}", "p:1", prompt_len=256, final_len=2048)
        sched.add(seq)
        sched.mark_ready(seq.request_id, 1)
    started = sched.schedule_transfers()
    assert len(started) == 48 and sched.num_transferring == 48  # the batch is the limit, not the memory
    assert cache.allocator.num_referenced == 48 * 16
    sched.check_invariants()
    for seq in started:
        sched.abort(seq.request_id)
    assert cache.allocator.num_referenced == 0
