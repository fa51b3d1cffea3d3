#!/usr/bin/env python3
"""The prefix index at scale, without a trace: memory, KV event batches applied per second, one walk.

``--workers`` workers each report a snapshot of ``--blocks`` blocks no other worker holds (the index's
worst case: every block distinct); then ``--batches`` updates of ``--batch`` events each go to the workers
in turn, each an LRU worker's: half "stored" (new blocks), half "removed" (its oldest). Prints:

- fill: seconds to apply the snapshots (in all, and the longest one); the index's own bytes
  (``PrefixIndex.nbytes()``) and per distinct block; the process's peak RSS;
- events: events applied per second (``PrefixIndex.apply`` only, the update built beforehand), and the
  p50 / p99 / max of one batch's time;
- walk: ``match_all`` of a chain of ``--chain`` blocks (the first half held by one worker) over all
  workers, p50 / p99 (thread CPU time).

    .venv/bin/python scripts/index_apply.py [--workers 64 --blocks 100000 --batch 1000 --batches 500]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from xpyd.discovery.types import Role, WorkerInfo  # noqa: E402
from xpyd.proxy.prefix_index import KVUpdate, PrefixIndex  # noqa: E402

_MIX = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1


def block(worker: int, k: int) -> int:
    """Worker ``worker``'s ``k``-th block's hash (distinct for every pair, spread over 64 bits)."""
    return (((worker << 40) | k) * _MIX) & _M64


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=100_000, help="blocks each worker holds")
    ap.add_argument("--batch", type=int, default=1000, help="events per update")
    ap.add_argument("--batches", type=int, default=500)
    ap.add_argument("--chain", type=int, default=64, help="blocks in the walked chain")
    ap.add_argument("--walks", type=int, default=2000)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    infos = [WorkerInfo(Role.DECODE, f"http://127.0.0.1:{9000 + i}", f"127.0.0.1:{19000 + i}", "sim", 1, 8)
             for i in range(args.workers)]
    index = PrefixIndex()
    snapshots = []  # the time of each snapshot's apply (the largest: the table grown on the way)
    for w, info in enumerate(infos):
        update = KVUpdate("e", 0, snapshot={block(w, k) for k in range(args.blocks)})
        t0 = time.perf_counter()
        index.apply(info, index.entry(info), update)
        snapshots.append(time.perf_counter() - t0)
    fill_s = sum(snapshots)
    nbytes = index.nbytes()
    distinct = index.distinct_blocks()
    oldest, nxt, seqs = [0] * args.workers, [args.blocks] * args.workers, [0] * args.workers
    half = args.batch // 2
    times = []
    for i in range(args.batches):
        w = i % args.workers
        evs = [("stored", block(w, nxt[w] + k)) for k in range(args.batch - half)]
        evs += [("removed", block(w, oldest[w] + k)) for k in range(half)]
        nxt[w] += args.batch - half
        oldest[w] += half
        seqs[w] += 1
        update = KVUpdate("e", seqs[w], events=tuple(evs))
        t0 = time.perf_counter()
        ok = index.apply(infos[w], index.entry(infos[w]), update)
        times.append(time.perf_counter() - t0)
        if not ok:
            raise RuntimeError("events refused")
    held = min(args.chain // 2, nxt[0] - oldest[0])  # worker 0's oldest blocks still held, then blocks nobody holds
    chain = [block(0, oldest[0] + k) for k in range(held)] + [block(10**6, k) for k in range(args.chain - held)]
    walks = []
    for _ in range(args.walks):
        c0 = time.thread_time()
        matched = index.match_all(chain, infos)
        walks.append(time.thread_time() - c0)
    expected_match = held
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "fill_s": fill_s, "snapshot_s_max": max(snapshots), "index_bytes": nbytes, "distinct_blocks": distinct,
        "bytes_per_distinct_block": nbytes / max(distinct, 1),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "events_per_s": args.batch * len(times) / sum(times),
        "batch_ms_p50": 1000 * statistics.median(times), "batch_ms_p99": 1000 * pct(times, 0.99),
        "batch_ms_max": 1000 * max(times),
        "walk_cpu_ms_p50": 1000 * statistics.median(walks), "walk_cpu_ms_p99": 1000 * pct(walks, 0.99),
        "walk_matched_worker0": matched[0], "walk_matched_expected": expected_match,
    }
    print(f"{args.workers} workers x {args.blocks} blocks: fill {fill_s:.1f} s (one snapshot at most "
          f"{max(snapshots):.3f} s), index {nbytes / 2**20:.1f} MiB for "
          f"{distinct} distinct blocks ({result['bytes_per_distinct_block']:.1f} B each), peak RSS "
          f"{result['max_rss_bytes'] / 2**20:.0f} MiB")
    print(f"events: {result['events_per_s']:,.0f}/s in batches of {args.batch} (batch p50 "
          f"{result['batch_ms_p50']:.3f} ms, p99 {result['batch_ms_p99']:.3f} ms, max {result['batch_ms_max']:.3f} ms)")
    print(f"walk of {args.chain} blocks over {args.workers} workers: CPU p50 {result['walk_cpu_ms_p50']:.3f} ms, "
          f"p99 {result['walk_cpu_ms_p99']:.3f} ms (worker 0 matched {matched[0]}, expected {expected_match})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if matched[0] == expected_match else 1


if __name__ == "__main__":
    sys.exit(main())
