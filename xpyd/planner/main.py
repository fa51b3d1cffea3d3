"""``xpyd plan``: the CLI of the offline planner (``add_arguments`` / ``run``).

    xpyd plan --profile FILE|NAME|builtin --slo ttft=2s,itl=50ms[,attainment=0.95] --trace FILE.jsonl
              [--max-requests N] [--time-scale X] [--max-workers N] [--batch-sizes 8,16,32] [--json OUT]

Prints each configuration as it is modelled, then the answer: the split and decode batch that meet the SLO at
the least workers, with the predicted goodput (requests/s that meet the SLO) and attainment. Exit status 0 with
an answer, 1 when no configuration up to --max-workers meets the SLO, 2 for bad arguments or files.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from xpyd.bench.trace import MOONCAKE_BLOCK_SIZE, TraceError, load_trace, trace_stats
from xpyd.model.sim.profile import SimProfile, default_profile, shipped_profile, shipped_profiles
from xpyd.planner.fleet_model import FleetConfig, KVHandoff
from xpyd.planner.search import Attempt, SearchConfig, SearchResult, search
from xpyd.planner.slo import PlanSLO
from xpyd.planner.workload import from_trace

__all__ = ["PlanConfig", "add_arguments", "config_from_args", "run"]

_COLUMNS = ("config", "TTFT p50", "TTFT p90", "ITL p50", "ITL p90", "attain", "goodput", "SLO")
_WIDTHS = (13, 10, 10, 9, 9, 7, 8, 4)


@dataclass(frozen=True, slots=True)
class PlanConfig:
    profile: str  # a file, a shipped profile's name, or "builtin"
    slo: PlanSLO
    trace: Path
    search: SearchConfig
    time_scale: float = 1.0
    max_requests: int | None = None
    block_size: int = MOONCAKE_BLOCK_SIZE
    json_path: Path | None = None

    def __post_init__(self) -> None:
        if not self.time_scale > 0 or self.time_scale == float("inf"):
            raise ValueError(f"--time-scale must be a finite number > 0, got {self.time_scale}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"--max-requests must be >= 1, got {self.max_requests}")
        if self.block_size < 1:
            raise ValueError(f"--trace-block-size must be >= 1, got {self.block_size}")

    def load_profile(self) -> SimProfile:
        if self.profile == "builtin":
            return default_profile()
        if self.profile in shipped_profiles():
            return shipped_profile(self.profile)
        return SimProfile.load(self.profile)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="builtin", metavar="FILE|NAME",
                   help="the timing profile of one worker: a JSON file (xpyd bench calibrate), the name of a shipped "
                        f"one ({', '.join(shipped_profiles())}) or builtin (default: %(default)s)")
    p.add_argument("--slo", required=True, metavar="ttft=2s,itl=50ms[,attainment=0.95]",
                   help="targets per request (ttft; itl: every gap between tokens; tpot: the mean gap; e2e) and "
                        "the share of requests that must meet them all (default 0.95)")
    p.add_argument("--trace", required=True, metavar="FILE.jsonl", help="a Mooncake-format trace")
    p.add_argument("--max-requests", type=int, default=None, metavar="N", help="the first N requests of the trace")
    p.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                   help="arrivals X times as fast as the trace's timestamps, as xpyd bench --time-scale "
                        "(default %(default)s)")
    p.add_argument("--trace-block-size", type=int, default=MOONCAKE_BLOCK_SIZE, metavar="B",
                   help="tokens per hash id in the trace (default %(default)s)")
    p.add_argument("--max-workers", type=int, default=8, metavar="N",
                   help="prefill + decode workers at most (default %(default)s)")
    p.add_argument("--batch-sizes", default="8,16,32", metavar="B,B,...",
                   help="decode batch sizes to try (default %(default)s)")
    p.add_argument("--all", action="store_true",
                   help="model every configuration up to --max-workers (default: stop after the fewest workers that "
                        "meet the SLO, and skip the prefill counts whose TTFT alone misses it)")
    d = FleetConfig(1, 1)
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk, metavar="N",
                   help="prompt tokens per prefill step, as the workers' --prefill-chunk (default %(default)s)")
    p.add_argument("--prefill-batch", type=int, default=d.prefill_batch, metavar="N",
                   help="prompts a prefill worker computes at once, its --batch-size (default %(default)s)")
    p.add_argument("--kv-blocks", type=int, default=d.kv_blocks, metavar="N",
                   help="prefix-cache blocks (of --trace-block-size tokens) each prefill worker holds "
                        "(default %(default)s)")
    p.add_argument("--kv-bytes-per-token", type=int, default=d.handoff.bytes_per_token, metavar="BYTES",
                   help="KV bytes per prompt token moved to decode (default %(default)s: only the latency; "
                        "Llama-3-8B bf16: 131072)")
    p.add_argument("--kv-bandwidth", type=float, default=d.handoff.bandwidth_bytes_s / 1e9, metavar="GB/S",
                   help="KV hand-off bandwidth in GB/s (default %(default)g)")
    p.add_argument("--kv-latency", type=float, default=d.handoff.latency_s * 1000.0, metavar="MS",
                   help="KV hand-off fixed latency in ms (default %(default)g)")
    p.add_argument("--no-kv-stream", dest="kv_stream", action="store_false",
                   help="the whole prompt's KV moves after its last chunk (default: streamed, only the last chunk's "
                        "is left to move, as the workers' default)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the table and the answer as JSON")


def config_from_args(args: argparse.Namespace) -> PlanConfig:
    try:
        batches = tuple(int(b) for b in args.batch_sizes.split(",") if b.strip())
    except ValueError:
        raise ValueError(f"--batch-sizes must be integers separated by commas, got {args.batch_sizes!r}") from None
    handoff = KVHandoff(args.kv_bytes_per_token, args.kv_bandwidth * 1e9, args.kv_latency / 1000.0, args.kv_stream)
    base = FleetConfig(1, 1, prefill_chunk=args.prefill_chunk, prefill_batch=args.prefill_batch,
                       kv_blocks=args.kv_blocks, handoff=handoff)
    return PlanConfig(args.profile, PlanSLO.parse(args.slo), Path(args.trace),
                      SearchConfig(args.max_workers, batches, base, args.all), args.time_scale,
                      args.max_requests, args.trace_block_size, Path(args.json) if args.json else None)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        profile = config.load_profile()
        records = load_trace(config.trace, config.block_size, config.max_requests)
    except (ValueError, TraceError) as e:
        print(f"xpyd plan: error: {e}", file=sys.stderr)
        return 2
    workload = from_trace(records, config.time_scale, config.block_size)
    stats = trace_stats(records, config.block_size)
    w = workload.summary()
    print(f"profile: {profile.model} on {profile.machine}")
    print(f"workload: {w['requests']} requests over {w['span_s']:.1f} s (time scale {config.time_scale:g}: "
          f"{w['rate_per_s']:.3g} req/s), mean input {w['mean_input_tokens']:.0f} / output "
          f"{w['mean_output_tokens']:.0f} tokens, prefix sharing {stats.prefix_sharing_ratio:.1%}")
    print(f"SLO: {config.slo.describe()}; up to {config.search.max_workers} workers, decode batch "
          f"{'/'.join(map(str, config.search.batch_sizes))}\n")
    print(_line(_COLUMNS))
    result = search(profile, workload, config.slo, config.search, progress=lambda a: print(_row(a), flush=True))
    print()
    print(_answer(result, config.slo))
    if config.json_path is not None:
        report = {"profile": {"model": profile.model, "machine": profile.machine, "source": config.profile},
                  "slo": config.slo.as_dict(), "workload": {**w, "time_scale": config.time_scale,
                                                            "prefix_sharing_ratio": stats.prefix_sharing_ratio},
                  "attempts": [a.row() for a in result.attempts],
                  "best": result.best.row() if result.best else None, "seconds": result.seconds}
        config.json_path.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if result.best is not None else 1


def _line(cells: tuple[str, ...]) -> str:
    return "  ".join(c.rjust(n) if i else c.ljust(n) for i, (c, n) in enumerate(zip(cells, _WIDTHS)))


def _row(a: Attempt) -> str:
    if a.result is None:
        return f"{a.config.label:<13}  skipped: {a.note}"
    s = a.result.summary()
    ms = lambda v: f"{v:.0f}ms" if v < 10_000 else f"{v / 1000:.0f}s"  # noqa: E731
    return _line((a.config.label, ms(s["ttft_p50_ms"]), ms(s["ttft_p90_ms"]), ms(s["itl_p50_ms"]),
                  ms(s["itl_p90_ms"]), f"{s['attainment']:.1%}", f"{s['goodput_rps']:.3g}/s",
                  "yes" if a.meets else "no"))


def _answer(result: SearchResult, slo: PlanSLO) -> str:
    tried = sum(a.result is not None for a in result.attempts)
    head = f"{tried} configurations modelled in {result.seconds:.1f} s"
    if result.best is None:
        close = result.closest
        tail = "" if close is None else (f"; the closest: {close.config.label} at {close.result.attainment:.1%}")
        return f"{head}. None meets {slo.describe()}{tail}."
    best, s = result.best, result.best.result.summary()
    return (f"{head}.\nAnswer: {best.config.prefill_workers} prefill + {best.config.decode_workers} decode workers "
            f"({best.config.prefill_workers}:{best.config.decode_workers}), decode batch {best.config.decode_batch}: "
            f"predicted goodput {s['goodput_rps']:.3g} requests/s meeting the SLO, attainment {s['attainment']:.1%} "
            f"(TTFT p90 {s['ttft_p90_ms']:.0f} ms, ITL p90 {s['itl_p90_ms']:.1f} ms)")
