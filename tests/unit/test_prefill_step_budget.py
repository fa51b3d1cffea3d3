"""A chunked prefill step's time budget: once the step cost is known (`step_cost`), each step's chunks take
at most what ``chunk`` tokens of a fresh prompt take, so a long prompt's later chunks (whose attention
covers more of the prompt) get fewer tokens and a short prompt that arrives waits at most one such step.

Costs here are set, not learned: per attention pair only (1 s a pair), so a step's budget with ``chunk=16``
is pairs(0, 16) = 136 s. Steps are planned and reported back as the engine does, invariants checked after
each, and every test ends with nothing held.
"""

from __future__ import annotations

from tests.unit.kv_fixtures import kv_cache
from tests.unit.test_prefill_chunking import seq, step
from xpyd.prefill_worker.scheduler import PrefillScheduler
from xpyd.prefill_worker.step_cost import MIN_STEPS, Coefficients, StepCost, pairs
from xpyd.worker.request import RequestState

S = RequestState
PER_PAIR = Coefficients(overhead=0.0, per_token=0.0, per_pair=1.0)


def scheduler(cost: StepCost, batch_size: int = 4) -> tuple[PrefillScheduler, object]:
    kv = kv_cache(64, block_size=4)
    return PrefillScheduler(batch_size=batch_size, kv=kv, chunk=16, cost=cost), kv


def finish(sched: PrefillScheduler, kv) -> None:
    """Run what is left, release what waits for a pull: nothing is held."""
    for _ in range(100):
        step(sched)
        for s in sched.transferring():
            sched.release(s.request_id, S.FINISHED)
        if not sched.has_work():
            break
    assert not sched.has_work() and kv.allocator.num_referenced == 0
    kv.allocator.check()


def test_later_chunks_of_a_long_prompt_get_fewer_tokens_in_the_same_time():
    sched, kv = scheduler(StepCost(coefficients=PER_PAIR))
    sched.add(seq("long", 64))
    assert step(sched) == [("long", 0, 16)]  # 136 pairs: the whole budget
    assert step(sched) == [("long", 16, 22)]  # 6 * 16 + 21 = 117 pairs (7 tokens: 140)
    assert step(sched) == [("long", 22, 27)]  # 5 * 22 + 15 = 125 (6: 153)
    for got in ([("long", 27, 31)], [("long", 31, 35)], [("long", 35, 38)]):
        assert step(sched) == got
        start, end = got[0][1:]
        assert pairs(start, end - start) <= pairs(0, 16) < pairs(start, end - start + 1)
    finish(sched, kv)


def test_a_short_prompt_behind_a_long_one_runs_alone_in_the_next_step():
    sched, kv = scheduler(StepCost(coefficients=PER_PAIR))
    sched.add(seq("long", 64))
    assert step(sched) == [("long", 0, 16)]
    sched.add(seq("s1", 5))
    sched.add(seq("s2", 9))
    # both whole (15 + 45 pairs, 14 tokens), shortest first; the long prompt does not lengthen their step
    assert step(sched) == [("s1", 0, 5), ("s2", 0, 9)]
    assert sched.get("s1").first_token == 7 and sched.get("s2").first_token == 7
    assert step(sched) == [("long", 16, 22)]
    finish(sched, kv)


def test_a_chunk_cut_short_by_the_time_fills_the_step():
    sched, kv = scheduler(StepCost(coefficients=PER_PAIR))
    sched.add(seq("a", 64))
    sched.add(seq("b", 64))
    assert step(sched) == [("a", 0, 16)]
    # a's chunk takes 117 of the 136 pairs: b is not started for the few tokens the rest would hold
    assert step(sched) == [("a", 16, 22)]
    assert sched.get("b").state is S.WAITING and sched.get("b").kv is None
    finish(sched, kv)


def test_a_step_computes_a_token_at_least_however_long_the_prefix():
    cost = StepCost(coefficients=Coefficients(0.0, 0.0, 1.0))
    sched, kv = scheduler(cost)
    sched.chunk = 2  # budget: pairs(0, 2) = 3, less than one token after 3 computed ones
    sched.add(seq("long", 8))
    assert step(sched) == [("long", 0, 2)]
    assert step(sched) == [("long", 2, 3)]  # 3 pairs
    assert step(sched) == [("long", 3, 4)]  # 4 pairs: over the budget, but a step makes progress
    finish(sched, kv)


def test_until_the_cost_is_learned_steps_are_budgeted_in_tokens():
    cost = StepCost()
    sched, kv = scheduler(cost, batch_size=2)
    sched.add(seq("long", 200))
    for i in range(MIN_STEPS):
        got = step(sched)
        assert got == [("long", 16 * i, 16 * (i + 1))]
        cost.observe([(16 * i, 16)], float(pairs(16 * i, 16)))  # as the engine does: its chunks, its seconds
    assert cost.known and abs(cost.step_seconds([(96, 16)]) - pairs(96, 16)) < 0.01 * pairs(96, 16)
    (got,) = step(sched)  # now sized by time: after 128 tokens, far fewer than 16 fit
    assert got[:2] == ("long", 16 * MIN_STEPS) and got[2] - got[1] < 4
    finish(sched, kv)


def test_a_streamed_prompt_cut_at_its_last_part_does_not_join_a_step_with_first_tokens():
    sched, kv = scheduler(StepCost())  # (tokens alone)
    long = seq("long", 40)
    sched.add(long)
    assert step(sched) == [("long", 0, 16)]
    long.split_at = 36  # (its pull: the last KV part starts at 36)
    assert step(sched) == [("long", 16, 32)]
    sched.add(seq("s1", 3))
    # long's remaining 8 tokens would fit after s1, but the chunk stops at 36 and would not end the prompt
    assert step(sched) == [("s1", 0, 3)]
    assert step(sched) == [("long", 32, 36)]
    assert step(sched) == [("long", 36, 40)]
    finish(sched, kv)


def test_a_step_giving_a_new_prompt_its_first_token_is_topped_up_to_half_the_budget_only():
    """A short prompt's step takes another prompt's ending chunk only while the step stays within TOP_UP_SHARE of
    the budget: the short prompt's first token does not wait for most of a long prompt's last chunk."""
    per_token = Coefficients(overhead=0.0, per_token=1.0, per_pair=0.0)  # the budget: 16 tokens' seconds
    sched, kv = scheduler(StepCost(coefficients=per_token))
    sched.add(seq("long", 26))
    assert step(sched) == [("long", 0, 16)]
    sched.add(seq("s1", 4))
    # s1 (4 s) and the long prompt's last 10 tokens (10 s) fit the 16 s budget, but not half of it: s1 alone
    assert step(sched) == [("s1", 0, 4)]
    assert step(sched) == [("long", 16, 26)]
    sched.add(seq("long2", 19))
    assert step(sched) == [("long2", 0, 16)]
    sched.add(seq("s2", 2))
    assert step(sched) == [("s2", 0, 2), ("long2", 16, 19)]  # 2 + 3 s: within half the budget, it ends there
    finish(sched, kv)
