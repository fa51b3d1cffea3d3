"""The online planner's state as the proxy shows it on ``GET /cluster``: its target x:y and its recent decisions.

    planner (`xpyd up --planner`, `xpyd planner`) -- every interval, under a lease of a few intervals -->
        etcd ``/planner/state`` -- watched by the proxy (``planner_etcd.PlannerWatch``) --> /cluster "planner"

The key is absent when no planner runs: a planner deletes it when it stops, and one that dies leaves it to its
lease. The value is one versioned ``PlannerState`` as JSON (as a worker's record: readable with etcdctl). What is
read is untrusted: a value over ``MAX_STATE_BYTES``, of another version or out of any bound is refused whole
(``decode_state`` raises ValueError with the reason), never shown in part.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Annotated, Protocol

import msgspec

from xpyd.discovery.types import Role

__all__ = ["DecisionRecord", "MAX_DECISIONS", "PLANNER_KEY", "PlannerMode", "PlannerState", "Target",
           "PlannerSource", "decode_state", "encode_state"]

PLANNER_KEY = "/planner/state"
STATE_VERSION = 1
MAX_STATE_BYTES = 128 << 10  # (the bounds below stay within it: 20 x (2 reasons + 16 names) ~ 107 KB)
MAX_DECISIONS = 20  # the most recent ones kept
MAX_WORKERS_NAMED = 16  # worker names per decision
MAX_COUNT = 4096  # workers of a role
MAX_TEXT = 1000  # characters of a reason or an error
MAX_NAME = 200  # ... of a worker's name

Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]


class PlannerMode(str, Enum):
    LOCAL = "local"  # `xpyd up --planner`: it starts and drains worker processes
    SCALE = "scale"  # `xpyd planner --mode scale`: it sets the Deployments' replicas
    METRICS = "metrics"  # `xpyd planner --mode metrics`: it exposes its desired replicas for an HPA or KEDA


class DecisionRecord(msgspec.Struct, frozen=True):
    """One decision and what was done about it."""

    at: Seconds  # Unix time
    role: Role
    delta: Annotated[int, msgspec.Meta(ge=-MAX_COUNT, le=MAX_COUNT)]  # > 0 started, < 0 drained
    target: Count  # the role's count after it
    reason: Text
    workers: Annotated[tuple[Name, ...], msgspec.Meta(max_length=MAX_WORKERS_NAMED)] = ()  # started or draining
    error: Text | None = None  # the action failed (the fleet stayed as it was): why

    def __post_init__(self) -> None:
        if self.delta == 0 or not math.isfinite(self.at):
            raise ValueError("a decision changes a count (delta != 0) at a finite time")

    @classmethod
    def of(cls, at: float, role: Role, delta: int, target: int, reason: str, workers: list[str],
           error: str | None) -> DecisionRecord:
        """A record cut to the bounds a reader checks (a longer one would be refused whole)."""
        return cls(at, role, delta, target, reason[:MAX_TEXT],
                   tuple(n[:MAX_NAME] for n in workers[:MAX_WORKERS_NAMED] if n),
                   None if error is None else error[:MAX_TEXT])


class Target(msgspec.Struct, frozen=True):
    prefill: Count
    decode: Count


class PlannerState(msgspec.Struct, frozen=True):
    mode: PlannerMode
    slo: Text  # as given (--slo)
    max_workers: Count
    interval_s: Annotated[float, msgspec.Meta(gt=0, le=86400)]
    updated_at: Seconds  # Unix time of the last interval judged
    target: Target | None = None  # the fleet the planner wants now (None: before its first interval)
    decisions: Annotated[tuple[DecisionRecord, ...], msgspec.Meta(max_length=MAX_DECISIONS)] = ()  # oldest first
    version: int = STATE_VERSION

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval_s) and math.isfinite(self.updated_at)):
            raise ValueError("interval and update time must be finite")

    def to_dict(self) -> dict:
        """As JSON takes it (enums as their values)."""
        return msgspec.to_builtins(self)


class PlannerSource(Protocol):
    """Where the proxy reads the planner's state (``planner_etcd.PlannerWatch``; a fake in tests)."""

    @property
    def state(self) -> PlannerState | None: ...


def encode_state(state: PlannerState) -> bytes:
    value = msgspec.json.encode(state)
    if len(value) > MAX_STATE_BYTES:
        raise ValueError(f"planner state of {len(value)} bytes is over {MAX_STATE_BYTES}")
    return value


def decode_state(value: bytes) -> PlannerState:
    """The state stored under ``PLANNER_KEY``; ValueError (with the reason) if it must be ignored."""
    if len(value) > MAX_STATE_BYTES:
        raise ValueError(f"{len(value)} bytes, over {MAX_STATE_BYTES}")
    try:
        version = msgspec.json.decode(value, type=_Versioned).version
    except msgspec.DecodeError as e:
        raise ValueError(f"not a planner state: {e}") from None
    if version != STATE_VERSION:
        raise ValueError(f"planner state version {version}, this xpyd reads {STATE_VERSION}")
    try:
        return msgspec.json.decode(value, type=PlannerState)
    except msgspec.DecodeError as e:  # (ValidationError too: a bound, a type, a __post_init__)
        raise ValueError(f"not a planner state: {e}") from None


class _Versioned(msgspec.Struct):
    version: int = STATE_VERSION
