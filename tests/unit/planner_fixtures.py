"""Hand-computable profiles and workloads for the planner's tests."""

from __future__ import annotations

from xpyd.model.sim.profile import SimProfile, Table
from xpyd.planner.workload import PlanRequest, Workload


def linear_profile(prefill_per_token: float = 1e-3, prefill_per_cached: float = 5e-4, decode_base: float = 0.01,
                   decode_per_request: float = 1e-3, decode_per_context: float = 1e-6) -> SimProfile:
    """prefill(new, cached) = a new + b cached; decode(batch, context) = c + d batch + e context: bilinear tables
    reproduce them exactly, inside the grid and past it."""
    xs, ys = (0.0, 1000.0), (0.0, 1000.0)
    prefill = Table(xs, ys, tuple(tuple(prefill_per_token * n + prefill_per_cached * c for c in ys) for n in xs))
    bs, cs = (1.0, 10.0), (0.0, 10000.0)
    decode = Table(bs, cs, tuple(tuple(decode_base + decode_per_request * b + decode_per_context * c for c in cs)
                                 for b in bs))
    return SimProfile(prefill, decode, "test-model", "test-machine", "float32", None, "2026-01-01T00:00:00Z")


def workload(*requests: tuple, block_size: int = 16) -> Workload:
    """Each request: (arrival_s, input_tokens, output_tokens[, hash_ids])."""
    return Workload(tuple(PlanRequest(*r) for r in requests), block_size)
