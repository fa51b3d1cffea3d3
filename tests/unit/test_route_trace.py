"""scripts/route_trace.py: the trace's blocks as the proxy names them, the simulated workers' LRU caches and
their KV events, and a small replay whose hit rates are known exactly."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

from xpyd.bench.trace import TraceRecord, load_trace
from xpyd.discovery.types import Role, WorkerInfo
from xpyd.proxy.prefix_index import KVUpdate, PrefixIndex

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("route_trace", ROOT / "scripts" / "route_trace.py")
rt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rt)


def record(ids: list[int], input_length: int, ts: float = 0.0) -> TraceRecord:
    return TraceRecord(1, ts, input_length, 1, tuple(ids))


def test_blocks_are_chained_and_only_full_ones_named():
    a = rt.chain(record([1, 2, 3], 1500), 512)  # 2 full blocks and a partial one
    b = rt.chain(record([1, 2, 7], 1536), 512)
    c = rt.chain(record([9, 2], 1024), 512)  # id 2 after another prefix
    assert len(a) == 2 and len(b) == 3 and a == b[:2]
    assert c[1] != a[1] and len(set(a + b + c)) == 5
    assert all(0 <= h < 2**64 for h in a + b + c)


def test_a_sim_worker_evicts_its_fill_first_then_lru_and_reports_it():
    info = WorkerInfo(Role.PREFILL, "http://127.0.0.1:8000", "127.0.0.1:9000", "sim", 1, 8)
    sim = rt.SimWorker(info, 0, capacity=3, fill=2)
    fill = [sim.fill_hash(0), sim.fill_hash(1)]
    index = PrefixIndex()
    assert sim.snapshot() == set(fill)
    index.apply(info, index.entry(info), KVUpdate("sim", 0, snapshot=sim.snapshot()))
    sim.store((10, 11), now=1.0)
    sim.store((10, 12), now=2.0)  # 10 used again: 11 is now the least recently used
    assert [(k, h) for _, k, h in sim.events] == [("stored", 10), ("stored", 11), ("removed", fill[0]),
                                                  ("stored", 12), ("removed", fill[1])]
    sim.store((13,), now=3.0)
    assert list(sim.lru) == [10, 12, 13] and sim.events[-1][1:] == ("removed", 11)
    assert sim.prefix((10, 12, 11)) == 2 and sim.prefix((11,)) == 0
    assert sim.report(index, upto=2.0) == 5  # what happened up to then, in one update
    assert index.match(info, (10, 11)) == 2 and index.blocks(info) == 3
    assert sim.report(index, upto=2.5) == 0
    assert sim.report(index, upto=3.0) == 2
    assert index.match(info, (10, 12, 13)) == 3 and index.match(info, (11,)) == 0 and index.blocks(info) == 3


def test_a_conversation_replays_to_known_hit_rates(tmp_path):
    lines = [{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
             {"timestamp": 1000, "input_length": 1536, "output_length": 1, "hash_ids": [1, 2, 3]},
             {"timestamp": 2000, "input_length": 2048, "output_length": 1, "hash_ids": [1, 2, 3, 4]}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = argparse.Namespace(prefill=2, decode=3, batch=8, capacity=100, fill=100, report_lag=0.2, time_scale=1.0,
                              prefill_tokens_per_s=10_000.0, decode_step_s=0.03, seed=0)
    records = load_trace(path)
    for oracle in (False, True):
        out = rt.replay(records, args, oracle=oracle)
        # Each turn goes where the history is: 0 + 2 + 3 of 2 + 3 + 4 blocks.
        assert out["prefill_hit_rate"] == out["decode_hit_rate"] == 5 / 9, (oracle, out)
        assert out["prefill_assigned_max_over_mean"] == 2.0 and out["decode_assigned_max_over_mean"] == 3.0
    out = rt.replay(records, args, oracle=False)
    # 2 + 3 workers with 100 fill blocks each; the index has heard of the first two turns (the last one's events
    # are 0.2 s behind): 3 blocks stored on one prefill and one decode worker, 3 fill blocks evicted from each.
    assert out["index_pairs"] == 5 * 100 and out["index_distinct_blocks"] == 5 * 100 - 3 - 3 + 3
    assert out["index_bytes"] > 0 and out["route_ms_p99"] >= out["route_ms_p50"] > 0
