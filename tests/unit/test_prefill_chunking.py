"""Chunked prefill scheduling: what each step computes, who goes first, and that nothing is lost or starved.

Steps are planned and reported back as the engine does (``plan`` -> ``chunk_done`` / ``prefilled``), with
real KV blocks (`kv_fixtures`); invariants are checked after every step.
"""

from __future__ import annotations

import random

import pytest

from tests.unit.kv_fixtures import kv_cache
from xpyd.prefill_worker.scheduler import Chunk, PrefillScheduler, PrefillSeq
from xpyd.worker.request import RequestState

S = RequestState


def seq(rid: str, n: int, peer: str = "D") -> PrefillSeq:
    return PrefillSeq(rid, list(range(1, n + 1)), peer=peer)


def step(sched: PrefillScheduler) -> list[tuple[str, int, int]]:
    """Plan one step, report it back (first token 7 for prompts it ends); what it computed."""
    chunks = sched.plan()
    for c in chunks:
        if c.last:
            sched.prefilled(c.seq, 7)
        else:
            sched.chunk_done(c)
    sched.check_invariants()
    return [(c.seq.request_id, c.start, c.end) for c in chunks]


def test_a_long_prompt_runs_in_chunks_continuing_from_its_own_kv():
    sched = PrefillScheduler(batch_size=2, kv=kv_cache(32, block_size=4), chunk=16)
    long = seq("long", 40)
    sched.add(long)
    assert step(sched) == [("long", 0, 16)]
    assert long.state is S.RUNNING and long.computed == 16 and len(long.kv.blocks) == 10  # the whole prompt's
    assert sched.queued_tokens() == 24
    assert step(sched) == [("long", 16, 32)]
    assert step(sched) == [("long", 32, 40)]
    assert long.state is S.TRANSFERRING and long.first_token == 7
    assert step(sched) == [] and sched.queued_tokens() == 0


def test_short_prompts_overtake_a_long_one_and_share_a_step_without_it():
    sched = PrefillScheduler(batch_size=8, kv=kv_cache(64, block_size=4), chunk=16)
    sched.add(seq("long", 48))
    assert step(sched) == [("long", 0, 16)]
    sched.add(seq("s1", 5))
    sched.add(seq("s2", 6))
    # the short prompts first (shortest first), whole, in one forward; the long one is not continued in a
    # step that starts prompts (their first token comes after their own tokens alone)
    assert step(sched) == [("s1", 0, 5), ("s2", 0, 6)]
    assert [sched.get(r).state for r in ("s1", "s2")] == [S.TRANSFERRING, S.TRANSFERRING]
    assert step(sched) == [("long", 16, 32)]
    assert step(sched) == [("long", 32, 48)]


def test_a_running_prompt_that_ends_in_the_step_joins_the_new_prompts():
    sched = PrefillScheduler(batch_size=8, kv=kv_cache(64, block_size=4), chunk=16)
    sched.add(seq("long", 44))
    assert step(sched) == [("long", 0, 16)]
    assert step(sched) == [("long", 16, 32)]
    sched.add(seq("s1", 3))
    sched.add(seq("s2", 14))
    # s1 starts the step; long's last 12 tokens fit after it (its prompt ends: its first token); s2 waits
    assert step(sched) == [("s1", 0, 3), ("long", 32, 44)]
    assert step(sched) == [("s2", 0, 14)]
    assert not sched.running() and sched.num_transferring == 3


def test_an_aged_running_prompt_is_continued_in_a_step_that_starts_new_ones():
    sched = PrefillScheduler(batch_size=8, kv=kv_cache(128, block_size=4), chunk=8, age_steps=2)
    sched.add(seq("long", 40))
    assert step(sched) == [("long", 0, 8)]
    sched.add(seq("s1", 4))
    sched.add(seq("s2", 4))
    assert step(sched) == [("s1", 0, 4), ("s2", 0, 4)]  # long: no token (1)
    sched.add(seq("s3", 2))
    sched.add(seq("s4", 8))
    assert step(sched) == [("s3", 0, 2)]  # s4 would not end in it: no token for it (1) nor for long (2: aged)
    sched.add(seq("s5", 1))
    assert step(sched) == [("long", 8, 16)]  # aged first; its chunk fills the step (s4: 2, aged)
    assert step(sched) == [("s4", 0, 8)]  # aged, older than s5
    assert step(sched) == [("s5", 0, 1)]  # (long, not aged, would not end after it)
    assert step(sched) == [("long", 16, 24)]


def test_a_short_prompt_waiting_behind_a_running_long_one_runs_next_step():
    sched = PrefillScheduler(batch_size=2, kv=kv_cache(64, block_size=4), chunk=8)
    sched.add(seq("long", 64))
    step(sched)
    sched.add(seq("short", 3))
    assert step(sched)[0] == ("short", 0, 3)


def test_aging_a_long_prompt_is_never_starved_by_a_stream_of_short_ones():
    sched = PrefillScheduler(batch_size=8, kv=kv_cache(256, block_size=4), chunk=8, age_steps=3)
    sched.add(seq("long", 20))
    for i in range(2):
        sched.add(seq(f"s{i}", 8))  # each short prompt fills a whole step
    got, at = [], []
    for i in range(14):
        sched.add(seq(f"s{i + 2}", 8))
        mine = [c for c in step(sched) if c[0] == "long"]
        got += mine
        at += [i] * len(mine)
        if sched.get("long").state is S.TRANSFERRING:
            break
    # skipped 3 steps in a row, then first; then behind the short prompts that aged meanwhile (oldest
    # first among aged requests), then first again
    assert got == [("long", 0, 8), ("long", 8, 16), ("long", 16, 20)]
    assert at == [3, 8, 9]


def test_release_of_a_paused_request_frees_it_now_of_one_in_the_step_when_reported():
    kv = kv_cache(32, block_size=4)
    sched = PrefillScheduler(batch_size=2, kv=kv, chunk=8)
    a, b = seq("a", 20), seq("b", 20)
    sched.add(a)
    sched.add(b)
    step(sched)  # a's first chunk
    chunks = sched.plan()
    assert [(c.seq.request_id, c.start) for c in chunks] == [("a", 8)]
    assert b.state is S.WAITING  # (a took the whole step; b never started)
    sched.release("a")  # a is in the step being computed: marked, ended when reported
    assert a.state is S.RUNNING and a.cancel_requested
    sched.chunk_done(chunks[0])
    assert a.state is S.ABORTED and a.kv is None
    step(sched)  # b's first chunk
    sched.release("b")  # paused between chunks: ended at once
    assert b.state is S.ABORTED and kv.allocator.num_referenced == 0
    sched.check_invariants()
    assert not sched.has_work()


def test_a_cached_prefix_is_not_computed_again():
    kv = kv_cache(32, block_size=4)
    sched = PrefillScheduler(batch_size=2, kv=kv, chunk=8)
    first = seq("first", 12)
    first.hashes = kv.hashes(first.prompt_ids)
    sched.add(first)
    step(sched)
    kv.cache_blocks(first.kv, 8)  # (the engine caches each chunk's full blocks)
    second = seq("second", 14)
    second.hashes = kv.hashes(second.prompt_ids)
    sched.add(second)
    # first's rest (shorter) goes first; second starts after its first 8 tokens: first's cached blocks
    assert step(sched) == [("first", 8, 12), ("second", 8, 12)]
    assert second.kv.cached_tokens == 8 and second.kv.blocks[:2] == first.kv.blocks[:2]


def test_plan_before_the_step_is_reported_back_and_last_chunk_misreported_raise():
    sched = PrefillScheduler(batch_size=1, kv=kv_cache(8, block_size=4), chunk=4)
    sched.add(seq("a", 6))
    chunks = sched.plan()
    with pytest.raises(ValueError):
        sched.plan()
    sched.chunk_done(chunks[0])
    (last,) = sched.plan()
    with pytest.raises(ValueError, match="prefilled"):
        sched.chunk_done(last)
    sched.prefilled(last.seq, 1)
    with pytest.raises(ValueError):
        sched.prefilled(last.seq, 1)


def test_unchunked_runs_whole_prompts_oldest_first():
    sched = PrefillScheduler(batch_size=4, kv=kv_cache(64, block_size=4), chunk=0)
    sched.add(seq("long", 48))
    sched.add(seq("short", 3))
    assert step(sched) == [("long", 0, 48)]
    assert step(sched) == [("short", 0, 3)]


@pytest.mark.parametrize("seed", range(6))
def test_random_lifecycles_keep_invariants_finish_everything_and_starve_nobody(seed):
    """Random arrivals (short and long), releases, sends finishing, a small pool and several decode
    workers: after every step the invariants hold; a runnable request never goes more than age_steps +
    batch steps without a token; everything ends and every block comes back."""
    rng = random.Random(seed)
    kv = kv_cache(48, block_size=4)
    batch, age = 4, 4
    sched = PrefillScheduler(batch_size=batch, kv=kv, chunk=rng.choice([4, 8, 13]), age_steps=age)
    seqs: list[PrefillSeq] = []
    waited: dict[str, int] = {}
    for t in range(400):
        if t < 300 and rng.random() < 0.3:
            s = seq(f"r{t}", rng.choice([1, 3, 7, 20, 41, 90]), peer=rng.choice("AB"))
            s.hashes = kv.hashes(s.prompt_ids) if rng.random() < 0.5 else []
            sched.add(s)
            seqs.append(s)
        if rng.random() < 0.05 and seqs:
            victim = rng.choice(seqs)
            if not victim.state.is_final and not victim.in_step:
                sched.release(victim.request_id)
        for s in sched.transferring():  # decode pulls; the send ends at once
            if rng.random() < 0.4:
                sched.release(s.request_id, S.FINISHED)
        before = {s.request_id: s.computed for s in sched.running()}
        chunks = sched.plan()
        assert sum(c.end - c.start for c in chunks) <= sched.chunk
        for c in chunks:
            (sched.prefilled(c.seq, 1) if c.last else sched.chunk_done(c))
        sched.check_invariants()
        for s in sched.running():  # admitted and runnable: counted while it gets nothing
            progressed = s.computed > before.get(s.request_id, -1)
            waited[s.request_id] = 0 if progressed else waited.get(s.request_id, 0) + 1
            assert waited[s.request_id] <= age + batch, f"{s.request_id} starved"
    for _ in range(400):
        for s in sched.transferring():
            sched.release(s.request_id, S.FINISHED)
        step(sched)
        if not sched.has_work():
            break
    assert not sched.has_work() and all(s.state.is_final for s in seqs)
    assert kv.allocator.num_referenced == 0
    kv.allocator.check()


def test_chunk_of_a_plan_names_its_tokens():
    s = seq("a", 10)
    assert Chunk(s, 4, 10).last and not Chunk(s, 0, 4).last


def test_a_streamed_prompt_ends_with_a_chunk_of_its_last_kv_part_alone():
    sched = PrefillScheduler(batch_size=2, kv=kv_cache(64, block_size=4), chunk=16)
    long = seq("long", 40)
    sched.add(long)
    assert step(sched) == [("long", 0, 16)]
    long.split_at = 36  # (the engine sets it from the pull: where the last part of the KV starts)
    assert step(sched) == [("long", 16, 32)]
    assert step(sched) == [("long", 32, 36)]  # would cross 36: stops there
    assert step(sched) == [("long", 36, 40)]  # the last chunk: the last part's tokens only
