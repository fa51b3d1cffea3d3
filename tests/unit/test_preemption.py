"""Optimistic admission with preemption (``xpyd.worker.preemption``) in the decode and colocated schedulers:
requests hold the blocks of their tokens so far; when a running request needs a block and none is free the
newest request holding blocks is preempted (its blocks freed, its full ones left cached), queued ahead of every
request that never ran, and re-enters by computing its prompt and output so far again, its cached prefix
skipped; a request that can wait for blocks waits, nothing is preempted for it; a request longer than the whole
pool fails instead of looping. Every test checks the invariants as it goes and ends with nothing held.

``Tokens`` plays the engine: each request's tokens so far (prompt, then output) and what each KV block holds,
written by the prefill chunks and decode steps the schedulers plan; before each decode step every running
request's blocks must hold exactly its tokens, so a prefix reused after a preemption is the right one.
"""

from __future__ import annotations

import random

import pytest

from tests.unit.kv_fixtures import BLOCK, kv_cache
from xpyd.colocated_worker.scheduler import ColocatedScheduler, ColocatedSeq
from xpyd.decode_worker.scheduler import DecodeScheduler
from xpyd.decode_worker.seq import DecodeSeq
from xpyd.worker.kv_cache import KVCache
from xpyd.worker.request import IllegalTransition, RequestState

S = RequestState


class Tokens:
    """The engine's side: tokens per request, and the token each written KV slot holds."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.ids: dict[str, list[int]] = {}
        self.slots: dict[tuple[int, int], int] = {}  # (block, offset) -> token written there

    def length(self, seq) -> int:
        return len(self.ids[seq.request_id])

    def context(self, seq) -> list[int]:
        return list(self.ids[seq.request_id][:-1])

    def write(self, seq, ids, start: int, end: int) -> None:
        for pos in range(start, end):
            self.slots[(seq.kv.blocks[pos // BLOCK], pos % BLOCK)] = ids[pos]

    def check_kv(self, seq, upto: int) -> None:
        """``seq``'s blocks hold its first ``upto`` tokens."""
        got = [self.slots.get((seq.kv.blocks[p // BLOCK], p % BLOCK)) for p in range(upto)]
        assert got == self.ids[seq.request_id][:upto], seq.request_id

    def decode(self, sched) -> object:
        """``reserve_decode``, then one decode step: each running request's last token written, one sampled."""
        room = sched.reserve_decode(self.length, self.context)
        sched.check_invariants()
        for seq in sched.running():
            ids = self.ids[seq.request_id]
            assert len(seq.kv.blocks) >= self.cache.blocks_for(len(ids))
            self.check_kv(seq, len(ids) - 1)
            self.write(seq, ids, len(ids) - 1, len(ids))
            self.cache.append_tokens(seq.kv, ids[-1:])
            assert seq.kv.hashes == self.cache.hashes(ids), seq.request_id  # (its chain names its tokens: the
            # blocks it caches are found by the requests that share them, and only by those)
            ids.append(1000 + len(ids))
        return room


# --- decode ---------------------------------------------------------------------------------------------------

def pd(cache: KVCache, tokens: Tokens, sched: DecodeScheduler, rid: str, prompt: list[int]) -> DecodeSeq:
    """A P/D request whose KV landed and whose first token is known: running."""
    hashes = cache.hashes(prompt)
    seq = DecodeSeq(rid, "p:1", prompt_len=len(prompt), final_len=2048, hashes=hashes,
                    tail=tuple(prompt[len(hashes) * BLOCK:]))
    sched.add(seq)
    sched.mark_ready(rid, 500)
    tokens.ids[rid] = [*prompt, 500]
    return seq


def land(sched: DecodeScheduler, cache: KVCache, tokens: Tokens) -> list[DecodeSeq]:
    """Admit the ready P/D requests and land their KV at once (the pulled blocks written)."""
    started = sched.schedule_transfers()
    for seq in started:
        tokens.write(seq, tokens.ids[seq.request_id], seq.kv.cached_tokens, seq.prompt_len)
        sched.skip_transfer(seq)
        cache.prompt_done(seq.kv, seq.prompt_len, seq.tail)
    return started


def local(cache: KVCache, tokens: Tokens, rid: str, prompt: list[int]) -> DecodeSeq:
    hashes = cache.hashes(prompt)
    tokens.ids[rid] = list(prompt)
    return DecodeSeq(rid, "d:1", local=True, known=True, prompt_ids=prompt, prompt_len=len(prompt), hashes=hashes,
                     tail=tuple(prompt[len(hashes) * BLOCK:]), final_len=2048)


def prefill(sched: DecodeScheduler, cache: KVCache, tokens: Tokens, budget: int) -> list:
    """One local prefill step as ``LocalPrefill.step`` runs it: chunks written, prompts' first tokens sampled,
    recomputes joining the batch with nothing sampled."""
    chunks = sched.plan_prefill(budget)
    for c in chunks:
        ids = tokens.ids[c.seq.request_id]
        assert list(c.ids) == ids[: c.end]  # a recompute's: the prompt and the output but its last token
        tokens.write(c.seq, c.ids, c.start, c.end)
        if not c.last:
            sched.prefill_done(c)
        elif c.replay:
            sched.prefill_done(c)
            cache.prompt_done(c.seq.kv, c.end, c.seq.tail)
        else:
            sched.prefill_done(c, 500)
            cache.prompt_done(c.seq.kv, c.end, c.seq.tail)
            ids.append(500)
    sched.check_invariants()
    return [(c.seq.request_id, c.start, c.end, c.replay) for c in chunks]


def test_the_newest_is_preempted_its_blocks_freed_and_it_reenters_first_by_recompute():
    cache = kv_cache(6)
    tokens = Tokens(cache)
    sched = DecodeScheduler(batch_size=8, kv=cache)
    a = pd(cache, tokens, sched, "a", [1, 2, 3])
    b = pd(cache, tokens, sched, "b", [4, 5, 6, 7])
    c = pd(cache, tokens, sched, "c", [8, 9, 10, 11])
    assert land(sched, cache, tokens) == [a, b, c] and cache.allocator.num_referenced == 3
    for _ in range(4):  # a, b and c grow to 2 blocks each: the pool is full
        assert tokens.decode(sched).preempted == []
    assert cache.allocator.num_free == 0 and [len(s.kv.blocks) for s in (a, b, c)] == [2, 2, 2]
    room = tokens.decode(sched)  # b needs its third block: c, the newest, gives its two back
    assert room.preempted == [c] and room.failed == [] and sched.preemptions == 1
    assert c.state is S.PREEMPTED and c.kv is None and c.preemptions == 1 and sched.preempted() == [c]
    assert list(c.recompute) == tokens.ids["c"][:-1] and len(c.recompute) == 8
    assert sched.running() == [a, b] and cache.allocator.num_referenced == 5 and sched.num_waiting == 1
    # it waits ahead of every request that never ran: no pull, no local prefill starts before it
    d = local(cache, tokens, "d", [20, 21])
    sched.add(d)
    e = pd(cache, tokens, sched, "e", [30])
    assert land(sched, cache, tokens) == [] and prefill(sched, cache, tokens, 16) == []
    sched.finish(a)  # room: c re-enters, its first block found in the prefix cache
    assert prefill(sched, cache, tokens, 16) == [("c", 4, 8, True)]
    assert c.state is S.RUNNING and c.kv.cached_tokens == 4 and len(c.kv.blocks) == 3  # and its next token's
    assert d.state is S.WAITING and e.state is S.WAITING  # no block left for them
    tokens.decode(sched)  # c continues with the token it had: its KV holds exactly its tokens (checked)
    assert tokens.ids["c"][-2:] == [1008, 1009]
    for seq in sched.running():
        sched.finish(seq)
    assert prefill(sched, cache, tokens, 16) == [("d", 0, 2, False)]
    assert land(sched, cache, tokens) == [e]
    for seq in sched.running():
        sched.finish(seq)
    sched.check_invariants()
    assert not sched.has_work() and cache.allocator.num_referenced == 0


def test_nothing_is_preempted_for_a_request_that_can_wait():
    cache = kv_cache(4)
    tokens = Tokens(cache)
    sched = DecodeScheduler(batch_size=8, kv=cache)
    a = pd(cache, tokens, sched, "a", [1, 2, 3, 4, 5, 6])
    b = pd(cache, tokens, sched, "b", [7, 8, 9, 10, 11, 12])
    land(sched, cache, tokens)
    assert cache.allocator.num_free == 0
    late = pd(cache, tokens, sched, "late", [13])
    sched.add(local(cache, tokens, "mine", [14]))
    for _ in range(2):  # a and b fill their second blocks: no block needed, none taken
        assert tokens.decode(sched).preempted == []
        assert land(sched, cache, tokens) == [] and prefill(sched, cache, tokens, 8) == []
    assert late.state is S.WAITING and sched.num_waiting == 2 and sched.preemptions == 0
    assert a.state is b.state is S.RUNNING
    for rid in ("a", "b", "late", "mine"):
        sched.abort(rid)
    assert not sched.has_work() and cache.allocator.num_referenced == 0


def test_a_request_alone_that_outgrows_the_pool_fails_rather_than_looping():
    cache = kv_cache(2)  # 8 tokens
    tokens = Tokens(cache)
    sched = DecodeScheduler(batch_size=2, kv=cache)
    seq = local(cache, tokens, "long", [1, 2, 3, 4, 5])
    sched.add(seq)
    prefill(sched, cache, tokens, 8)
    for _ in range(3):
        assert tokens.decode(sched) .failed == []
    room = tokens.decode(sched)  # 9 tokens: more than the whole pool
    assert room.failed == [seq] and room.preempted == [] and seq.state is S.FAILED
    assert seq.error == ("the request needs the KV of 9 tokens, more than this worker's whole KV cache holds "
                         "(8 tokens)")
    assert not sched.has_work() and cache.allocator.num_referenced == 0 and sched.preemptions == 0


def test_the_newest_preempts_itself_when_only_kv_being_received_holds_the_rest():
    cache = kv_cache(4)
    tokens = Tokens(cache)
    sched = DecodeScheduler(batch_size=4, kv=cache)
    a = pd(cache, tokens, sched, "a", [1, 2, 3])
    land(sched, cache, tokens)
    b = pd(cache, tokens, sched, "b", list(range(10, 22)))
    assert sched.schedule_transfers() == [b] and cache.allocator.num_free == 0  # its KV is on the way
    assert tokens.decode(sched).preempted == []  # (a's 4 tokens fill its block)
    room = tokens.decode(sched)  # a needs a second block: b cannot give its blocks back, a can
    assert room.preempted == [a] and a.state is S.PREEMPTED and b.state is S.TRANSFERRING
    tokens.write(b, tokens.ids["b"], 0, 12)
    sched.skip_transfer(b)  # (landed)
    cache.prompt_done(b.kv, 12, b.tail)
    assert tokens.decode(sched).preempted == []  # b takes a's freed block
    assert prefill(sched, cache, tokens, 8) == []  # a waits for blocks
    sched.finish(b)
    assert prefill(sched, cache, tokens, 8) == [("a", 0, 4, True)] and a.state is S.RUNNING  # (its block evicted)
    tokens.decode(sched)
    sched.finish(a)
    assert not sched.has_work() and cache.allocator.num_referenced == 0


def test_a_local_prompt_preempted_before_its_first_token_computes_it_again():
    cache = kv_cache(4)
    tokens = Tokens(cache)
    sched = DecodeScheduler(batch_size=4, kv=cache)
    old = pd(cache, tokens, sched, "old", [1, 2, 3, 4])
    land(sched, cache, tokens)
    new = local(cache, tokens, "new", list(range(30, 38)))
    sched.add(new)
    assert prefill(sched, cache, tokens, 4) == [("new", 0, 4, False)]  # half its prompt; 3 blocks (and the next)
    cached = new.cached_tokens
    assert tokens.decode(sched).preempted == [new]  # old needs its second block
    assert new.state is S.PREEMPTED and not new.ready and new.recompute == ()
    sched.finish(old)
    assert prefill(sched, cache, tokens, 16) == [("new", 0, 8, False)]  # (its chunk's blocks were never cached)
    assert new.state is S.RUNNING and new.first_token == 500 and new.cached_tokens == cached
    sched.finish(new)
    sched.check_invariants()
    assert not sched.has_work() and cache.allocator.num_referenced == 0


def test_preempted_requests_end_in_any_state_and_illegal_moves_are_refused():
    cache = kv_cache(2)
    tokens = Tokens(cache)
    sched = DecodeScheduler(batch_size=2, kv=cache)
    a = pd(cache, tokens, sched, "a", [1, 2, 3])
    b = pd(cache, tokens, sched, "b", [4, 5, 6])
    land(sched, cache, tokens)
    tokens.decode(sched)
    assert tokens.decode(sched).preempted == [b]
    with pytest.raises(IllegalTransition):
        b.set_state(S.RUNNING)  # (it re-enters by computing its KV: prefilling first)
    assert sched.abort("b") is b and b.state is S.ABORTED
    sched.fail(a, "x")
    sched.check_invariants()
    assert not sched.has_work() and cache.allocator.num_referenced == 0


@pytest.mark.parametrize("seed", range(4))
def test_decode_random_lifecycles_under_memory_pressure(seed):
    """P/D and local requests of random lengths in a pool too small for them all: preemptions happen, every
    request's KV holds its tokens at every decode step (checked), invariants hold, nothing leaks."""
    rng = random.Random(seed)
    cache = kv_cache(24)
    tokens = Tokens(cache)
    sched = DecodeScheduler(batch_size=6, kv=cache)
    stems = [[rng.randrange(100) for _ in range(8)] for _ in range(3)]  # shared prefixes
    todo = [(f"q{i}", rng.choice(stems)[: rng.randint(1, 8)] + [rng.randrange(100) for _ in range(rng.randint(1, 12))],
             rng.random() < 0.4, rng.randint(2, 40)) for i in range(40)]
    wanted = {rid: n for rid, _, _, n in todo}
    seqs = []
    for _ in range(5000):
        if not todo and not sched.has_work():
            break
        if todo and rng.random() < 0.3:
            rid, prompt, is_local, _ = todo.pop(0)
            if is_local:
                seqs.append(local(cache, tokens, rid, prompt))
                sched.add(seqs[-1])
            else:
                seqs.append(pd(cache, tokens, sched, rid, prompt))
        land(sched, cache, tokens)
        prefill(sched, cache, tokens, rng.choice([3, 8, 64]))
        if sched.running():
            room = tokens.decode(sched)
            assert room.failed == []
        for seq in sched.running():
            if len(tokens.ids[seq.request_id]) - seq.prompt_len >= wanted[seq.request_id]:
                sched.finish(seq)
        if rng.random() < 0.01 and sched.has_work():
            victim = rng.choice(sched.running() + sched.preempted() + sched.prefilling() or sched.waiting())
            sched.abort(victim.request_id)
        sched.check_invariants()
    assert not todo and not sched.has_work() and cache.allocator.num_referenced == 0
    assert all(s.state in (S.FINISHED, S.ABORTED) for s in seqs)
    assert sched.preemptions > 0
    cache.allocator.check()


# --- colocated ------------------------------------------------------------------------------------------------

def colocated(cache: KVCache, tokens: Tokens, rid: str, prompt: list[int]) -> ColocatedSeq:
    tokens.ids[rid] = list(prompt)
    return ColocatedSeq(rid, list(prompt), hashes=cache.hashes(prompt))


def co_step(sched: ColocatedScheduler, cache: KVCache, tokens: Tokens):
    """One colocated engine step: room made for the running requests, then a prefill (or recompute) or a
    decode step; (what ran, the room made)."""
    room = sched.reserve_decode(tokens.length, tokens.context) if sched.running() else None
    seq = sched.next_prefill()
    if seq is None:
        if sched.running():
            tokens.decode(sched)
        return "decode", room
    ids = seq.recompute or seq.prompt_ids
    assert list(ids) == tokens.ids[seq.request_id][: len(ids)]
    tokens.write(seq, ids, seq.kv.cached_tokens, len(ids))
    cache.prompt_done(seq.kv, len(ids), ids[len(seq.kv.hashes) * BLOCK:])
    if not seq.recompute:
        tokens.ids[seq.request_id].append(500)
    sched.check_invariants()
    return ("recompute" if seq.recompute else "prefill", seq.request_id), room


def test_colocated_preempts_the_newest_and_recomputes_it_first():
    cache = kv_cache(4)
    tokens = Tokens(cache)
    sched = ColocatedScheduler(batch_size=4, kv=cache)
    a, b = colocated(cache, tokens, "a", [1, 2, 3, 4, 5]), colocated(cache, tokens, "b", [6, 7, 8, 9, 10])
    sched.add(a)
    sched.add(b)
    assert co_step(sched, cache, tokens)[0] == ("prefill", "a")
    assert co_step(sched, cache, tokens)[0] == ("prefill", "b")  # 2 blocks each (prompt and first token)
    sched.add(colocated(cache, tokens, "c", [11]))
    for _ in range(3):  # c waits: no block is free; a and b fill their second blocks
        what, room = co_step(sched, cache, tokens)
        assert what == "decode" and room.preempted == []
    what, room = co_step(sched, cache, tokens)  # a needs its third block: b, the newest, gives its back
    assert room.preempted == [b] and b.state is S.PREEMPTED and sched.preemptions == 1 and what == "decode"
    assert list(b.recompute) == tokens.ids["b"][:-1] and sched.num_preempted == 1 and sched.num_waiting == 2
    assert cache.allocator.num_referenced == 3
    sched.finish(a)
    what, _ = co_step(sched, cache, tokens)
    assert what == ("recompute", "b") and b.state is S.RUNNING and b.kv.cached_tokens == 4  # ahead of c
    before = list(tokens.ids["b"])
    co_step(sched, cache, tokens)  # c's prefill (prefill first)
    co_step(sched, cache, tokens)  # a decode step: b's KV holds its tokens (checked), one more sampled
    assert tokens.ids["b"][:-1] == before
    for seq in sched.running():
        sched.finish(seq)
    sched.check_invariants()
    assert not sched.has_work() and cache.allocator.num_referenced == 0


def test_colocated_request_alone_that_outgrows_the_pool_fails():
    cache = kv_cache(2)
    tokens = Tokens(cache)
    sched = ColocatedScheduler(batch_size=2, kv=cache)
    seq = colocated(cache, tokens, "long", [1, 2, 3, 4, 5])
    sched.add(seq)
    co_step(sched, cache, tokens)
    for _ in range(3):
        co_step(sched, cache, tokens)
    _, room = co_step(sched, cache, tokens)
    assert room.failed == [seq] and seq.state is S.FAILED and "whole KV cache holds (8 tokens)" in seq.error
    assert not sched.has_work() and cache.allocator.num_referenced == 0


@pytest.mark.parametrize("seed", range(3))
def test_colocated_random_lifecycles_under_memory_pressure(seed):
    rng = random.Random(seed)
    cache = kv_cache(16)
    tokens = Tokens(cache)
    sched = ColocatedScheduler(batch_size=5, kv=cache)
    stem = [rng.randrange(100) for _ in range(8)]
    todo = [(f"q{i}", stem[: rng.randint(0, 8)] + [rng.randrange(100) for _ in range(rng.randint(1, 10))],
             rng.randint(2, 30)) for i in range(30)]
    wanted = {rid: n for rid, _, n in todo}
    seqs = []
    for _ in range(5000):
        if not todo and not sched.has_work():
            break
        if todo and rng.random() < 0.3:
            rid, prompt, _ = todo.pop(0)
            seqs.append(colocated(cache, tokens, rid, prompt))
            sched.add(seqs[-1])
        _, room = co_step(sched, cache, tokens)
        assert room is None or room.failed == []
        for seq in sched.running():
            if len(tokens.ids[seq.request_id]) - seq.prompt_len >= wanted[seq.request_id]:
                sched.finish(seq)
        sched.check_invariants()
    assert not todo and not sched.has_work() and cache.allocator.num_referenced == 0
    assert all(s.state is S.FINISHED for s in seqs) and sched.preemptions > 0
    cache.allocator.check()
