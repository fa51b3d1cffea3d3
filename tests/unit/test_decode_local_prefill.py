"""The decode scheduler's local prefills (``DecodeScheduler.plan_prefill``): requests its worker prefills itself
are admitted oldest first while the batch and the pool have room, their prompts computed at most ``budget`` tokens
a step over all of them (oldest first, a long one over several steps), their cached prefix skipped; each joins the
batch with its first token; they share the batch's places with the P/D requests; nothing is left behind."""

from __future__ import annotations

import pytest

from tests.unit.kv_fixtures import BLOCK, kv_cache
from xpyd.decode_worker.scheduler import DecodeScheduler
from xpyd.decode_worker.seq import DecodeSeq
from xpyd.worker.kv_cache import KVCache
from xpyd.worker.request import RequestState

S = RequestState


def local(cache: KVCache, rid: str, prompt: list[int], max_tokens: int = 4) -> DecodeSeq:
    """A local request with its facts, as the engine adds it (``LocalPrefill.facts``)."""
    hashes = cache.hashes(prompt)
    return DecodeSeq(rid, "d:1", local=True, known=True, prompt_ids=prompt, prompt_len=len(prompt), hashes=hashes,
                     tail=tuple(prompt[len(hashes) * BLOCK:]), final_len=len(prompt) + max_tokens)


def plan(sched: DecodeScheduler, budget: int) -> list[tuple[str, int, int]]:
    return [(c.seq.request_id, c.start, c.end) for c in sched.plan_prefill(budget)]


def report(sched: DecodeScheduler, cache: KVCache, chunks, first_token: int = 9) -> None:
    for c in chunks:
        if c.last:
            sched.prefill_done(c, first_token)
            cache.prompt_done(c.seq.kv, c.seq.prompt_len, c.seq.tail)
        else:
            sched.prefill_done(c)


def step(sched: DecodeScheduler, cache: KVCache, budget: int) -> list[tuple[str, int, int]]:
    chunks = sched.plan_prefill(budget)
    report(sched, cache, chunks)
    sched.check_invariants()
    return [(c.seq.request_id, c.start, c.end) for c in chunks]


def finish_all(sched: DecodeScheduler, cache: KVCache) -> None:
    for seq in sched.running():
        sched.finish(seq)
    assert not sched.has_work() and cache.allocator.num_referenced == 0  # (cached blocks stay, unreferenced)


def test_prompts_are_computed_oldest_first_within_the_step_budget():
    cache = kv_cache(64)
    sched = DecodeScheduler(batch_size=4, kv=cache)
    a, b = local(cache, "a", list(range(10))), local(cache, "b", list(range(100, 103)))
    sched.add(a)
    sched.add(b)
    assert sched.num_waiting == 2 and sched.waiting() == []  # (not waiting on a prefill worker: never claimed)
    assert step(sched, cache, 4) == [("a", 0, 4)]
    assert a.state is S.PREFILLING and b.state is S.PREFILLING  # both admitted: blocks for prompt + max_tokens
    assert step(sched, cache, 4) == [("a", 4, 8)]
    assert step(sched, cache, 4) == [("a", 8, 10), ("b", 0, 2)]  # a's last chunk, then b with what is left
    assert a.state is S.RUNNING and a.first_token == 9 and a.ready and a.landed
    assert step(sched, cache, 4) == [("b", 2, 3)]
    assert sched.running() == [a, b] and sched.plan_prefill(4) == []
    finish_all(sched, cache)


def test_a_cached_prefix_is_not_computed_again_but_the_last_token_always_is():
    cache = kv_cache(64)
    sched = DecodeScheduler(batch_size=4, kv=cache)
    prompt = list(range(12))  # three full blocks
    sched.add(local(cache, "first", prompt))
    assert step(sched, cache, 64) == [("first", 0, 12)]
    finish_all(sched, cache)
    again, longer = local(cache, "again", prompt), local(cache, "longer", prompt + [50, 51])
    sched.add(again)
    sched.add(longer)
    assert step(sched, cache, 64) == [("again", 8, 12), ("longer", 12, 14)]  # (the whole prompt cached: its last
    # block computed again for the first token's logits)
    assert (again.cached_tokens, longer.cached_tokens) == (8, 12)
    finish_all(sched, cache)


def test_local_and_pd_requests_share_the_batch():
    cache = kv_cache(64)
    sched = DecodeScheduler(batch_size=2, kv=cache)
    pd = DecodeSeq("pd", "p:1", prompt_len=4, final_len=6)
    sched.add(pd)
    sched.mark_ready("pd", 5)
    pd.hashes = cache.hashes([1, 2, 3, 4])
    assert sched.schedule_transfers() == [pd]
    a, b = local(cache, "a", list(range(6))), local(cache, "b", list(range(20, 26)))
    sched.add(a)
    sched.add(b)
    assert step(sched, cache, 8) == [("a", 0, 6)]  # one place left: b waits for it
    assert b.state is S.WAITING and b.kv is None
    assert sched.schedule_transfers() == []
    sched.abort("pd")
    assert step(sched, cache, 8) == [("b", 0, 6)]
    assert sched.running() == [a, b]
    finish_all(sched, cache)


def test_the_oldest_waits_for_blocks_rather_than_being_overtaken():
    cache = kv_cache(6)  # 24 tokens
    sched = DecodeScheduler(batch_size=4, kv=cache)
    big, small = local(cache, "big", list(range(12)), max_tokens=8), local(cache, "small", [1, 2], max_tokens=2)
    hog = local(cache, "hog", list(range(40, 48)), max_tokens=4)  # 3 blocks
    sched.add(hog)
    assert step(sched, cache, 2) == [("hog", 0, 2)]
    sched.add(big)  # needs 5 blocks: 3 are free
    sched.add(small)
    assert step(sched, cache, 2) == [("hog", 2, 4)] and big.state is S.WAITING and small.state is S.WAITING
    sched.abort("hog")
    assert step(sched, cache, 16) == [("big", 0, 12), ("small", 0, 2)]
    finish_all(sched, cache)


@pytest.mark.parametrize("state", ["waiting", "prefilling", "running"])
def test_a_local_request_ends_in_any_state_leaving_nothing(state):
    cache = kv_cache(8)
    sched = DecodeScheduler(batch_size=1, kv=cache)
    sched.add(local(cache, "busy", list(range(8))))
    seq = local(cache, "r", list(range(20, 30)))
    if state != "waiting":
        sched.abort("busy")
    sched.add(seq)
    if state == "prefilling":
        step(sched, cache, 4)
    elif state == "running":
        step(sched, cache, 64)
    assert seq.state.value == state
    sched.abort("r")
    sched.abort("busy")
    sched.check_invariants()
    assert seq.state is S.ABORTED and not sched.has_work() and cache.allocator.num_referenced == 0


def test_a_first_token_that_ends_the_request_finishes_it_from_prefilling():
    cache = kv_cache(8)
    sched = DecodeScheduler(batch_size=1, kv=cache)
    seq = local(cache, "r", [1, 2, 3], max_tokens=1)
    sched.add(seq)
    chunks = sched.plan_prefill(8)
    assert [c.last for c in chunks] == [True]
    sched.finish(seq)  # (the engine: the first token was its last)
    sched.check_invariants()
    assert not sched.has_work() and cache.allocator.num_referenced == 0


def test_misuse_is_refused():
    cache = kv_cache(8)
    sched = DecodeScheduler(batch_size=1, kv=cache)
    with pytest.raises(ValueError):
        sched.add(DecodeSeq("r", "d:1", local=True))  # without its prompt
    sched.add(local(cache, "r", [1, 2, 3, 4, 5]))
    with pytest.raises(ValueError):
        sched.plan_prefill(0)
    chunks = sched.plan_prefill(2)
    sched.prefill_done(chunks[0])
    with pytest.raises(Exception):
        sched.prefill_done(chunks[0])  # reported twice
    last = sched.plan_prefill(8)[0]
    with pytest.raises(Exception):
        sched.prefill_done(last)  # the last chunk comes with the first token
