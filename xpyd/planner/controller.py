"""The online planner's decisions: when to start or drain a prefill or a decode worker, and why.

Each interval (``Controller.decide``): the interval's load -> the next one's forecast (`predict`) -> for each
role the least workers the model (`online_model`) predicts to meet the SLO -> at most one decision per role:

- **up** at once when the current count is predicted to miss the SLO's attainment (by up to ``max_step``
  workers, toward the least count that meets it);
- **down** by one worker only when one fewer is predicted to meet the attainment plus ``headroom`` for
  ``down_intervals`` intervals in a row (hysteresis: a load that hovers near a threshold moves nothing, as
  the band between the two thresholds holds it);
- **never** within ``dwell_s`` of the role's last change, nor past ``max_workers`` in all, nor under one
  worker of a role.

The prefill count is sized on the prefill side's share (TTFT, which does not depend on the decode side in the
model), then the decode count on the whole SLO with that prefill count. Every decision carries its reason;
``notes`` says why a change that was due did not happen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

from xpyd.planner.observe import Interval
from xpyd.planner.online_model import FleetModel, Prediction
from xpyd.planner.predict import Forecast, Predictor, PredictorConfig
from xpyd.planner.slo import PlanSLO

__all__ = ["Controller", "Decision", "Fleet", "PlannerConfig", "Role"]


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class Fleet:
    """Workers of each role serving or starting (a draining one no longer counts)."""

    prefill: int
    decode: int

    def __post_init__(self) -> None:
        for role in Role:
            v = getattr(self, role.value)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{role.value} workers must be an int >= 0, got {v!r}")

    def count(self, role: Role) -> int:
        return getattr(self, role.value)

    @property
    def label(self) -> str:
        return f"{self.prefill}P{self.decode}D"


@dataclass(frozen=True, slots=True)
class Decision:
    at_s: float
    role: Role
    delta: int  # > 0: start that many; < 0: drain that many
    target: int  # the role's count after it
    reason: str

    def __post_init__(self) -> None:
        if self.delta == 0 or self.target < 1:
            raise ValueError(f"a decision changes a role's count and leaves >= 1 worker: {self.delta}, {self.target}")

    def as_dict(self) -> dict[str, object]:
        return {"at_s": self.at_s, "role": self.role.value, "delta": self.delta, "target": self.target,
                "reason": self.reason}


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    slo: PlanSLO
    max_workers: int = 8  # prefill + decode
    dwell_s: float = 60.0  # no change of a role within this long of its last one
    down_intervals: int = 3  # intervals in a row one fewer must be predicted to meet the SLO with headroom
    headroom: float = 0.03  # ... the SLO's attainment plus this (the hysteresis band's width)
    max_step: int = 1  # workers one decision starts at most
    predictor: PredictorConfig = field(default_factory=PredictorConfig)

    def __post_init__(self) -> None:
        if isinstance(self.max_workers, bool) or not isinstance(self.max_workers, int) or self.max_workers < 2:
            raise ValueError(f"--max-workers must be an int >= 2 (one prefill, one decode), got {self.max_workers!r}")
        if not (math.isfinite(self.dwell_s) and self.dwell_s >= 0):
            raise ValueError(f"the dwell time must be >= 0 s, got {self.dwell_s!r}")
        if self.down_intervals < 1 or self.max_step < 1:
            raise ValueError(f"down intervals and max step must be >= 1, got {self.down_intervals}, {self.max_step}")
        if not 0 <= self.headroom < 1:
            raise ValueError(f"headroom must be a share in [0, 1), got {self.headroom!r}")


@dataclass(frozen=True, slots=True)
class _Sizing:
    least: int  # the least count predicted to meet the attainment (the cap when none does)
    found: bool  # False: none up to the cap does
    current: Prediction  # the count now
    fewer: Prediction | None  # one fewer than now (None: at the minimum)


class Controller:
    def __init__(self, config: PlannerConfig, model: FleetModel) -> None:
        self.config = config
        self._model = model
        self._predictor = Predictor(config.predictor)
        self._changed_at: dict[Role, float] = {}
        self._down_streak = {role: 0 for role in Role}
        self.forecast: Forecast | None = None  # the last decide's
        self.notes: tuple[str, ...] = ()  # ... why a change that was due did not happen

    def decide(self, now: float, interval: Interval, fleet: Fleet) -> list[Decision]:
        c = self.config
        load = self.forecast = self._predictor.update(interval)
        prefill = self._size(Role.PREFILL, fleet, lambda x: self._model.predict(x, max(1, fleet.decode), load),
                             lambda p: p.prefill_met, c.max_workers - 1)
        x_after = max(1, fleet.prefill, min(prefill.least, fleet.prefill + c.max_step))  # after any start
        decode = self._size(Role.DECODE, fleet, lambda y: self._model.predict(x_after, y, load),
                            lambda p: p.met, max(1, c.max_workers - x_after))
        decisions, notes = [], []
        room = c.max_workers - fleet.prefill - fleet.decode
        for role, sizing in ((Role.PREFILL, prefill), (Role.DECODE, decode)):
            decision, note = self._decide_role(now, role, fleet.count(role), sizing, load, room)
            if decision is not None:
                decisions.append(decision)
                room -= decision.delta
                self._changed_at[role] = now
                self._down_streak[role] = 0
            if note:
                notes.append(note)
        self.notes = tuple(notes)
        return decisions

    def _size(self, role: Role, fleet: Fleet, predict, share, cap: int) -> _Sizing:
        """The least count from 1 up to ``cap`` predicted to meet the attainment, and now's and one fewer's."""
        seen: dict[int, Prediction] = {}

        def at(n: int) -> Prediction:
            if n not in seen:
                seen[n] = predict(n)
            return seen[n]

        least = next((n for n in range(1, cap + 1) if share(at(n)) >= self.config.slo.attainment), None)
        now_n = fleet.count(role)
        return _Sizing(least or cap, least is not None, at(max(1, now_n)), at(now_n - 1) if now_n > 1 else None)

    def _decide_role(self, now: float, role: Role, n: int, s: _Sizing, load: Forecast,
                     room: int) -> tuple[Decision | None, str]:
        c = self.config
        side = "the TTFT target" if role is Role.PREFILL else "the SLO"
        share = (lambda p: p.prefill_met) if role is Role.PREFILL else (lambda p: p.met)
        dwelling = role in self._changed_at and now - self._changed_at[role] < c.dwell_s
        since = f"changed {now - self._changed_at[role]:.0f}s ago (dwell {c.dwell_s:g}s)" if dwelling else ""
        if n < 1 or share(s.current) < c.slo.attainment:
            self._down_streak[role] = 0
            want = max(1, min(s.least - n, c.max_step))
            if dwelling:
                return None, f"{role.value} +{want} due but {since}"
            step = min(want, room)
            if step < 1:
                return None, f"{role.value} +{want} due but the fleet is at --max-workers {c.max_workers}"
            met = f"{s.least} needed" if s.found else f"none up to --max-workers {c.max_workers} meets it"
            return Decision(now, role, step, n + step,
                            f"at {load.describe()} {n} {role.value} predicted to meet {side} for "
                            f"{share(s.current):.1%} < {c.slo.attainment:.1%}; {met}"), ""
        if n > 1 and s.fewer is not None and share(s.fewer) >= min(1.0, c.slo.attainment + c.headroom):
            self._down_streak[role] += 1
            streak = self._down_streak[role]
            if streak < c.down_intervals:
                return None, ""
            if dwelling:
                return None, f"{role.value} -1 due but {since}"
            return Decision(now, role, -1, n - 1,
                            f"at {load.describe()} {n - 1} {role.value} predicted to meet {side} for "
                            f"{share(s.fewer):.1%} >= {c.slo.attainment:.1%} + {c.headroom:.1%} headroom, "
                            f"{streak} intervals in a row"), ""
        self._down_streak[role] = 0
        return None, ""
