"""The results as JSON (the contract scripts rely on) and as a printed table.

JSON top level: ``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2e_ms`` (each ``mean``, ``p50``, ``p90``,
``p99``, ``max``, ``count``; null when there is no sample), ``output_tokens_per_s``, ``requests_per_s``,
``goodput_requests_per_s``, ``goodput_output_tokens_per_s``, ``completed``, ``failed``, plus
``duration_s``, ``errors`` (failed requests by kind), ``slo_ms`` / ``good`` / ``slo_missed`` /
``slo_attainment``, token totals, ``prefix_cache`` (``hit_rate``, null when the server reports no
cached tokens; ``cached_tokens``, ``prompt_tokens``, ``requests``: the completed requests that
reported them), ``config``, ``definitions``, ``classes`` (per request class, same keys;
prefill-stall: ``short`` and ``long``), ``multi_turn`` (multi-turn: ``turns``, one entry per turn
index with ``completed``, ``failed``, ``ttft_ms``, ``prefix_cache``; ``first_turn`` and
``later_turns`` prefix caches; ``turns_not_sent``), ``trace`` (trace replay: the trace's own
``requests``, ``mean_input_tokens``, ``mean_output_tokens``, ``total_input_tokens``,
``shared_prefix_tokens``, ``prefix_sharing_ratio`` (the upper bound of ``prefix_cache.hit_rate``),
``block_size``, ``span_s``, ``time_scale``, ``replay_span_s``), ``workers`` (only when the server named
the workers of its answers: an xpyd proxy with ``--expose-worker-names``; ``prefill``, ``decode`` and/or
``colocated``, each {worker name: ``requests``, ``completed``, ``failed``, ``good``, ``slo_attainment``,
``requests_per_s``, ``output_tokens_per_s``, ``goodput_requests_per_s``, ``goodput_output_tokens_per_s``,
``ttft_ms``, ``tpot_ms``, ``errors``}, and ``unattributed``: requests no worker was named for),
``proxy_overhead`` (only when the server sent the workers' own timing: an xpyd proxy with
``--expose-worker-timing``; ``requests``, ``missing``, ``misaligned``, ``worker_ttft_ms``, ``proxy_ttft_ms``,
``worker_itl_ms``, ``client_itl_ms``, ``itl_p50_ratio``, ``itl_p99_ratio``, see ``xpyd.bench.overhead``),
``phases`` (only when the server split the TTFT: an xpyd proxy with ``--expose-worker-timing``;
``requests``, ``missing``, ``ttft_ms`` per phase (``proxy.ingress``, ``prefill.parse`` or ``colocated.parse``
... ``proxy.egress``), ``sum_ms``, ``client_ttft_ms``, ``client_other_ms``, ``sum_over_client_ttft_p50``,
``decode_ms`` per decode phase, ``client_first_gap_ms``, see ``xpyd.bench.phases``), and
with ``--include-requests`` every request's timeline (``requests``; a trace's carry their ``trace_line``, and
each its ``workers`` when named, its ``worker_timing`` and ``phases`` when sent) with ``start_perf_counter``, the run's
start on the machine's monotonic clock (the timelines' zero).
"""

from __future__ import annotations

import json
from pathlib import Path

from xpyd.bench.client import RequestResult
from xpyd.bench.metrics import CacheHits, Distribution, Summary, TurnSummary, WorkerSummaries
from xpyd.bench.overhead import Overhead, RequestOverhead
from xpyd.bench.phases import PhaseSummary, RequestPhases

SCHEMA_VERSION = 1

DEFINITIONS = {
    "ttft": "first content chunk - send (ms)",
    "tpot": "(e2e - ttft) / (usage.completion_tokens - 1) (ms); not defined for 1-token outputs",
    "itl": "every gap between consecutive content chunks (ms); a chunk may carry several tokens",
    "e2e": "end of stream ([DONE]) - send (ms)",
    "percentiles": "linear interpolation between order statistics (numpy 'linear')",
    "throughput": "over duration_s, the wall time from the first send to the last response end",
    "goodput": "completed requests/s meeting every SLO (value <= SLO; itl: every gap <= SLO), as vLLM; "
               "goodput_output_tokens_per_s: their output tokens/s",
    "slo_attainment": "requests meeting every SLO / requests sent (completed + failed); a failed one misses",
    "prefix_sharing_ratio": "trace replay: input tokens in leading blocks an earlier request of the trace had / "
                            "all input tokens: the hit rate of an unbounded prefix cache, an upper bound for "
                            "prefix_cache.hit_rate",
    "failed": "excluded from latencies and token counts",
    "workers": "per worker the server named (x-xpyd-workers), per role: the metrics above over the requests it "
               "served, over the run's duration_s and with the run's SLO; a request counts under its prefill "
               "and its decode worker",
    "proxy_overhead": "the workers' own timing (--expose-worker-timing) against the client's, same requests: "
                      "proxy_ttft = client TTFT - the TTFT of the worker that wrote the first chunk; "
                      "worker_itl = the decode (colocated) worker's gaps between the chunks it wrote, client_itl "
                      "= the client's gaps between the same chunks (P/D: all but token 1 -> 2); ratios: client / "
                      "worker",
    "phases": "where the TTFT went (--expose-worker-timing): each side's phases on its own clock; ttft_ms "
              "per phase, in the order they pass (proxy ingress, the first token's worker's parse/queue/compute/"
              "[rest]/respond (prefill, or colocated), network = the proxy's call less that worker's own time, "
              "[proxy choices: several choices' wait for the others' first tokens], [proxy rest: a JSON answer's "
              "wait for its last token], proxy egress); their sum is the proxy's TTFT (a JSON answer: its time "
              "to the answer); client_other = client TTFT - sum (client <-> proxy hop, the client's reading); "
              "decode_ms: the decode worker's time to token 2 (parse, wait, transfer, queue, step, respond; "
              "colocated: its first decode step's queue, step, respond), beside client_first_gap (token 1 -> 2 "
              "at the client)",
    "prefix_cache": "hit_rate = sum(usage.prompt_tokens_details.cached_tokens) / sum(usage.prompt_tokens) over "
                    "the completed requests reporting cached_tokens; null when none does",
}


def _dist(d: Distribution) -> dict:
    return {"mean": d.mean, "p50": d.p50, "p90": d.p90, "p99": d.p99, "max": d.max, "count": d.count}


def _cache(c: CacheHits) -> dict:
    return {"hit_rate": c.hit_rate, "cached_tokens": c.cached_tokens, "prompt_tokens": c.prompt_tokens,
            "requests": c.requests}


def turns_dict(t: TurnSummary) -> dict:
    return {
        "turns": [{"turn": s.turn, "completed": s.completed, "failed": s.failed, "ttft_ms": _dist(s.ttft),
                   "prefix_cache": _cache(s.cache)} for s in t.turns],
        "first_turn": {"prefix_cache": _cache(t.first)},
        "later_turns": {"prefix_cache": _cache(t.later)},
        "turns_not_sent": t.not_sent,
    }


def summary_dict(s: Summary) -> dict:
    return {
        "completed": s.completed,
        "failed": s.failed,
        "duration_s": s.duration_s,
        "requests_per_s": s.requests_per_s,
        "output_tokens_per_s": s.output_tokens_per_s,
        "goodput_requests_per_s": s.goodput_requests_per_s,
        "goodput_output_tokens_per_s": s.goodput_output_tokens_per_s,
        "good": s.good,
        "slo_attainment": s.slo_attainment,
        "slo_missed": s.slo_misses,
        "ttft_ms": _dist(s.ttft),
        "tpot_ms": _dist(s.tpot),
        "itl_ms": _dist(s.itl),
        "e2e_ms": _dist(s.e2e),
        "total_output_tokens": s.total_output_tokens,
        "total_prompt_tokens": s.total_prompt_tokens,
        "mean_prompt_tokens": s.total_prompt_tokens / s.completed if s.completed else None,
        "mean_output_tokens": s.total_output_tokens / s.completed if s.completed else None,
        "usage_missing": s.usage_missing,
        "prefix_cache": _cache(s.cache),
        "errors": s.errors,
        "error_samples": s.error_samples,
    }


def workers_dict(w: WorkerSummaries) -> dict:
    out: dict = {role: {name: {
        "requests": s.completed + s.failed,
        "completed": s.completed,
        "failed": s.failed,
        "good": s.good,
        "slo_attainment": s.slo_attainment,
        "requests_per_s": s.requests_per_s,
        "output_tokens_per_s": s.output_tokens_per_s,
        "goodput_requests_per_s": s.goodput_requests_per_s,
        "goodput_output_tokens_per_s": s.goodput_output_tokens_per_s,
        "ttft_ms": _dist(s.ttft),
        "tpot_ms": _dist(s.tpot),
        "errors": s.errors,
    } for name, s in by_name.items()} for role, by_name in w.roles.items()}
    out["unattributed"] = w.unattributed
    return out


def overhead_dict(o: Overhead) -> dict:
    return {"requests": o.requests, "missing": o.missing, "misaligned": o.misaligned,
            "worker_ttft_ms": _dist(o.worker_ttft), "proxy_ttft_ms": _dist(o.proxy_ttft),
            "worker_itl_ms": _dist(o.worker_itl), "client_itl_ms": _dist(o.client_itl),
            "itl_p50_ratio": o.itl_p50_ratio, "itl_p99_ratio": o.itl_p99_ratio}


def phases_dict(p: PhaseSummary) -> dict:
    return {"requests": p.requests, "missing": p.missing, "ttft_ms": {k: _dist(d) for k, d in p.ttft.items()},
            "sum_ms": _dist(p.sum), "client_ttft_ms": _dist(p.client_ttft), "client_other_ms": _dist(p.other),
            "sum_over_client_ttft_p50": p.sum_over_client_p50,
            "decode_ms": {k: _dist(d) for k, d in p.decode.items()},
            "client_first_gap_ms": _dist(p.client_first_gap)}


def _request_phases(r: RequestResult) -> dict | None:
    p = RequestPhases.of(r)
    return None if p is None else p.as_dict()


def _request_timing(r: RequestResult) -> dict | None:
    o = RequestOverhead.of(r)
    return None if o is None else o.as_dict()


def request_records(results: list[RequestResult], start: float) -> list[dict]:
    """Every request's timeline, seconds relative to the run start."""
    return [{
        "class": r.label,
        "send_s": r.send_time - start,
        "chunks_s": [t - start for t in r.chunk_times],
        "end_s": r.end_time - start,
        "output_tokens": r.output_tokens,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "turn": r.turn,
        "trace_line": r.trace_line,
        "workers": r.workers,
        "worker_timing": _request_timing(r),
        "phases": _request_phases(r),
        "error": r.error,
    } for r in results]


def build_report(overall: Summary, classes: dict[str, Summary], config: dict, model: str,
                 warmup_failed: int = 0, turns: TurnSummary | None = None, trace: dict | None = None,
                 workers: WorkerSummaries | None = None, overhead: Overhead | None = None,
                 phases: PhaseSummary | None = None) -> dict:
    out = summary_dict(overall)
    out.update({
        "schema_version": SCHEMA_VERSION,
        "model": model,
        "slo_ms": config.get("slo_ms", {}),
        "warmup_failed": warmup_failed,
        "config": config,
        "definitions": DEFINITIONS,
    })
    if classes:
        out["classes"] = {name: summary_dict(s) for name, s in classes.items()}
    if turns is not None:
        out["multi_turn"] = turns_dict(turns)
    if trace is not None:
        out["trace"] = trace
    if workers is not None:
        out["workers"] = workers_dict(workers)
    if overhead is not None:
        out["proxy_overhead"] = overhead_dict(overhead)
    if phases is not None:
        out["phases"] = phases_dict(phases)
    return out


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)


def _fmt(v: float | None, width: int = 10) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.2f}"


def _hit_rate(c: CacheHits) -> str:
    if c.hit_rate is None:
        return "n/a"
    return f"{100 * c.hit_rate:.1f}% ({c.cached_tokens} of {c.prompt_tokens} prompt tokens)"


def _section(title: str, s: Summary) -> list[str]:
    lines = [f"--- {title} ".ljust(62, "-"),
             f"{'completed / failed':<28}{s.completed} / {s.failed}",
             f"{'requests/s':<28}{s.requests_per_s:.3f}",
             f"{'output tokens/s':<28}{s.output_tokens_per_s:.2f}",
             f"{'goodput requests/s':<28}{s.goodput_requests_per_s:.3f}"
             + (f"  (missed: {', '.join(f'{k} {v}' for k, v in s.slo_misses.items())})"
                if s.slo_misses else ""),
             f"{'goodput output tokens/s':<28}{s.goodput_output_tokens_per_s:.2f}",
             f"{'SLO attainment':<28}"
             + ("-" if s.slo_attainment is None else f"{100 * s.slo_attainment:.1f}% ({s.good} of "
                                                    f"{s.completed + s.failed} requests)"),
             f"{'prefix cache hit rate':<28}{_hit_rate(s.cache)}",
             f"{'latency (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}"]
    for name, d in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E", s.e2e)):
        lines.append(f"{name:<12}" + "".join(_fmt(v) for v in (d.mean, d.p50, d.p90, d.p99, d.max)))
    if s.errors:
        lines.append("errors: " + ", ".join(f"{k} x{v}" for k, v in sorted(s.errors.items())))
        lines.extend(f"  {e[:110]}" for e in s.error_samples)
    return lines


def _turns_section(t: TurnSummary) -> list[str]:
    lines = ["--- turns ".ljust(62, "-"),
             f"{'turn':<6}{'completed':>10}{'failed':>8}{'TTFT p50 (ms)':>15}  prefix cache hit rate"]
    for s in t.turns:
        lines.append(f"{s.turn:<6}{s.completed:>10}{s.failed:>8}{_fmt(s.ttft.p50, 15)}  {_hit_rate(s.cache)}")
    lines.append(f"{'turn 1':<28}{_hit_rate(t.first)}")
    lines.append(f"{'turns 2+':<28}{_hit_rate(t.later)}")
    if t.not_sent:
        lines.append(f"turns not sent: {t.not_sent} (a failed turn ends its conversation; --duration)")
    return lines


def _trace_section(t: dict, cache: CacheHits) -> list[str]:
    return ["--- trace ".ljust(62, "-"),
            f"{'requests':<28}{t['requests']}, over {t['span_s']:g} s of trace time, replayed in "
            f"{t['replay_span_s']:g} s",
            f"{'mean input / output tokens':<28}{t['mean_input_tokens']:.1f} / {t['mean_output_tokens']:.1f}",
            f"{'prefix-sharing ratio':<28}{100 * t['prefix_sharing_ratio']:.1f}% ({t['shared_prefix_tokens']} of "
            f"{t['total_input_tokens']} input tokens in blocks of {t['block_size']} seen before)",
            f"{'server prefix cache hits':<28}{_hit_rate(cache)} (the ratio above is its upper bound)"]


def _workers_section(w: WorkerSummaries) -> list[str]:
    lines = ["--- per worker (x-xpyd-workers) ".ljust(62, "-"),
             f"{'worker':<12}{'requests':>9}{'ok/failed':>11}{'good req/s':>11}{'good tok/s':>11}{'SLO att.':>9}"
             f"{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>9}"]
    for role, by_name in w.roles.items():
        lines.append(f"{role}:")
        for name, s in by_name.items():
            attained = "-" if s.slo_attainment is None else f"{100 * s.slo_attainment:.1f}%"
            lines.append(f"{name:<12}{s.completed + s.failed:>9}{f'{s.completed}/{s.failed}':>11}"
                         f"{s.goodput_requests_per_s:>11.3f}{s.goodput_output_tokens_per_s:>11.2f}{attained:>9}"
                         f"{_fmt(s.ttft.p50)}{_fmt(s.ttft.p99, 9)}{_fmt(s.tpot.p50)}{_fmt(s.tpot.p99, 9)}")
    if w.unattributed:
        lines.append(f"requests no worker was named for: {w.unattributed}")
    lines.append("(latencies in ms; good: meeting every SLO, over the run's duration)")
    return lines


def _overhead_section(o: Overhead) -> list[str]:
    def ratio(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    lines = ["--- what the proxy adds (the workers' own timing) ".ljust(62, "-"),
             f"{'requests with / without':<28}{o.requests} / {o.missing}"
             + (f" ({o.misaligned} misaligned: their gaps left out)" if o.misaligned else ""),
             f"{'latency (ms)':<24}{'mean':>8}{'p50':>10}{'p99':>10}{'max':>10}"]
    for name, d in (("worker TTFT", o.worker_ttft), ("proxy-added TTFT", o.proxy_ttft),
                    ("worker ITL", o.worker_itl), ("client ITL (same gaps)", o.client_itl)):
        lines.append(f"{name:<24}{_fmt(d.mean, 8)}{_fmt(d.p50)}{_fmt(d.p99)}{_fmt(d.max)}")
    lines.append(f"{'ITL client / worker':<28}p50 {ratio(o.itl_p50_ratio)}, p99 {ratio(o.itl_p99_ratio)}")
    return lines


def _phases_section(p: PhaseSummary) -> list[str]:
    ratio = "-" if p.sum_over_client_p50 is None else f"{p.sum_over_client_p50:.4f}"
    lines = ["--- where the time went (each side's own phases) ".ljust(62, "-"),
             f"{'requests with / without':<28}{p.requests} / {p.missing}",
             f"{'TTFT phase (ms)':<24}{'mean':>8}{'p50':>10}{'p99':>10}{'max':>10}"]
    for name, d in p.ttft.items():
        lines.append(f"{name:<24}{_fmt(d.mean, 8)}{_fmt(d.p50)}{_fmt(d.p99)}{_fmt(d.max)}")
    for name, d in (("= sum (proxy TTFT)", p.sum), ("client/other", p.other), ("client TTFT", p.client_ttft)):
        lines.append(f"{name:<24}{_fmt(d.mean, 8)}{_fmt(d.p50)}{_fmt(d.p99)}{_fmt(d.max)}")
    lines.append(f"{'sum p50 / client TTFT p50':<28}{ratio}")
    if any(d.count for d in p.decode.values()):
        lines.append(f"{'token 1 -> 2 (ms)':<24}{'mean':>8}{'p50':>10}{'p99':>10}{'max':>10}")
        for name, d in p.decode.items():
            lines.append(f"{'decode.' + name:<24}{_fmt(d.mean, 8)}{_fmt(d.p50)}{_fmt(d.p99)}{_fmt(d.max)}")
        d = p.client_first_gap
        lines.append(f"{'client first gap':<24}{_fmt(d.mean, 8)}{_fmt(d.p50)}{_fmt(d.p99)}{_fmt(d.max)}")
    return lines


def format_table(overall: Summary, classes: dict[str, Summary], config: dict, model: str,
                 turns: TurnSummary | None = None, trace: dict | None = None,
                 workers: WorkerSummaries | None = None, overhead: Overhead | None = None,
                 phases: PhaseSummary | None = None) -> str:
    if tc := config.get("trace"):
        load = f"trace {tc['path']} at {tc['time_scale']:g}x"
    elif config.get("rate") is not None:
        load = f"rate {config['rate']} req/s"
    else:
        load = f"concurrency {config.get('concurrency')}"
    lines = ["=" * 62,
             f"xpyd bench: {config['url']} ({config['endpoint']}), model {model}",
             f"workload {config['workload']}, {load}, duration {overall.duration_s:.2f} s",
             f"SLO: {', '.join(f'{k}<={v:g}ms' for k, v in config.get('slo_ms', {}).items()) or 'none'}"]
    if sp := config.get("shared_prefix"):
        lines.append(f"shared prefixes: {sp['num_prefixes']} of {sp['prefix_len']} tokens, {sp['assignment']}; "
                     f"suffixes: {sp['suffix_len']} tokens, each request its own")
    if mt := config.get("multi_turn"):
        lines.append(f"{mt['conversations']} conversations x {mt['turns']} turns, context {mt['prefix_len']} "
                     f"tokens ({'shared' if mt['shared_context'] else 'each its own'}), think time "
                     f"mean {mt['think_time_s']:g} s ({mt['think_time']})")
    lines += _section("all requests", overall)
    for name, s in classes.items():
        lines += _section(f"class {name}", s)
    if turns is not None:
        lines += _turns_section(turns)
    if trace is not None:
        lines += _trace_section(trace, overall.cache)
    if workers is not None:
        lines += _workers_section(workers)
    if overhead is not None:
        lines += _overhead_section(overhead)
    if phases is not None:
        lines += _phases_section(phases)
    lines.append("ITL is per streamed chunk; TPOT uses usage.completion_tokens.")
    if overall.cache.hit_rate is None:
        lines.append("prefix cache n/a: no usage.prompt_tokens_details.cached_tokens "
                     "(vLLM: --enable-prompt-tokens-details)")
    lines.append("=" * 62)
    return "\n".join(lines)
