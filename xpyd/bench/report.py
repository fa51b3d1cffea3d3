"""The results as JSON (the contract scripts rely on) and as a printed table.

JSON top level: ``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2e_ms`` (each ``mean``, ``p50``, ``p90``,
``p99``, ``max``, ``count``; null when there is no sample), ``output_tokens_per_s``, ``requests_per_s``,
``goodput_requests_per_s``, ``completed``, ``failed``, plus ``duration_s``, ``errors`` (failed
requests by kind), ``slo_ms`` / ``good`` / ``slo_missed``, token totals, ``config``, ``definitions``,
``classes`` (per request class, same keys; prefill-stall: ``short`` and ``long``), and with
``--include-requests`` every request's timeline (``requests``).
"""

from __future__ import annotations

import json
from pathlib import Path

from xpyd.bench.client import RequestResult
from xpyd.bench.metrics import Distribution, Summary

SCHEMA_VERSION = 1

DEFINITIONS = {
    "ttft": "first content chunk - send (ms)",
    "tpot": "(e2e - ttft) / (usage.completion_tokens - 1) (ms); not defined for 1-token outputs",
    "itl": "every gap between consecutive content chunks (ms); a chunk may carry several tokens",
    "e2e": "end of stream ([DONE]) - send (ms)",
    "percentiles": "linear interpolation between order statistics (numpy 'linear')",
    "throughput": "over duration_s, the wall time from the first send to the last response end",
    "goodput": "completed requests/s meeting every SLO (value <= SLO; itl: every gap <= SLO), as vLLM",
    "failed": "excluded from latencies and token counts",
}


def _dist(d: Distribution) -> dict:
    return {"mean": d.mean, "p50": d.p50, "p90": d.p90, "p99": d.p99, "max": d.max, "count": d.count}


def summary_dict(s: Summary) -> dict:
    return {
        "completed": s.completed,
        "failed": s.failed,
        "duration_s": s.duration_s,
        "requests_per_s": s.requests_per_s,
        "output_tokens_per_s": s.output_tokens_per_s,
        "goodput_requests_per_s": s.goodput_requests_per_s,
        "good": s.good,
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
        "errors": s.errors,
        "error_samples": s.error_samples,
    }


def request_records(results: list[RequestResult], start: float) -> list[dict]:
    """Every request's timeline, seconds relative to the run start."""
    return [{
        "class": r.label,
        "send_s": r.send_time - start,
        "chunks_s": [t - start for t in r.chunk_times],
        "end_s": r.end_time - start,
        "output_tokens": r.output_tokens,
        "prompt_tokens": r.prompt_tokens,
        "error": r.error,
    } for r in results]


def build_report(overall: Summary, classes: dict[str, Summary], config: dict, model: str,
                 warmup_failed: int = 0) -> dict:
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
    return out


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)


def _fmt(v: float | None, width: int = 10) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.2f}"


def _section(title: str, s: Summary) -> list[str]:
    lines = [f"--- {title} ".ljust(62, "-"),
             f"{'completed / failed':<28}{s.completed} / {s.failed}",
             f"{'requests/s':<28}{s.requests_per_s:.3f}",
             f"{'output tokens/s':<28}{s.output_tokens_per_s:.2f}",
             f"{'goodput requests/s':<28}{s.goodput_requests_per_s:.3f}"
             + (f"  (missed: {', '.join(f'{k} {v}' for k, v in s.slo_misses.items())})"
                if s.slo_misses else ""),
             f"{'latency (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}"]
    for name, d in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E", s.e2e)):
        lines.append(f"{name:<12}" + "".join(_fmt(v) for v in (d.mean, d.p50, d.p90, d.p99, d.max)))
    if s.errors:
        lines.append("errors: " + ", ".join(f"{k} x{v}" for k, v in sorted(s.errors.items())))
        lines.extend(f"  {e[:110]}" for e in s.error_samples)
    return lines


def format_table(overall: Summary, classes: dict[str, Summary], config: dict, model: str) -> str:
    load = (f"rate {config['rate']} req/s" if config.get("rate") is not None
            else f"concurrency {config.get('concurrency')}")
    lines = ["=" * 62,
             f"xpyd bench: {config['url']} ({config['endpoint']}), model {model}",
             f"workload {config['workload']}, {load}, duration {overall.duration_s:.2f} s",
             f"SLO: {', '.join(f'{k}<={v:g}ms' for k, v in config.get('slo_ms', {}).items()) or 'none'}"]
    lines += _section("all requests", overall)
    for name, s in classes.items():
        lines += _section(f"class {name}", s)
    lines.append("ITL is per streamed chunk; TPOT uses usage.completion_tokens.")
    lines.append("=" * 62)
    return "\n".join(lines)
