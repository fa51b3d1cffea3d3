"""The planner's SLO: latency targets per request and the share of requests that must meet them.

``ttft=2s,itl=50ms,attainment=0.95``: keys ``ttft`` (time to the first token), ``itl`` (every gap between two
tokens of the request, as `xpyd bench --slo` counts it), ``tpot`` (the request's mean gap), ``e2e`` (the
whole request); units us, ms or s (a bare number is milliseconds, as in `xpyd bench`); ``attainment`` a share
in (0, 1] (default 0.95) or a percentage (``95%``). The same latency keys mean the same as in `xpyd bench
--slo`, so one string serves both.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["PlanSLO", "RequestTimes"]

_KEYS = {"ttft": "ttft_s", "itl": "itl_s", "tpot": "tpot_s", "e2e": "e2e_s"}
_DURATION = re.compile(r"^([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*(us|ms|s)?$")
_UNIT_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1e-3}


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """One request's latencies in seconds; ``max_itl_s``/``mean_itl_s`` None for a one-token answer."""

    ttft_s: float
    max_itl_s: float | None
    mean_itl_s: float | None
    e2e_s: float


@dataclass(frozen=True, slots=True)
class PlanSLO:
    ttft_s: float | None = None
    itl_s: float | None = None  # every gap of a request
    tpot_s: float | None = None  # a request's mean gap
    e2e_s: float | None = None
    attainment: float = 0.95  # the share of requests that must meet every target

    def __post_init__(self) -> None:
        for name in _KEYS.values():
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"SLO {name[:-2]} must be a duration > 0, got {v!r}")
        if all(getattr(self, name) is None for name in _KEYS.values()):
            raise ValueError("an SLO needs at least one of ttft, itl, tpot, e2e")
        a = self.attainment
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 < a <= 1:
            raise ValueError(f"SLO attainment must be in (0, 1], got {a!r}")

    @classmethod
    def parse(cls, text: str) -> PlanSLO:
        """``ValueError`` naming the item for anything but ``KEY=VALUE[,KEY=VALUE...]``."""
        values: dict[str, float] = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, sep, raw = item.partition("=")
            key, raw = key.strip().lower(), raw.strip().lower()
            if not sep or key not in (*_KEYS, "attainment"):
                raise ValueError(f"bad SLO item {item!r}: expected KEY=VALUE with KEY one of "
                                 f"ttft, itl, tpot, e2e, attainment (e.g. ttft=2s,itl=50ms,attainment=0.95)")
            attr = _KEYS.get(key, key)
            if attr in values:
                raise ValueError(f"SLO {key} given twice")
            values[attr] = _attainment(raw) if key == "attainment" else _duration(key, raw)
        return cls(**values)

    def met(self, t: RequestTimes) -> bool:
        return not (self.ttft_s is not None and t.ttft_s > self.ttft_s
                    or self.itl_s is not None and t.max_itl_s is not None and t.max_itl_s > self.itl_s
                    or self.tpot_s is not None and t.mean_itl_s is not None and t.mean_itl_s > self.tpot_s
                    or self.e2e_s is not None and t.e2e_s > self.e2e_s)

    def describe(self) -> str:
        parts = [f"{k}={_ms(getattr(self, a))}" for k, a in _KEYS.items() if getattr(self, a) is not None]
        return ",".join(parts + [f"attainment={self.attainment:g}"])

    def as_dict(self) -> dict[str, float]:
        out = {f"{k}_ms": getattr(self, a) * 1000.0 for k, a in _KEYS.items() if getattr(self, a) is not None}
        return {**out, "attainment": self.attainment}


def _duration(key: str, raw: str) -> float:
    m = _DURATION.match(raw)
    if not m:
        raise ValueError(f"bad SLO value {raw!r} for {key}: expected a number with unit us, ms or s (e.g. 50ms, 2s)")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def _attainment(raw: str) -> float:
    pct = raw.endswith("%")
    try:
        v = float(raw[:-1] if pct else raw)
    except ValueError:
        raise ValueError(f"bad SLO value {raw!r} for attainment: expected a share like 0.95 or 95%") from None
    return v / 100.0 if pct else v


def _ms(seconds: float) -> str:
    return f"{seconds * 1000.0:g}ms"
