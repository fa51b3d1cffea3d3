"""What a prefill step costs, learned from the steps computed: the chunked scheduler's time budget.

A step's seconds ~ ``overhead + per_token * tokens + per_pair * pairs``, where ``pairs`` counts the
(query, key) pairs its attention computes: a chunk of ``n`` prompt tokens after ``s`` computed ones attends
``n * s + n * (n + 1) / 2``. On a CPU the pairs dominate a long prompt's later chunks (SmolLM2-135M, bf16:
a 512-token chunk after 1,024 tokens takes twice what the prompt's first 512 do); on a GPU the overhead
does. The coefficients are a least-squares fit over the steps seen, recent ones weighted more (``decay``
per step), each kept >= 0. Once known, a step counts as at most ``SLOWER`` times what the fit expected of
it, and at least 1/``FASTER``: another process on the cores only ever slows a step, by however much, so the
fit follows the steps that ran unhindered (what the scheduler needs is how the costs of steps compare, which
a slowdown of every step leaves as it is), and a lasting change still moves it step by step. Until ``MIN_STEPS`` steps are seen nothing is known (``known`` is False) and
the scheduler budgets tokens alone.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Sequence

MIN_STEPS = 8  # steps seen before the fit is used
DECAY = 0.97  # weight of a step seen one step earlier
SLOWER, FASTER = 1.1, 4.0  # a step counts as at most 1.1 times what the fit expected of it, at least 1/4
# Features are scaled so the normal equations stay well conditioned: tokens in thousands, pairs in millions.
_TOKENS, _PAIRS = 1e3, 1e6
_RIDGE = 1e-9  # (relative to the fit's weight: keeps a direction no step has shown yet at zero, not undefined)


def pairs(start: int, n: int) -> int:
    """Attention (query, key) pairs of a chunk of ``n`` tokens after ``start`` computed ones."""
    return n * start + n * (n + 1) // 2


@dataclass(frozen=True, slots=True)
class Coefficients:
    overhead: float  # seconds per step
    per_token: float  # seconds per prompt token
    per_pair: float  # seconds per attention pair

    def __post_init__(self) -> None:
        if min(self.overhead, self.per_token, self.per_pair) < 0 or not all(
                math.isfinite(v) for v in (self.overhead, self.per_token, self.per_pair)):
            raise ValueError(f"step cost coefficients must be finite and >= 0: {self}")

    def chunk_seconds(self, start: int, n: int) -> float:
        """A chunk's share of a step (the step's overhead not included)."""
        return self.per_token * n + self.per_pair * pairs(start, n)

    def tokens_within(self, start: int, seconds: float) -> int:
        """The most tokens a chunk after ``start`` computed ones may have to take at most ``seconds``."""
        if seconds <= 0:
            return 0
        a, b = self.per_token + self.per_pair * (start + 0.5), self.per_pair / 2  # seconds = a*n + b*n^2
        if b == 0:
            return sys.maxsize if a == 0 else int(seconds / a)
        n = int((-a + math.sqrt(a * a + 4 * b * seconds)) / (2 * b))
        while n > 0 and self.chunk_seconds(start, n) > seconds:  # (rounding)
            n -= 1
        return n


@dataclass(slots=True)
class StepCost:
    """The fitted cost of a step; ``observe`` each step computed (its chunks' (start, tokens), its seconds)."""

    decay: float = DECAY
    coefficients: Coefficients | None = None  # None until MIN_STEPS steps are seen (or set: tests)
    steps: int = 0
    _xtx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    _xty: list[float] = field(default_factory=lambda: [0.0] * 3)

    def __post_init__(self) -> None:
        if not 0 < self.decay <= 1:
            raise ValueError("decay must be in (0, 1]")

    @property
    def known(self) -> bool:
        return self.coefficients is not None

    def step_seconds(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Seconds a step of ``chunks`` ((start, tokens) each) should take (``known`` only)."""
        c = self._require()
        return c.overhead + sum(c.chunk_seconds(s, n) for s, n in chunks)

    def observe(self, chunks: Sequence[tuple[int, int]], seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"a step's seconds must be finite and >= 0, not {seconds}")
        if self.coefficients is not None:  # (a stall, e.g. another process on the cores, moves the fit a step)
            expected = self.step_seconds(chunks)
            seconds = min(max(seconds, expected / FASTER), expected * SLOWER)
        x = (1.0, sum(n for _, n in chunks) / _TOKENS, sum(pairs(s, n) for s, n in chunks) / _PAIRS)
        for i in range(3):
            self._xty[i] = self.decay * self._xty[i] + x[i] * seconds
            for j in range(3):
                self._xtx[i][j] = self.decay * self._xtx[i][j] + x[i] * x[j]
        self.steps += 1
        if self.steps >= MIN_STEPS:
            o, t, p = _nonnegative_fit(self._xtx, self._xty)
            self.coefficients = Coefficients(o, t / _TOKENS, p / _PAIRS)

    def _require(self) -> Coefficients:
        if self.coefficients is None:
            raise ValueError("no step cost is known yet")
        return self.coefficients


def _nonnegative_fit(xtx: list[list[float]], xty: list[float]) -> tuple[float, float, float]:
    """Least squares from the normal equations with every coefficient >= 0: a coefficient the free fit makes
    negative is held at 0 and the others fitted again (three unknowns: a few rounds at most)."""
    free = [0, 1, 2]
    while True:
        ridge = _RIDGE * max(xtx[0][0], 1e-12)
        a = [[xtx[i][j] + (ridge if i == j else 0.0) for j in free] for i in free]
        coef = dict(zip(free, _solve(a, [xty[i] for i in free])))
        negative = [i for i in free if coef[i] < 0]
        if not negative:
            return tuple(max(coef.get(i, 0.0), 0.0) for i in range(3))  # type: ignore[return-value]
        free.remove(min(negative, key=lambda i: coef[i]))
        if not free:
            return 0.0, 0.0, 0.0


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a small symmetric positive definite system)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0:
            return [0.0] * n
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][c] * out[c] for c in range(r + 1, n))) / m[r][r]
    return out
