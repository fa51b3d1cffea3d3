"""The fleet model on workloads small enough to compute by hand."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from xpyd.model.sim.profile import default_profile
from xpyd.planner.decode_model import StepTimes
from xpyd.planner.fleet_model import FleetConfig, KVHandoff, simulate
from xpyd.planner.prefix_lru import PrefixLRU
from xpyd.planner.slo import PlanSLO
from xpyd.planner.workload import PlanRequest, Workload

from tests.unit.planner_fixtures import linear_profile, workload

SLO = PlanSLO.parse("ttft=10s")
P = linear_profile()


def step(batch: int, context: int) -> float:
    return P.decode_seconds(batch, context)


def run(wl: Workload, **kw):
    return simulate(P, wl, FleetConfig(kw.pop("x", 1), kw.pop("y", 1), **kw), SLO)


def test_one_request_ttft_is_the_profiles_prefill_time():
    r = run(workload((0.0, 100, 1)))
    assert r.ttft_s[0] == pytest.approx(P.prefill_seconds(100, 0)) == pytest.approx(0.1)
    assert r.e2e_s[0] == pytest.approx(0.1)
    assert math.isnan(r.mean_itl_s[0]) and math.isnan(r.max_itl_s[0])


def test_one_request_decodes_in_steps_after_the_hand_off():
    handoff = KVHandoff(bytes_per_token=1000, bandwidth_bytes_s=1e6, latency_s=0.002, stream=False)
    r = run(workload((0.0, 100, 3)), handoff=handoff)
    first = 0.1
    start = first + 0.002 + 100 * 1000 / 1e6  # the whole prompt's KV moves after its last chunk
    s1, s2 = step(1, 101), step(1, 102)  # context: the prompt and the tokens so far
    assert r.ttft_s[0] == pytest.approx(first)
    assert r.e2e_s[0] == pytest.approx(start + s1 + s2)
    assert r.max_itl_s[0] == pytest.approx(start + s1 - first)  # the first gap carries the hand-off
    assert r.mean_itl_s[0] == pytest.approx((start + s1 + s2 - first) / 2)


def test_streamed_kv_leaves_only_the_last_chunk_to_move():
    handoff = KVHandoff(bytes_per_token=1000, bandwidth_bytes_s=1e6, latency_s=0.0)
    assert handoff.seconds(1200, 512) == pytest.approx(512 * 1e-3)
    assert handoff.seconds(100, 512) == pytest.approx(100 * 1e-3)
    assert handoff.seconds(1200, 0) == pytest.approx(1200 * 1e-3)  # unchunked: the whole prompt


def test_requests_queue_on_one_prefill_worker():
    # A starts at once; B and C arrive while A's step runs
    wl = workload((0.0, 100, 1), (0.01, 100, 1), (0.01, 200, 1))
    unchunked = run(wl, prefill_chunk=0)  # whole prompts, oldest first
    assert unchunked.ttft_s.tolist() == pytest.approx([0.1, 0.2 - 0.01, 0.4 - 0.01])
    chunked = run(wl, prefill_chunk=512)  # B and C share the second step
    assert chunked.ttft_s.tolist() == pytest.approx([0.1, 0.4 - 0.01, 0.4 - 0.01])
    three = run(wl, x=3, prefill_chunk=0)  # a worker each
    assert three.ttft_s.tolist() == pytest.approx([0.1, 0.1, 0.2])


def test_chunked_prefill_lets_a_short_prompt_overtake():
    r = run(workload((0.0, 1000, 1), (0.1, 100, 1)), prefill_chunk=512)
    s1 = P.prefill_seconds(512, 0)  # the long prompt alone
    s2 = P.prefill_seconds(100 + 412, 0 + 512)  # the short one first, then 412 more of the long one
    s3 = P.prefill_seconds(76, 924)
    assert r.ttft_s.tolist() == pytest.approx([s1 + s2 + s3, s1 + s2 - 0.1])
    unchunked = run(workload((0.0, 1000, 1), (0.1, 100, 1)), prefill_chunk=0)
    assert unchunked.ttft_s[1] == pytest.approx(1.0 + 0.1 - 0.1)


def test_decode_batch_limit_delays_admission():
    wl = workload((0.0, 100, 11), (0.0, 100, 2))
    handoff = KVHandoff(latency_s=0.0)
    one = run(wl, x=2, decode_batch=1, handoff=handoff)  # B waits until A's ten steps are done
    a_end = 0.1 + sum(step(1, 101 + i) for i in range(10))
    assert one.e2e_s[0] == pytest.approx(a_end)
    assert one.max_itl_s[1] == pytest.approx(a_end + step(1, 101) - 0.1)
    two = run(wl, x=2, decode_batch=2, handoff=handoff)  # both in one batch from the start
    assert two.max_itl_s[1] == pytest.approx(step(2, 202))
    assert two.e2e_s[1] < one.e2e_s[1]


def test_an_arrival_joins_a_running_batch_at_the_next_step():
    # A decodes alone from 0.1; B's KV is ready mid-way through A's steps and joins at the next boundary
    wl = workload((0.0, 100, 50), (0.15, 100, 3))
    r = run(wl, x=2, decode_batch=4, handoff=KVHandoff(latency_s=0.0))
    ready_b = 0.15 + 0.1
    ends = 0.1 + np.cumsum([step(1, 101 + i) for i in range(49)])
    joined = ends[np.searchsorted(ends, ready_b)]  # the boundary B joins at
    k = int(np.searchsorted(ends, ready_b)) + 1  # A's steps alone
    b_first = joined + step(2, 101 + k + 101)
    assert r.max_itl_s[1] >= b_first - ready_b
    assert r.max_itl_s[1] == pytest.approx(max(b_first - ready_b, step(2, 101 + k + 1 + 102)))
    assert r.e2e_s[1] == pytest.approx(b_first + step(2, 101 + k + 1 + 102) - 0.15)


def test_prefix_reuse_lowers_the_prefill_time():
    ids = (1, 2, 3, 4)
    wl = workload((0.0, 64, 1, ids), (1.0, 64, 1, ids))
    cold = run(wl, kv_blocks=0)
    assert cold.ttft_s.tolist() == pytest.approx([0.064, 0.064])
    warm = run(wl, kv_blocks=16)
    assert warm.ttft_s[1] == pytest.approx(P.prefill_seconds(1, 63))  # all but the last token reused
    assert warm.cached_tokens == 63
    partial = run(workload((0.0, 64, 1, ids), (1.0, 64, 1, (1, 2, 9, 10))), kv_blocks=16)
    assert partial.ttft_s[1] == pytest.approx(P.prefill_seconds(32, 32))


def test_routing_follows_the_prefix_unless_the_worker_is_much_busier():
    ids = tuple(range(8))
    # C shares A's prefix and goes where A ran, although B (short) is queued there
    wl = workload((0.0, 128, 1, ids), (0.5, 32, 1, (100, 101)), (0.501, 128, 1, ids))
    r = run(wl, x=2, prefill_chunk=0)
    assert r.prefill_worker.tolist() == [0, 0, 0] and r.cached_tokens == 127
    # a worker still computing the prefix is no cheaper than one without it: a burst during A spreads
    during = [(0.0, 128, 1, ids)] + [(0.001 * i, 128, 1, ids) for i in range(1, 11)]
    r = run(workload(*during), x=2, prefill_chunk=0, prefill_batch=64)
    assert r.prefill_worker.tolist().count(1) >= 4
    # once computed, the prefix wins while the load allows: a burst after A all goes to A's worker
    after = [(0.0, 128, 1, ids)] + [(0.5 + 0.001 * i, 128, 1, ids) for i in range(10)]
    r = run(workload(*after), x=2, prefill_chunk=0, prefill_batch=64)
    assert r.prefill_worker.tolist() == [0] * 11
    # load wins over cache: no worker takes more than a batch more requests than the least loaded one
    r = run(workload(*after), x=2, prefill_chunk=0, prefill_batch=2)
    assert r.prefill_worker.tolist().count(1) >= 2


def test_prefix_lru_evicts_the_least_recently_used():
    lru = PrefixLRU(3)
    lru.touch((1, 2))
    lru.touch((3,))
    lru.touch((1,))  # 1 is the newest now
    lru.touch((4,))  # evicts 2
    assert lru.cached_blocks((1, 2)) == 1
    assert lru.cached_blocks((1,)) == 1 and lru.cached_blocks((3,)) == 1 and len(lru) == 3


def test_step_times_match_the_profile_everywhere():
    table = default_profile().decode
    steps = StepTimes(table)
    rng = random.Random(3)
    for _ in range(200):
        b = rng.randint(1, 64)
        contexts = np.array([rng.uniform(0, 50_000) for _ in range(5)])
        assert steps.at(b, contexts).tolist() == pytest.approx([table.at(b, c) for c in contexts], rel=1e-9)


def test_every_request_finishes_in_order_of_its_own_timeline():
    rng = random.Random(7)
    t, reqs = 0.0, []
    for i in range(300):
        t += rng.expovariate(20.0)
        n = rng.randint(1, 900)
        reqs.append(PlanRequest(t, n, rng.randint(1, 60), tuple(rng.randrange(40) for _ in range(-(-n // 16)))))
    wl = Workload(tuple(reqs), 16)
    r = simulate(P, wl, FleetConfig(2, 3, decode_batch=4, prefill_chunk=256, prefill_batch=3, kv_blocks=20), SLO)
    assert np.isfinite(r.ttft_s).all() and (r.ttft_s > 0).all()
    assert (r.e2e_s >= r.ttft_s - 1e-12).all()
    multi = np.array([q.output_tokens > 1 for q in reqs])
    assert np.isfinite(r.max_itl_s[multi]).all() and np.isnan(r.max_itl_s[~multi]).all()
    assert (r.max_itl_s[multi] >= r.mean_itl_s[multi] - 1e-12).all()
    assert 0 < r.attainment <= 1 and r.goodput > 0


def test_more_load_than_one_prefill_worker_takes_queues():
    wl = workload(*[(0.1 * i, 200, 1) for i in range(100)])  # 0.2 s of prefill every 0.1 s
    one, four = run(wl), run(wl, x=4)
    assert np.percentile(one.ttft_s, 90) > 10 * np.percentile(four.ttft_s, 90)
