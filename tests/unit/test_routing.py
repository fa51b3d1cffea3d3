"""Routing policies and the worker table: load scores, burst spreading, mark-down and recovery, and
the cache-aware router's choices (prefix holders, overload, cold requests, ties)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from xpyd.discovery.types import Role, WorkerInfo
from xpyd.proxy.prefix_index import KVUpdate, PrefixIndex, PromptKeys
from xpyd.proxy.routing import (
    CacheAwareRouter,
    LeastLoadedRouter,
    NoWorkerError,
    Policy,
    RoundRobinRouter,
    make_router,
)
from xpyd.proxy.workers import Health, Stats, WorkerTable


def worker(i: int, role: Role = Role.DECODE, capacity: int = 8) -> WorkerInfo:
    return WorkerInfo(role, f"http://10.0.0.{i}:8000", f"10.0.0.{i}:9000", "m", 1, capacity)


def report(table: WorkerTable, w: WorkerInfo, waiting: int = 0, running: int = 0,
           transferring: int = 0) -> None:
    table.report(w, Stats(waiting, running, transferring), table.report_mark(w))


def burst(router, workers: list[WorkerInfo], n: int, role: Role = Role.DECODE) -> Counter:
    """``n`` requests picked and started before any report or finish."""
    counts: Counter = Counter()
    for _ in range(n):
        w = router.pick(role, workers)
        router.started(w)
        counts[w.http_url] += 1
    return counts


# ------------------------------------------------------------------ least loaded


def test_least_loaded_picks_the_lowest_score():
    table = WorkerTable()
    router = LeastLoadedRouter(table)
    a, b, c = worker(1), worker(2), worker(3, capacity=2)
    table.sync(Role.DECODE, [a, b, c])
    report(table, a, waiting=2, running=4)  # 6/8
    report(table, b, running=3, transferring=1)  # 4/8
    report(table, c, running=2)  # 2/2: the lowest count is not the lowest load
    for _ in range(3):
        assert router.pick(Role.DECODE, [a, b, c]) == b  # picking alone changes nothing
    assert [s.score for s in table.sync(Role.DECODE, [a, b, c])] == [0.75, 0.5, 1.0]
    router.started(b)
    router.started(b)  # now 6/8, as a: they take turns, c is still the fullest
    assert {router.pick(Role.DECODE, [a, b, c]) for _ in range(4)} == {a, b}


def test_burst_spreads_evenly_over_equal_workers():
    table = WorkerTable()
    router = LeastLoadedRouter(table)
    workers = [worker(i) for i in range(4)]
    for w in workers:
        table.sync(Role.DECODE, workers)
        report(table, w, running=1)
    counts = burst(router, workers, 100)
    assert sorted(counts.values()) == [25, 25, 25, 25]
    # Without any report the proxy's own in-flight count stands in.
    table2 = WorkerTable()
    assert sorted(burst(LeastLoadedRouter(table2), workers, 10).values()) == [2, 2, 3, 3]


def test_burst_fills_the_idle_worker_first():
    table = WorkerTable()
    router = LeastLoadedRouter(table)
    busy, idle = worker(1), worker(2)
    table.sync(Role.DECODE, [busy, idle])
    report(table, busy, waiting=3, running=1)
    counts = burst(router, [busy, idle], 10)
    assert counts == {idle.http_url: 7, busy.http_url: 3}  # 4 to catch up, then turn about


def test_equal_scores_share_in_shuffled_rounds():
    table = WorkerTable()
    router = LeastLoadedRouter(table)
    workers = [worker(i) for i in range(3)]
    # Finished at once: scores stay equal (0), so only the tie-break spreads them.
    picks = []
    for _ in range(30):
        w = router.pick(Role.DECODE, workers)
        router.started(w)
        router.finished(w)
        picks.append(workers.index(w))
    rounds = [tuple(picks[i:i + 3]) for i in range(0, 30, 3)]
    assert all(sorted(r) == [0, 1, 2] for r in rounds)  # everyone once per round
    assert len(set(rounds)) > 1  # in a new order each round


def test_prefill_and_decode_pairs_mix():
    table = WorkerTable()
    router = LeastLoadedRouter(table)
    prefill = [worker(i, Role.PREFILL) for i in range(2)]
    decode = [worker(i + 2) for i in range(2)]
    pairs = Counter()
    for _ in range(40):
        p, d = router.pick(Role.PREFILL, prefill), router.pick(Role.DECODE, decode)
        for w in (p, d):
            router.started(w)
            router.finished(w)
        pairs[p.http_url, d.http_url] += 1
    assert len(pairs) == 4  # every prefill met every decode (p_i is not tied to d_i)
    assert Counter(p for p, _ in pairs.elements()) == {w.http_url: 20 for w in prefill}


def test_assigned_counts_requests_since_the_report_was_asked_for():
    table = WorkerTable()
    w = worker(1, capacity=4)
    (state,) = table.sync(Role.DECODE, [w])
    for _ in range(3):
        table.started(w)
    assert state.assigned == 3 and state.score == 0.75  # no report yet: in flight
    mark = table.report_mark(w)  # the poll goes out; two more requests are sent meanwhile
    table.started(w)
    table.started(w)
    table.report(w, Stats(waiting=1, running=3, transferring=0), mark)  # counted the first 3 (+1)
    assert state.assigned == 2 and state.score == (4 + 2) / 4
    for _ in range(5):
        table.finished(w)
    assert state.in_flight == 0 and state.assigned == 2  # only a new report lowers it
    report(table, w)
    assert state.score == 0 and state.requests == 5


# ------------------------------------------------------------------ round robin


def test_round_robin_cycles_and_skips_down_workers():
    table = WorkerTable()
    router = RoundRobinRouter(table)
    workers = [worker(i, Role.PREFILL) for i in range(3)]
    table.sync(Role.PREFILL, workers)
    report(table, workers[0], waiting=100)  # load does not matter to round-robin
    picks = [workers.index(router.pick(Role.PREFILL, workers)) for _ in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]
    table.mark_down(workers[1], "refused")
    picks = [workers.index(router.pick(Role.PREFILL, workers)) for _ in range(4)]
    assert sorted(picks) == [0, 0, 2, 2]


def test_make_router():
    table = WorkerTable()
    assert make_router(Policy.ROUND_ROBIN, table).policy is Policy.ROUND_ROBIN
    assert make_router(Policy.LEAST_LOADED, table).policy is Policy.LEAST_LOADED


# ------------------------------------------------------------------ health


@pytest.mark.parametrize("router_cls", [LeastLoadedRouter, RoundRobinRouter])
def test_down_workers_are_skipped_until_marked_up(router_cls):
    table = WorkerTable()
    router = router_cls(table)
    a, b = worker(1), worker(2)
    table.sync(Role.DECODE, [a, b])
    report(table, b)  # b is idle, a would be preferred by nobody... until b goes down
    assert table.mark_down(b, "connection refused") is True
    assert table.mark_down(b, "still refused") is False  # already down
    assert {router.pick(Role.DECODE, [a, b]) for _ in range(5)} == {a}
    table.mark_down(a, "timed out")
    with pytest.raises(NoWorkerError, match="no decode worker available: all 2 are down"):
        router.pick(Role.DECODE, [a, b])
    assert table.mark_up(b) is True and table.mark_up(b) is False
    assert router.pick(Role.DECODE, [a, b]) == b
    with pytest.raises(NoWorkerError, match="no prefill worker available$"):
        router.pick(Role.PREFILL, [])


@pytest.mark.parametrize("router_cls", [LeastLoadedRouter, RoundRobinRouter,
                                        lambda table: CacheAwareRouter(table, PrefixIndex())])
def test_avoided_workers_are_chosen_only_when_no_other_is_up(router_cls):
    table = WorkerTable()
    router = router_cls(table)
    a, b, c = worker(1), worker(2), worker(3)
    table.sync(Role.DECODE, [a, b, c])
    report(table, a)
    report(table, b, running=6)
    assert {router.pick(Role.DECODE, [a, b, c], avoid=lambda w: w == a) for _ in range(6)} <= {b, c}  # a idle
    assert {router.pick(Role.DECODE, [a, b, c], avoid=lambda w: w != b) for _ in range(4)} == {b}
    table.mark_down(b, "refused")
    assert router.pick(Role.DECODE, [a, b, c], avoid=lambda w: w != b) in (a, c)  # avoided beats none
    assert [s.health for s in table.sync(Role.DECODE, [a, b, c])] == [Health.UP, Health.DOWN, Health.UP]


def test_mark_down_drops_stats_and_ignores_late_reports():
    table = WorkerTable()
    w = worker(1)
    (state,) = table.sync(Role.DECODE, [w])
    report(table, w, running=5)
    mark = table.report_mark(w)  # a poll is in flight when the worker is marked down
    table.mark_down(w, "HTTP 500")
    assert state.health is Health.DOWN and state.stats is None and state.down_reason == "HTTP 500"
    table.report(w, Stats(0, 5, 0), mark)
    assert state.stats is None
    table.mark_up(w)
    assert state.health is Health.UP and state.down_reason == "" and state.score == 0


def test_sync_forgets_removed_workers_and_adopts_new_ones():
    table = WorkerTable()
    router = LeastLoadedRouter(table)
    a, b = worker(1), worker(2)
    table.sync(Role.DECODE, [a, b])
    table.started(a)
    table.mark_down(b, "refused")
    assert router.pick(Role.DECODE, [a]) == a  # b left the registry
    assert table.get(b) is None
    table.finished(b)  # a request on a forgotten worker ends: ignored
    table.mark_down(b, "refused")  # so is a late failure
    assert table.get(b) is None
    # b comes back: a fresh, UP worker, chosen at once since a is busy.
    assert router.pick(Role.DECODE, [a, b]) == b
    # A changed registration keeps the state under the new info.
    a2 = WorkerInfo(Role.DECODE, a.http_url, a.signal_addr, "m", 1, capacity=16)
    (s_a, _) = table.sync(Role.DECODE, [a2, b])
    assert s_a.info.capacity == 16 and s_a.requests == 1
    # Other roles are untouched by a sync.
    p = worker(9, Role.PREFILL)
    table.sync(Role.PREFILL, [p])
    table.sync(Role.DECODE, [])
    assert table.get(p) is not None and table.get(a2) is None


def test_cluster_view_of_a_worker():
    table = WorkerTable()
    w = worker(1, capacity=4)
    (state,) = table.sync(Role.DECODE, [w])
    assert state.to_dict()["load"] == {"waiting": None, "running": None, "transferring": None,
                                       "assigned": 0, "score": 0.0, "queued_tokens": None, "assigned_blocks": 0}
    assert state.to_dict()["cache"] == {"blocks_total": None, "blocks_used": None, "blocks_cached": None,
                                        "hit_rate": None}
    table.started(w, blocks=3)
    table.report(w, Stats(1, 1, 1, blocks_total=100, blocks_used=20, blocks_cached=30, prefix_query_tokens=300,
                          prefix_hit_tokens=100, preemptions=7), table.report_mark(w))
    table.started(w, blocks=5)
    assert state.to_dict() == {
        "role": "decode", "http_url": w.http_url, "signal_addr": w.signal_addr, "model_id": "m",
        "capacity": 4, "health": "up",
        "load": {"waiting": 1, "running": 1, "transferring": 1, "assigned": 1, "score": 1.0,
                 "queued_tokens": None, "assigned_blocks": 5},
        "cache": {"blocks_total": 100, "blocks_used": 20, "blocks_cached": 30, "hit_rate": 0.3333},
        "preemptions": 7, "requests": 2, "prefill_paths": {"remote": 0, "local": 0},
    }
    report(table, w)  # an older worker: no block counts, no hit rate
    assert state.to_dict()["cache"]["hit_rate"] is None and state.to_dict()["load"]["assigned_blocks"] == 0


@pytest.mark.parametrize("d", [
    {"waiting": 1, "running": 1},
    {"waiting": -1, "running": 0, "transferring": 0},
    {"waiting": 1.5, "running": 0, "transferring": 0},
    {"waiting": True, "running": 0, "transferring": 0},
    [1, 2, 3],
])
def test_stats_are_validated(d):
    with pytest.raises(ValueError):
        Stats.from_dict(d)


def test_stats_extra_fields_are_ignored():
    d = {"role": "decode", "waiting": 1, "running": 2, "transferring": 3, "kv_used_bytes": 10}
    assert Stats.from_dict(d).total == 6


def test_stats_block_counts_are_optional():
    d = {"waiting": 0, "running": 1, "transferring": 0, "queued_tokens": 40, "blocks_total": 64,
         "blocks_used": 8, "blocks_cached": 20, "blocks_free": 36,
         "prefix_query_tokens": 0, "prefix_hit_tokens": 0}
    stats = Stats.from_dict(d)
    assert (stats.queued_tokens, stats.blocks_used, stats.blocks_cached) == (40, 8, 20)
    assert stats.hit_rate is None  # no lookups yet: no rate, not 0
    assert Stats.from_dict({**d, "prefix_query_tokens": 64, "prefix_hit_tokens": 16}).hit_rate == 0.25
    # Missing (an older worker) or not a count: unknown, and the request counts still stand.
    odd = Stats.from_dict({"waiting": 0, "running": 1, "transferring": 0, "blocks_used": -1, "queued_tokens": "9"})
    assert odd.total == 1 and odd.blocks_used is None and odd.queued_tokens is None
    with pytest.raises(ValueError):
        Stats(0, 0, 0, blocks_used=-1)


# ------------------------------------------------------------------ cache aware

BS = 16  # tokens per block


def prompt(chain: list[int], extra_tokens: int = 8) -> PromptKeys:
    """A request whose full blocks hash to ``chain``, plus a partial block of ``extra_tokens``."""
    return PromptKeys(len(chain) * BS + extra_tokens, BS, tuple(chain))


def cache_env(n: int = 2, role: Role = Role.PREFILL, capacity: int = 4):
    table, index = WorkerTable(), PrefixIndex()
    router = CacheAwareRouter(table, index, rng=random.Random(0))
    workers = [worker(i, role, capacity) for i in range(n)]
    table.sync(role, workers)
    for w in workers:
        report(table, w)  # idle
    return table, index, router, workers


def holds(index: PrefixIndex, w: WorkerInfo, chain: list[int]) -> None:
    index.apply(w, index.entry(w), KVUpdate("e", 1, snapshot=set(chain)))


def block_report(table: WorkerTable, w: WorkerInfo, waiting: int = 0, queued_tokens: int | None = None,
                 blocks_used: int | None = None) -> None:
    table.report(w, Stats(waiting, 0, 0, queued_tokens=queued_tokens, blocks_used=blocks_used),
                 table.report_mark(w))


LONG = list(range(100, 140))  # a 40-block prefix


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_the_worker_holding_the_prefix_wins(role):
    table, index, router, (a, b, c) = cache_env(3, role)
    holds(index, b, LONG[:30])
    holds(index, c, LONG[:10])
    for _ in range(3):
        assert router.pick(role, [a, b, c], prompt(LONG)) == b  # 30 of 40 blocks there
    # A busier holder still wins while the blocks it saves outweigh its backlog: 11 to compute + 15 queued
    # on b against 31 to compute on c ...
    block_report(table, b, waiting=1, **({"queued_tokens": 15 * BS} if role is Role.PREFILL else {"blocks_used": 15}))
    assert router.pick(role, [a, b, c], prompt(LONG)) == b
    # ... and not once they do not: 11 + 25 on b against 31 on c (and 41 on a).
    block_report(table, b, waiting=1, **({"queued_tokens": 25 * BS} if role is Role.PREFILL else {"blocks_used": 25}))
    assert router.pick(role, [a, b, c], prompt(LONG)) == c
    # A request the proxy could not tokenize goes least-loaded (b has a request waiting).
    assert router.pick(role, [a, b, c], None) in (a, c)


def test_the_overloaded_holder_is_avoided():
    table, index, router, (a, b) = cache_env(2, Role.DECODE, capacity=4)
    holds(index, b, LONG)
    block_report(table, b, waiting=4)  # a batch more than a (0): still a candidate
    assert router.pick(Role.DECODE, [a, b], prompt(LONG)) == b
    block_report(table, b, waiting=5)  # more than a batch more: not chosen for its cache
    assert router.pick(Role.DECODE, [a, b], prompt(LONG)) == a
    block_report(table, a, waiting=2)  # the gap is what counts: 5 - 2 <= 4
    assert router.pick(Role.DECODE, [a, b], prompt(LONG)) == b


def test_a_cold_request_goes_to_the_least_loaded():
    table, index, router, (a, b, c) = cache_env(3, Role.PREFILL)
    holds(index, a, [1, 2, 3])  # other prompts' blocks
    block_report(table, a, waiting=1, queued_tokens=300)
    block_report(table, b, waiting=2, queued_tokens=40)
    block_report(table, c, waiting=1, queued_tokens=100)
    assert router.pick(Role.PREFILL, [a, b, c], prompt(LONG)) == b  # the shortest queue, in blocks
    # Workers that report no queue (older ones): the proxy's own counts, then least_loaded's score.
    for w in (a, b, c):
        report(table, w, waiting=2)
    report(table, c, waiting=1)
    assert router.pick(Role.PREFILL, [a, b, c], prompt(LONG)) == c


def test_blocks_sent_since_the_report_count_as_backlog():
    table, index, router, (a, b) = cache_env(2, Role.PREFILL)
    holds(index, a, LONG[:20])
    first = prompt(LONG[:20] + [1, 2, 3, 4, 5])  # 20 cached on a, 5 (+1 partial) to compute
    assert router.pick(Role.PREFILL, [a, b], first) == a
    router.started(a, first)
    assert table.get(a).assigned_blocks == 6
    # Another request of the same prefix: a now has 6 blocks queued, still less than the 20 it saves.
    second = prompt(LONG[:20] + [6, 7, 8])
    assert router.pick(Role.PREFILL, [a, b], second) == a
    router.started(a, second)
    assert table.get(a).assigned_blocks == 6 + 4
    # The next report includes them in its own queue: nothing is counted twice.
    block_report(table, a, waiting=2, queued_tokens=10 * BS)
    assert table.get(a).assigned_blocks == 0
    third = prompt(LONG[:20] + [9])  # 22 blocks, 20 cached
    assert router.cost(table.get(a), third) == 2 + 10
    # Untokenized requests add load, not blocks.
    router.started(b)
    assert table.get(b).assigned_blocks == 0 and table.get(b).assigned == 1


def test_routed_requests_are_expected_in_the_cache_at_once():
    table, index, router, (a, b) = cache_env(2, Role.DECODE)
    turn1 = prompt(LONG[:8])
    w = router.pick(Role.DECODE, [a, b], turn1)  # cold: either
    router.started(w, turn1)
    other = b if w == a else a
    block_report(table, w, blocks_used=0)  # turn 1 ended (its events, not polled yet, would list its blocks)
    # The conversation's next turn, before the worker's events confirm anything: back to its history.
    turn2 = prompt(LONG[:8] + [7, 7, 7])
    assert index.match(w, turn2.hashes) == 8
    assert router.pick(Role.DECODE, [a, b], turn2) == w
    assert router.pick(Role.DECODE, [a, b], prompt([5, 5, 5, 5, 5, 5, 5, 5, 5, 5])) == other


def test_equal_costs_spread_like_least_loaded():
    table, index, router, workers = cache_env(3, Role.PREFILL)
    for w in workers:
        holds(index, w, LONG)  # everyone holds it: only the tie-break decides
    picks = []
    for _ in range(12):
        w = router.pick(Role.PREFILL, workers, prompt(LONG, extra_tokens=0))
        router.started(w, prompt(LONG, extra_tokens=0))  # nothing missing: no blocks assigned
        router.finished(w)
        report(table, w)
        picks.append(workers.index(w))
    rounds = [sorted(picks[i:i + 3]) for i in range(0, 12, 3)]
    assert rounds == [[0, 1, 2]] * 4  # everyone once per round, as least_loaded shares
    # A burst of cold requests with the same prompt: each worker computes the prompt once, then they share.
    table, index, router, workers = cache_env(2, Role.PREFILL)
    counts = Counter()
    for i in range(6):
        keys = prompt(LONG[:4], extra_tokens=i + 1)
        w = router.pick(Role.PREFILL, workers, keys)
        router.started(w, keys)
        counts[w.http_url] += 1
    assert sorted(counts.values()) == [3, 3]


def test_make_cache_aware_router():
    table = WorkerTable()
    assert make_router(Policy.CACHE_AWARE, table, PrefixIndex()).policy is Policy.CACHE_AWARE
    with pytest.raises(ValueError, match="prefix index"):
        make_router(Policy.CACHE_AWARE, table)


def test_a_finished_request_stops_counting_as_backlog_before_the_next_report():
    """Work the proxy sent since the last stats report counts as backlog until the report covers it, or
    until the request ended (done work): a client that sends its next request right after the previous
    answer finds the worker that holds its prefix as cheap as it is."""
    table = WorkerTable()
    w = worker(1, Role.PREFILL)
    table.sync(Role.PREFILL, [w])
    table.report(w, Stats(0, 0, 0), table.report_mark(w))
    a, b = table.started(w, blocks=11), table.started(w, blocks=3)
    state = table.get(w)
    assert a != b and state.assigned_blocks == 14
    table.finished(w, a)
    assert state.assigned_blocks == 3
    mark = table.report_mark(w)  # a report asked for now covers b
    c = table.started(w, blocks=5)
    table.report(w, Stats(0, 1, 0), mark)
    assert state.assigned_blocks == 5
    table.finished(w, b)
    table.finished(w, c)
    assert state.assigned_blocks == 0 and state.in_flight == 0


def test_a_request_the_report_saw_no_longer_weighs_once_it_ended():
    table = WorkerTable()
    w = worker(2, Role.DECODE)
    table.sync(Role.DECODE, [w])
    a = table.started(w, blocks=12)
    mark = table.report_mark(w)
    table.report(w, Stats(0, 1, 0), mark)  # the report sees a
    state = table.get(w)
    assert state.assigned_blocks == 0 and state.released_blocks == 0
    table.finished(w, a)
    assert state.released_blocks == 12  # until the next report, a's blocks are known to be free
    table.report(w, Stats(0, 0, 0), table.report_mark(w))
    assert state.released_blocks == 0 and not state.covered_blocks


def test_a_decode_request_that_ended_frees_its_whole_prompt_before_the_next_report():
    """A report taken while a request ran counts every block it held on the decode worker, the cached
    prefix it shared included; once it ended, none of them weighs there, so the conversation's next
    request (sent right after the answer, before the next report) goes back to the prefix it left."""
    table, index, router, (a, b) = cache_env(2, Role.DECODE)
    holds(index, b, LONG[:8])
    first = prompt(LONG[:8] + [1])  # 10 blocks: 8 cached on b, 2 to receive
    assert router.pick(Role.DECODE, [a, b], first) == b
    ticket = router.started(b, first)
    block_report(table, b, blocks_used=12)  # mid-flight: its 10 prompt blocks and 2 of generated tokens
    router.finished(b, ticket)
    assert table.get(b).released_blocks == 10
    second = prompt(LONG[:8] + [2])
    assert router.cost(table.get(b), second) == 2 + 2 < router.cost(table.get(a), second) == 10
    assert router.pick(Role.DECODE, [a, b], second) == b


def test_requests_a_lagging_report_missed_still_count_as_load():
    """A worker's report can be a snapshot from before requests sent just ahead of the proxy's question
    reached it: the proxy's own unfinished requests there are a floor on its load, so load still wins
    over cache."""
    table, index, router, (a, b) = cache_env(2, Role.DECODE, capacity=4)
    holds(index, b, LONG)
    keys = prompt(LONG)
    for _ in range(5):
        router.started(b, keys)
    block_report(table, b, waiting=0)  # asked for after the five were sent, answered with an older snapshot
    assert table.get(b).load == 0 and table.get(b).in_flight == 5
    assert router.pick(Role.DECODE, [a, b], keys) == a  # 5 unfinished on b: more than a batch over a
