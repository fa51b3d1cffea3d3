"""The sweep picks the cheapest split that meets the SLO, on workloads whose answer is known."""

from __future__ import annotations

import pytest

from xpyd.planner.fleet_model import FleetConfig, KVHandoff
from xpyd.planner.search import SearchConfig, search
from xpyd.planner.slo import PlanSLO

from tests.unit.planner_fixtures import linear_profile, workload

BASE = FleetConfig(1, 1, handoff=KVHandoff(latency_s=0.0))


def test_a_prefill_heavy_load_gets_more_prefill_workers():
    # 1250-token prompts at 0.25 s each, one every 0.1 s: 2.5 prefill workers' worth; 2-token answers
    p = linear_profile(prefill_per_token=2e-4, prefill_per_cached=0.0)
    wl = workload(*[(0.1 * i, 1250, 2) for i in range(200)])
    result = search(p, wl, PlanSLO.parse("ttft=1s,attainment=0.95"), SearchConfig(6, (8,), BASE))
    best = result.best
    assert best is not None
    assert (best.config.prefill_workers, best.config.decode_workers) == (3, 1)
    assert best.result.attainment >= 0.95
    # nothing with fewer workers met it, and the sweep stopped at the answer's total
    assert all(not a.meets for a in result.attempts if a.config.workers < best.config.workers)
    assert max(a.config.workers for a in result.attempts) == best.config.workers


def test_a_decode_heavy_load_gets_more_decode_workers():
    # 10-token prompts, one a second, 200-token answers; a decode step costs 10 ms + 10 ms a request: ~6 s an
    # answer in batches of 2, so about 6 running at once
    p = linear_profile(prefill_per_token=1e-4, decode_base=0.01, decode_per_request=0.01, decode_per_context=0.0)
    wl = workload(*[(1.0 * i, 10, 200) for i in range(60)])
    result = search(p, wl, PlanSLO.parse("ttft=1s,tpot=40ms,attainment=0.9"), SearchConfig(8, (2, 4), BASE))
    best = result.best
    assert best is not None
    assert (best.config.prefill_workers, best.config.decode_workers) == (1, 3)


def test_ties_in_workers_go_to_the_higher_goodput():
    p = linear_profile(prefill_per_token=2e-4, prefill_per_cached=0.0)
    wl = workload(*[(0.1 * i, 1000, 2) for i in range(100)])
    result = search(p, wl, PlanSLO.parse("ttft=5s,attainment=0.5"), SearchConfig(4, (8,), BASE, exhaustive=True))
    same = [a for a in result.attempts if a.meets and a.config.workers == result.best.config.workers]
    assert result.best.result.goodput == max(a.result.goodput for a in same)
    assert {a.config.workers for a in result.attempts} == {2, 3, 4}  # exhaustive: every total


def test_prefill_counts_whose_ttft_misses_are_skipped():
    p = linear_profile(prefill_per_token=1e-3, prefill_per_cached=0.0)
    wl = workload(*[(0.1 * i, 1000, 2) for i in range(50)])  # 1 s of prefill every 0.1 s
    result = search(p, wl, PlanSLO.parse("ttft=1.5s"), SearchConfig(4, (4, 8), BASE))
    skipped = [a for a in result.attempts if a.result is None]
    assert skipped and all("TTFT" in a.note for a in skipped)
    modelled = {a.config.prefill_workers for a in result.attempts if a.result is not None}
    assert all(a.config.prefill_workers in modelled for a in skipped)
    assert result.best is None and result.closest is not None


def test_search_config_is_validated():
    with pytest.raises(ValueError, match="max workers"):
        SearchConfig(1)
    with pytest.raises(ValueError, match="batch sizes"):
        SearchConfig(4, (8, 0))
    with pytest.raises(ValueError, match="repeat"):
        SearchConfig(4, (8, 8))
