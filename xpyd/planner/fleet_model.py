"""A discrete-event model of a P/D fleet, timed by a simulated-engine profile.

A request moves: arrival -> routed to a prefill worker (and, at once, a decode worker, as the proxy picks
both) -> its prompt computed in that worker's steps (`prefill_model`) -> the first token (TTFT) -> the KV
hand-off (a fixed latency plus bytes over bandwidth) -> waits at its decode worker for room in the batch ->
decoded in continuous batches (`decode_model`) -> done. Each request's TTFT, mean and longest gap between
tokens and end-to-end time come out, and whether it met the SLO.

Routing as xpyd's cache-aware router: a prefill worker's cost is the blocks it would compute (the prompt less
the prefix in its `PrefixLRU`) plus its queue; a worker with more requests than the least loaded one plus a
batch is no candidate (load wins over cache). Decode: the fewest tokens assigned and not yet done.

Not modelled: decode KV capacity (only the batch limit), preemption, the proxy's own time, failures.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from xpyd.model.sim.profile import SimProfile
from xpyd.planner.decode_model import DecodeWorker, StepTimes
from xpyd.planner.prefill_model import PrefillWorker
from xpyd.planner.slo import PlanSLO
from xpyd.planner.workload import Workload

__all__ = ["FleetConfig", "FleetResult", "KVHandoff", "simulate"]


@dataclass(frozen=True, slots=True)
class KVHandoff:
    """How long after its first token a prompt's KV is at its decode worker: ``latency_s`` + the bytes still to
    move / bandwidth. Streamed (the workers' default ``--kv-stream``), each chunk's KV moves while the next
    computes, so only the last chunk's is left when the prompt is done (assumes the bandwidth keeps up with the
    prefill); else the whole prompt's."""

    bytes_per_token: int = 0  # 0: only the latency (e.g. Llama-3-8B bf16: 131072)
    bandwidth_bytes_s: float = 10e9
    latency_s: float = 0.002
    stream: bool = True

    def __post_init__(self) -> None:
        if self.bytes_per_token < 0:
            raise ValueError(f"KV bytes per token must be >= 0, got {self.bytes_per_token}")
        if not (self.bandwidth_bytes_s > 0 and math.isfinite(self.bandwidth_bytes_s)):
            raise ValueError(f"KV bandwidth must be > 0 bytes/s, got {self.bandwidth_bytes_s}")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"KV hand-off latency must be >= 0 s, got {self.latency_s}")

    def seconds(self, prompt_tokens: int, chunk: int) -> float:
        left = min(prompt_tokens, chunk) if self.stream and chunk > 0 else prompt_tokens
        return self.latency_s + left * self.bytes_per_token / self.bandwidth_bytes_s


@dataclass(frozen=True, slots=True)
class FleetConfig:
    prefill_workers: int
    decode_workers: int
    decode_batch: int = 16  # running requests per decode worker
    prefill_chunk: int = 512  # prompt tokens per prefill step (0: whole prompts, one at a time)
    prefill_batch: int = 8  # prompts a prefill worker computes at once (its --batch-size)
    kv_blocks: int = 1024  # per prefill worker: prefix blocks (of the workload's block size) it can hold
    handoff: KVHandoff = field(default_factory=KVHandoff)

    def __post_init__(self) -> None:
        for name in ("prefill_workers", "decode_workers", "decode_batch", "prefill_batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name.replace('_', ' ')} must be an int >= 1, got {v!r}")
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill chunk must be >= 0 tokens, got {self.prefill_chunk}")
        if self.kv_blocks < 0:
            raise ValueError(f"kv blocks must be >= 0, got {self.kv_blocks}")

    @property
    def workers(self) -> int:
        return self.prefill_workers + self.decode_workers

    @property
    def label(self) -> str:
        return f"{self.prefill_workers}P{self.decode_workers}D b{self.decode_batch}"


@dataclass(frozen=True, slots=True)
class FleetResult:
    """Per-request seconds (arrays in the workload's order; NaN ITLs for one-token answers) and the summary."""

    config: FleetConfig
    ttft_s: np.ndarray
    mean_itl_s: np.ndarray
    max_itl_s: np.ndarray
    e2e_s: np.ndarray
    met: np.ndarray  # bool: met every SLO target
    duration_s: float  # first arrival to last token
    itl_p50_s: float  # over every gap between two tokens, all requests (NaN: none)
    itl_p90_s: float
    cached_tokens: int  # prompt tokens reused from the prefill workers' prefix caches
    input_tokens: int
    prefill_worker: np.ndarray  # int: the prefill worker of each request
    decode_worker: np.ndarray  # int: ... and its decode worker

    @property
    def attainment(self) -> float:
        return float(self.met.mean())

    @property
    def goodput(self) -> float:
        """Requests per second that met the SLO."""
        return float(self.met.sum()) / self.duration_s if self.duration_s > 0 else 0.0

    def summary(self) -> dict[str, float | int | str]:
        ms = lambda a, p: float(np.percentile(a, p)) * 1000.0  # noqa: E731
        itl = self.mean_itl_s[~np.isnan(self.mean_itl_s)]
        return {"config": self.config.label, "prefill_workers": self.config.prefill_workers,
                "decode_workers": self.config.decode_workers, "decode_batch": self.config.decode_batch,
                "workers": self.config.workers, "attainment": self.attainment, "goodput_rps": self.goodput,
                "ttft_p50_ms": ms(self.ttft_s, 50), "ttft_p90_ms": ms(self.ttft_s, 90),
                "ttft_p99_ms": ms(self.ttft_s, 99),
                "itl_p50_ms": self.itl_p50_s * 1000.0, "itl_p90_ms": self.itl_p90_s * 1000.0,
                "tpot_p50_ms": ms(itl, 50) if itl.size else float("nan"),
                "tpot_p90_ms": ms(itl, 90) if itl.size else float("nan"),
                "e2e_p50_ms": ms(self.e2e_s, 50), "duration_s": self.duration_s,
                "prefix_hit_rate": self.cached_tokens / self.input_tokens}


_ARRIVE, _PREFILL_STEP, _KV_READY, _DECODE_SEGMENT = range(4)


def simulate(profile: SimProfile, workload: Workload, config: FleetConfig, slo: PlanSLO) -> FleetResult:
    reqs = workload.requests
    n, bs = len(reqs), workload.block_size
    prefill = [PrefillWorker(profile, config.prefill_chunk, config.prefill_batch, config.kv_blocks)
               for _ in range(config.prefill_workers)]
    steps = StepTimes(profile.decode)
    decode = [DecodeWorker(steps, config.decode_batch) for _ in range(config.decode_workers)]
    first_token = np.zeros(n)
    last_token = np.zeros(n)
    max_gap = np.full(n, np.nan)
    to_decode = [0] * n
    to_prefill = [0] * n
    cached_total = 0
    events: list[tuple[float, int, int, int, int]] = []  # (time, seq, kind, subject, version)
    seq = 0

    def push(t: float, kind: int, subject: int, version: int = 0) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, subject, version))
        seq += 1

    for i, r in enumerate(reqs):
        push(r.arrival_s, _ARRIVE, i)
    while events:
        now, _, kind, subject, version = heapq.heappop(events)
        if kind == _ARRIVE:
            r = reqs[subject]
            w, reused = _pick_prefill(prefill, r.hash_ids, r.input_tokens, bs, config.prefill_batch)
            to_prefill[subject] = w
            reused = min(reused, r.input_tokens - 1)  # the last prompt token is always computed
            cached_total += reused
            worker = prefill[w]
            worker.cache.touch(r.hash_ids)
            worker.add(subject, r.input_tokens - reused, reused)
            d = min(range(len(decode)), key=lambda k: decode[k].assigned_tokens)
            decode[d].assigned_tokens += r.input_tokens + r.output_tokens
            to_decode[subject] = d
            if not worker.busy:
                push(now + worker.start_step(), _PREFILL_STEP, w)
        elif kind == _PREFILL_STEP:
            worker = prefill[subject]
            for i in worker.finish_step():
                first_token[i] = now
                if reqs[i].output_tokens == 1:
                    last_token[i] = now
                    decode[to_decode[i]].assigned_tokens -= reqs[i].input_tokens + 1
                else:
                    push(now + config.handoff.seconds(reqs[i].input_tokens, config.prefill_chunk), _KV_READY, i)
            duration = worker.start_step()
            if duration is not None:
                push(now + duration, _PREFILL_STEP, subject)
        elif kind == _KV_READY:
            r = reqs[subject]
            worker = decode[to_decode[subject]]
            end = worker.arrive(subject, now, float(first_token[subject]), r.input_tokens + 1, r.output_tokens - 1)
            if end is not None:
                push(end, _DECODE_SEGMENT, to_decode[subject], worker.version)
        else:
            worker = decode[subject]
            if version != worker.version:
                continue  # a segment cut short or replanned: its later event stands
            _, finished, end = worker.segment_end()
            for run in finished:
                last_token[run.index] = now
                max_gap[run.index] = run.max_gap_s
                worker.assigned_tokens -= reqs[run.index].input_tokens + reqs[run.index].output_tokens
            if end is not None:
                push(end, _DECODE_SEGMENT, subject, worker.version)
    arrival = np.array([r.arrival_s for r in reqs])
    outputs = np.array([r.output_tokens for r in reqs])
    ttft = first_token - arrival
    e2e = last_token - arrival
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_itl = np.where(outputs > 1, (last_token - first_token) / np.maximum(outputs - 1, 1), np.nan)
    met = _met(slo, ttft, mean_itl, max_gap, e2e)
    p50, p90 = _gap_percentiles(decode, (50, 90))
    return FleetResult(config, ttft, mean_itl, max_gap, e2e, met, float(last_token.max() - arrival.min()),
                       p50, p90, cached_total, sum(r.input_tokens for r in reqs), np.array(to_prefill),
                       np.array(to_decode))


def _pick_prefill(workers: list[PrefillWorker], hash_ids: tuple[int, ...], input_tokens: int, block_size: int,
                  batch: int) -> tuple[int, int]:
    """(the worker, the prompt tokens it reuses): the least blocks to compute plus queue, among the workers no
    busier than the least loaded by more than a batch; ties to the shorter queue, then the first."""
    loads = [w.jobs for w in workers]
    least = min(loads)
    best: tuple[float, int, int] | None = None
    pick = (0, 0)
    for k, w in enumerate(workers):
        if loads[k] - least > batch:
            continue
        reused = min(w.cache.cached_blocks(hash_ids) * block_size, input_tokens)
        cost = ((input_tokens - reused) + w.queued_tokens) / block_size
        key = (cost, loads[k], k)
        if best is None or key < best:
            best, pick = key, (k, reused)
    return pick


def _met(slo: PlanSLO, ttft: np.ndarray, mean_itl: np.ndarray, max_itl: np.ndarray, e2e: np.ndarray) -> np.ndarray:
    ok = np.ones(ttft.shape, dtype=bool)
    if slo.ttft_s is not None:
        ok &= ttft <= slo.ttft_s
    if slo.itl_s is not None:
        ok &= np.isnan(max_itl) | (max_itl <= slo.itl_s)
    if slo.tpot_s is not None:
        ok &= np.isnan(mean_itl) | (mean_itl <= slo.tpot_s)
    if slo.e2e_s is not None:
        ok &= e2e <= slo.e2e_s
    return ok


def _gap_percentiles(decode: list[DecodeWorker], ps: tuple[float, ...]) -> list[float]:
    """Weighted percentiles of every gap between tokens (a step's time counts once per request in it)."""
    values = [a for w in decode for a, _ in w.gaps] + [np.asarray(w.first_gaps) for w in decode]
    weights = [np.full(a.shape, b, dtype=np.float64) for w in decode for a, b in w.gaps]
    weights += [np.ones(len(w.first_gaps)) for w in decode]
    v = np.concatenate(values) if values else np.empty(0)
    if v.size == 0:
        return [float("nan")] * len(ps)
    wt = np.concatenate(weights)
    order = np.argsort(v, kind="stable")
    v, cum = v[order], np.cumsum(wt[order])
    return [float(v[min(int(np.searchsorted(cum, p / 100.0 * cum[-1], side="left")), v.size - 1)]) for p in ps]
