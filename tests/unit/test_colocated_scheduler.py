"""The colocated (baseline) scheduler: prefill first while the batch has room; nothing leaks."""

from __future__ import annotations

import random

import pytest

from xpyd.colocated_worker.scheduler import ColocatedScheduler, ColocatedSeq
from xpyd.worker.request import IllegalTransition, RequestState
from tests.unit.kv_fixtures import kv_cache

S = RequestState


def test_prefill_first_until_batch_full():
    slots = kv_cache(2)
    sched = ColocatedScheduler(batch_size=2, kv=slots)
    seqs = [ColocatedSeq(f"r{i}", [1]) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert sched.next_prefill() is seqs[0]
    assert sched.next_prefill() is seqs[1]
    assert sched.next_prefill() is None  # batch full: decode steps only
    sched.check_invariants()
    sched.finish(seqs[0])
    assert sched.next_prefill() is seqs[2]  # a slot freed: the next prefill goes first
    sched.abort("r1")
    sched.fail(seqs[2], "x")
    assert [s.state for s in seqs] == [S.FINISHED, S.ABORTED, S.FAILED]
    assert slots.allocator.num_referenced == 0 and not sched.has_work()
    with pytest.raises(IllegalTransition):
        seqs[0].set_state(S.RUNNING)


def test_duplicates_and_abort_waiting():
    sched = ColocatedScheduler(batch_size=1, kv=kv_cache(1))
    sched.add(ColocatedSeq("a", [1]))
    with pytest.raises(ValueError):
        sched.add(ColocatedSeq("a", [1]))
    sched.add(ColocatedSeq("b", [1]))
    assert sched.abort("b").state is S.ABORTED
    assert sched.abort("zzz") is None
    assert sched.num_waiting == 1


def test_random_lifecycles_keep_invariants():
    rng = random.Random(7)
    slots = kv_cache(3)
    sched = ColocatedScheduler(batch_size=3, kv=slots)
    seqs = [ColocatedSeq(f"q{i}", [1]) for i in range(50)]
    pending = list(seqs)
    for _ in range(3000):
        if not pending and not sched.has_work():
            break
        if pending and rng.random() < 0.3:
            sched.add(pending.pop(0))
        if sched.next_prefill() is None:
            for s in sched.running():
                if rng.random() < 0.2:
                    sched.finish(s)
        if rng.random() < 0.03 and sched.has_work():
            victim = rng.choice(sched.running() or list(sched._waiting))
            sched.abort(victim.request_id)
        sched.check_invariants()
        assert sched.num_running == slots.allocator.num_referenced
    assert not pending and not sched.has_work() and slots.allocator.num_referenced == 0
    assert all(s.state.is_final for s in seqs)
