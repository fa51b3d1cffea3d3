#!/usr/bin/env python3
"""Cache-aware routing on a Mooncake-format trace, without a cluster: the proxy's real CacheAwareRouter,
PrefixIndex and WorkerTable route every request of the trace to one of N prefill and M decode simulated
workers, and an oracle routes the same trace in a second replay. Prints (and with --json writes):

- prefix hit rate: the request's leading full blocks found in the chosen worker's true cache when it is
  routed, over its full blocks, summed over the trace (prefill: blocks not computed; decode: blocks not
  received); the router's against the oracle's, and their ratio;
- load: requests assigned to each worker, max / mean per role (and prefill tokens computed, max / mean);
- routing time per request: ``time.perf_counter`` around prefill pick + started and decode pick + started,
  p50 / p99 / max (and the same in the thread's CPU time, which a busy machine's preemptions do not add to);
- index memory: ``PrefixIndex.nbytes()`` (its block table's arrays and the expected blocks' dict), the
  distinct blocks and the (worker, block) pairs it holds, at the end of the replay.

Blocks: the trace's ``hash_ids`` name 512-token blocks and are used at that block size, as the proxy
would see them with 512-token KV blocks: block i's hash is the chained blake2b-64 of block i-1's hash and
hash id i (``xpyd.prefix_hash`` chains the same way over tokens, so equal hashes mean equal prefixes,
whether or not an id ever appears after two different prefixes). Only full blocks get a hash (a partial
last block is never matched, as in the proxy's ``PromptKeys``).

The simulated workers: each an LRU cache of ``--capacity`` blocks, pre-filled with ``--fill`` blocks of
its own (default: full; they match no request and are evicted first), that stores a request's full
blocks when the request is routed to it (prefill computes them, decode receives them) and reports
"stored" / "removed" events to the index as ``KVUpdate``s ``--report-lag`` seconds later (its snapshot
of the pre-fill at the start). Load: the proxy's own in-flight counts (no stats reports: a worker's load
is its unfinished requests, its backlog their blocks). A prefill worker computes one request at a time,
its missing tokens at ``--prefill-tokens-per-s``; decode starts when prefill ends and takes
``--decode-step-s`` per output token, all requests at once. Time is the trace's, divided by --time-scale.

The oracle sees every worker's true cache: among the workers the router's load rule allows (load at most
a batch above the least loaded), the one with the longest cached prefix, ties to the least loaded.

    .venv/bin/python scripts/route_trace.py [--trace ../shared/traces/conversation_trace.jsonl] \
        [--prefill 16 --decode 48] [--capacity 100000] [--max-requests N] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import random
import statistics
import sys
import time
from collections import OrderedDict, deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from xpyd.bench.trace import MOONCAKE_BLOCK_SIZE, TraceRecord, load_trace, trace_stats  # noqa: E402
from xpyd.discovery.types import Role, WorkerInfo  # noqa: E402
from xpyd.proxy.prefix_index import KVUpdate, PrefixIndex, PromptKeys  # noqa: E402
from xpyd.proxy.routing import CacheAwareRouter  # noqa: E402
from xpyd.proxy.workers import WorkerState, WorkerTable  # noqa: E402

_MIX = 0x9E3779B97F4A7C15  # odd: k -> k * _MIX mod 2**64 is one-to-one
_M64 = (1 << 64) - 1


def chain(record: TraceRecord, block_size: int) -> tuple[int, ...]:
    """The proxy's names for the record's full blocks (see the module's docstring)."""
    out, prev = [], 0
    for hid in record.hash_ids[:record.input_length // block_size]:
        prev = int.from_bytes(hashlib.blake2b(prev.to_bytes(8, "little") + hid.to_bytes(8, "little"),
                                              digest_size=8).digest(), "little")
        out.append(prev)
    return tuple(out)


class SimWorker:
    """An LRU block cache that reports its changes as KV events."""

    def __init__(self, info: WorkerInfo, number: int, capacity: int, fill: int) -> None:
        self.info = info
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()  # the trace's blocks, least recently used first
        self._tag = number << 40
        self.fill_next, self.fill_end = 0, min(fill, capacity)  # pre-fill blocks left (older than any other)
        self.events: deque[tuple[float, str, int]] = deque()  # (when, kind, hash), not reported yet
        self.seq = 0
        self.free_at = 0.0  # prefill: when its queue is done
        self.assigned = 0
        self.computed_tokens = 0

    def fill_hash(self, k: int) -> int:
        return ((self._tag | k) * _MIX) & _M64

    def snapshot(self) -> set[int]:
        return {self.fill_hash(k) for k in range(self.fill_next, self.fill_end)} | set(self.lru)

    def prefix(self, hashes: tuple[int, ...]) -> int:
        n = 0
        for h in hashes:
            if h not in self.lru:
                break
            n += 1
        return n

    def store(self, hashes: tuple[int, ...], now: float) -> None:
        lru, events = self.lru, self.events
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            events.append((now, "stored", h))
            if len(lru) + self.fill_end - self.fill_next > self.capacity:
                if self.fill_next < self.fill_end:
                    events.append((now, "removed", self.fill_hash(self.fill_next)))
                    self.fill_next += 1
                else:
                    events.append((now, "removed", lru.popitem(last=False)[0]))

    def report(self, index: PrefixIndex, upto: float) -> int:
        """Events up to ``upto`` into ``index`` as one update; how many."""
        batch = []
        events = self.events
        while events and events[0][0] <= upto:
            _, kind, h = events.popleft()
            batch.append((kind, h))
        if batch:
            self.seq += len(batch)
            if not index.apply(self.info, index.entry(self.info), KVUpdate("sim", self.seq, events=tuple(batch))):
                raise RuntimeError(f"{self.info.http_url}: events refused")
        return len(batch)


def workers(role: Role, n: int, batch: int, capacity: int, fill: int, first: int) -> list[SimWorker]:
    port = 8000 if role is Role.PREFILL else 9000
    return [SimWorker(WorkerInfo(role, f"http://127.0.0.1:{port + i}", f"127.0.0.1:{port + 1000 + i}", "sim", 1,
                                 batch), first + i, capacity, fill) for i in range(n)]


class Oracle:
    """Picks by true cache among the workers the router's load rule allows."""

    def __init__(self, table: WorkerTable, rng: random.Random) -> None:
        self._table = table
        self._rng = rng

    def pick(self, role: Role, sims: list[SimWorker], hashes: tuple[int, ...]) -> SimWorker:
        states = self._table.sync(role, [s.info for s in sims])
        loads = [max(s.load, s.in_flight) for s in states]
        least = min(loads)
        allowed = [(sim, st) for sim, st, n in zip(sims, states, loads) if n - least <= max(st.info.capacity, 1)]
        best = max((sim.prefix(hashes), -st.score) for sim, st in allowed)
        return self._rng.choice([sim for sim, st in allowed if (sim.prefix(hashes), -st.score) == best])


def replay(records: list[TraceRecord], args: argparse.Namespace, oracle: bool) -> dict:
    bs = MOONCAKE_BLOCK_SIZE
    prefills = workers(Role.PREFILL, args.prefill, args.batch, args.capacity, args.fill, 0)
    decodes = workers(Role.DECODE, args.decode, args.batch, args.capacity, args.fill, args.prefill)
    by_url = {(s.info.role, s.info.http_url): s for s in prefills + decodes}
    table, index = WorkerTable(), PrefixIndex(clock=lambda: now)
    router = CacheAwareRouter(table, index, random.Random(args.seed))
    picker = Oracle(table, random.Random(args.seed))
    now = 0.0
    fill_s = 0.0
    if not oracle:
        t0 = time.perf_counter()
        for sim in prefills + decodes:
            index.apply(sim.info, index.entry(sim.info), KVUpdate("sim", 0, snapshot=sim.snapshot()))
        fill_s = time.perf_counter() - t0
    finishes: list[tuple[float, int, WorkerInfo, int]] = []  # (when, order, worker, ticket)
    hits = {Role.PREFILL: 0, Role.DECODE: 0}
    blocks = route_s = feed_s = 0.0
    times: list[float] = []
    cpu: list[float] = []  # the same in this thread's CPU time (a busy machine's preemptions left out)
    t_first = records[0].timestamp_ms
    for i, r in enumerate(records):
        now = (r.timestamp_ms - t_first) / 1000.0 / args.time_scale
        while finishes and finishes[0][0] <= now:
            _, _, info, ticket = heapq.heappop(finishes)
            table.finished(info, ticket)
        if not oracle:
            t0 = time.perf_counter()
            for sim in prefills + decodes:
                if sim.events and sim.events[0][0] <= now - args.report_lag:
                    sim.report(index, now - args.report_lag)
            feed_s += time.perf_counter() - t0
        hashes = chain(r, bs)
        keys = PromptKeys(r.input_length, bs, hashes)
        if oracle:
            p = picker.pick(Role.PREFILL, prefills, hashes)
            tp = table.started(p.info)
            d = picker.pick(Role.DECODE, decodes, hashes)
            td = table.started(d.info)
        else:
            t0, c0 = time.perf_counter(), time.thread_time()
            pi = router.pick(Role.PREFILL, [s.info for s in prefills], keys)
            tp = router.started(pi, keys)
            di = router.pick(Role.DECODE, [s.info for s in decodes], keys)
            td = router.started(di, keys)
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            p, d = by_url[(Role.PREFILL, pi.http_url)], by_url[(Role.DECODE, di.http_url)]
        hit_p, hit_d = p.prefix(hashes), d.prefix(hashes)
        hits[Role.PREFILL] += hit_p
        hits[Role.DECODE] += hit_d
        blocks += len(hashes)
        p.store(hashes, now)
        d.store(hashes, now)
        p.assigned += 1
        d.assigned += 1
        compute = r.input_length - hit_p * bs
        p.computed_tokens += compute
        p.free_at = max(now, p.free_at) + compute / args.prefill_tokens_per_s
        heapq.heappush(finishes, (p.free_at, 2 * i, p.info, tp))
        heapq.heappush(finishes, (p.free_at + r.output_length * args.decode_step_s, 2 * i + 1, d.info, td))
    out: dict = {
        "prefill_hit_rate": hits[Role.PREFILL] / blocks if blocks else 0.0,
        "decode_hit_rate": hits[Role.DECODE] / blocks if blocks else 0.0,
        "prefill_assigned_max_over_mean": _max_over_mean([s.assigned for s in prefills]),
        "decode_assigned_max_over_mean": _max_over_mean([s.assigned for s in decodes]),
        "prefill_computed_max_over_mean": _max_over_mean([s.computed_tokens for s in prefills]),
    }
    if not oracle:
        times.sort()
        cpu.sort()
        t0 = time.perf_counter()
        nbytes = index.nbytes()
        out.update({
            "route_ms_p50": 1000 * times[len(times) // 2],
            "route_ms_p99": 1000 * times[min(len(times) - 1, int(len(times) * 0.99))],
            "route_ms_max": 1000 * times[-1],
            "route_ms_mean": 1000 * statistics.fmean(times),
            "route_cpu_ms_p50": 1000 * cpu[len(cpu) // 2],
            "route_cpu_ms_p99": 1000 * cpu[min(len(cpu) - 1, int(len(cpu) * 0.99))],
            "feed_s": feed_s, "fill_s": fill_s,
            "index_bytes": nbytes, "index_bytes_s": time.perf_counter() - t0,
            "index_distinct_blocks": index.distinct_blocks(),
            "index_pairs": sum(index.blocks(s.info) or 0 for s in prefills + decodes),
        })
        out["index_bytes_per_distinct_block"] = nbytes / max(out["index_distinct_blocks"], 1)
    return out


def _max_over_mean(values: list[int]) -> float:
    mean = statistics.fmean(values)
    return max(values) / mean if mean else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(ROOT.parent / "shared/traces/conversation_trace.jsonl"))
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument("--prefill", type=int, default=16)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--capacity", type=int, default=100_000, help="blocks each worker caches")
    ap.add_argument("--fill", type=int, default=None, help="blocks of its own each worker starts with "
                    "(default: --capacity)")
    ap.add_argument("--batch", type=int, default=8, help="each worker's capacity in requests")
    ap.add_argument("--report-lag", type=float, default=0.2, help="seconds from a cache change to the index")
    ap.add_argument("--time-scale", type=float, default=1.0, help="2.0 replays twice as fast")
    ap.add_argument("--prefill-tokens-per-s", type=float, default=10_000.0)
    ap.add_argument("--decode-step-s", type=float, default=0.03)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-oracle", action="store_true", help="the router's replay only")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    if args.fill is None:
        args.fill = args.capacity
    records = load_trace(args.trace, MOONCAKE_BLOCK_SIZE, args.max_requests)
    result: dict = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "requests": len(records),
                    "trace_prefix_sharing_ratio": trace_stats(records, MOONCAKE_BLOCK_SIZE).prefix_sharing_ratio}
    result["router"] = replay(records, args, oracle=False)
    if not args.no_oracle:
        result["oracle"] = replay(records, args, oracle=True)
        oracle_hit = result["oracle"]["prefill_hit_rate"]
        result["prefill_hit_ratio"] = result["router"]["prefill_hit_rate"] / oracle_hit if oracle_hit else None
    r = result["router"]
    print(f"{len(records)} requests, {args.prefill}P{args.decode}D, {args.capacity} blocks/worker "
          f"({args.fill} pre-filled), report lag {args.report_lag}s; the trace's own prefix sharing "
          f"(an unbounded cache's hit rate) {result['trace_prefix_sharing_ratio']:.4f}")
    for name in ("router", "oracle"):
        if name in result:
            x = result[name]
            print(f"{name:>6}: prefix hit rate prefill {x['prefill_hit_rate']:.4f} decode {x['decode_hit_rate']:.4f}; "
                  f"assigned max/mean prefill {x['prefill_assigned_max_over_mean']:.2f} decode "
                  f"{x['decode_assigned_max_over_mean']:.2f}; prefill tokens max/mean "
                  f"{x['prefill_computed_max_over_mean']:.2f}")
    if result.get("prefill_hit_ratio") is not None:
        print(f"router / oracle prefill hit rate: {result['prefill_hit_ratio']:.4f}")
    print(f"routing per request: p50 {r['route_ms_p50']:.3f} ms, p99 {r['route_ms_p99']:.3f} ms, "
          f"max {r['route_ms_max']:.3f} ms (CPU time p50 {r['route_cpu_ms_p50']:.3f} ms, p99 "
          f"{r['route_cpu_ms_p99']:.3f} ms); index {r['index_bytes'] / 2**20:.1f} MiB for "
          f"{r['index_distinct_blocks']} distinct blocks ({r['index_bytes_per_distinct_block']:.0f} B each), "
          f"{r['index_pairs']} (worker, block) pairs")
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
