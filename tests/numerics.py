"""Tolerances for comparing floating-point results, derived from the error of the arithmetic, not tuned.

torch's CPU kernels (BLAS, oneDNN, its own vectorised loops) are picked per CPU (AVX2, AVX-512, AMX):
the same fp32 computation sums in another order on another CPU, and two code paths of xpyd (paged vs
dense attention, a batch vs one request, a prefill after a cached prefix vs a cold one) sum in another
order on any CPU. Their results differ in the last bits, by an amount set by the computation, not by
the machine the suite happened to be written on. So:

- A result is checked against a float64 computation of the same thing (``Reference``): ``|x - ref64|``
  may be at most ``FACTOR`` times the error unit of that computation in float32, measured on this
  machine's kernels as ``|ref32 - ref64|`` (transformers' own float32 forward), and never less than
  ``FACTOR * eps32 * max|ref64|``. Every float32 implementation of one computation makes the same
  roundings in another order, so their errors are of one size (rounding errors add like a random walk:
  ~ sqrt(K) * eps * |a||b| for a K-long dot product, and the same K on every path); FACTOR is the
  headroom for one path landing a few standard deviations from another.
- Two float32 paths with no float64 reference at hand differ by at most twice that.
- Tokens picked by two paths are the same where the exact top-2 logit margin exceeds twice the bound
  (both argmaxes are then the exact one); where it does not, the paths may legitimately pick different
  tokens, and after that their sequences are not comparable (``first_divergence``).
- Lower precisions (bfloat16) get the same treatment with their own epsilon (``ulps``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

EPS32 = torch.finfo(torch.float32).eps  # 2**-23: one unit in the last place of 1.0
FACTOR = 8.0  # headroom of one float32 path over another, in units of the measured float32 error


def ulps(x: torch.Tensor, n: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``n`` units in the last place of ``dtype`` (default: ``x``'s) at ``|x|``, elementwise: the
    difference one rounding (n = 1) makes, with the subnormal floor at the smallest normal."""
    info = torch.finfo(dtype or x.dtype)
    return n * info.eps * x.detach().abs().double().clamp_min(info.tiny)


@dataclass(frozen=True)
class Reference:
    """What an exact computation gives (``exact``, float64) and how far a float32 one may be from it."""

    exact: torch.Tensor  # float64
    bound: float  # |float32 result - exact| allowed, elementwise

    @classmethod
    def measure(cls, ref64: torch.Tensor, ref32: torch.Tensor, factor: float = FACTOR) -> "Reference":
        """The float64 result and a float32 computation of the same thing on this machine's kernels."""
        exact = ref64.detach().double()
        # (the same numbers as max|ref32 - exact| and max|exact|, computed in one copy instead of four
        # temporaries: a model's logits over a long prompt are tens of millions of values)
        measured = float(ref32.detach().to(torch.float64, copy=True).sub_(exact).abs_().max())
        lo, hi = torch.aminmax(exact)
        unit = EPS32 * float(torch.maximum(-lo, hi))
        return cls(exact, factor * max(measured, unit))

    def check(self, x: torch.Tensor, what: str = "") -> None:
        """``x`` (float32) is within the bound of the exact result everywhere."""
        err = (x.detach().double() - self.exact).abs()
        worst = int(err.argmax())
        assert float(err.max()) <= self.bound, (
            f"{what}: |x - ref64| = {float(err.max()):.3g} at {worst} > bound {self.bound:.3g} "
            f"({int((err > self.bound).sum())} of {err.numel()} elements)")

    def check_pair(self, a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
        """Two float32 results of this computation: each within the bound of the exact one."""
        self.check(a, f"{what} (first)")
        self.check(b, f"{what} (second)")

    def margins(self) -> torch.Tensor:
        """Exact top-2 margin of each row (logits [..., vocab])."""
        top = self.exact.topk(2, dim=-1).values
        return top[..., 0] - top[..., 1]


def assert_paths_close(a: torch.Tensor, b: torch.Tensor, bound: float, what: str = "") -> None:
    """Two float32 paths of one computation whose float32 error is at most ``bound`` each: they differ by
    at most 2 * bound."""
    diff = (a.detach().double() - b.detach().double()).abs()
    assert float(diff.max()) <= 2 * bound, (
        f"{what}: |a - b| = {float(diff.max()):.3g} > 2 x bound {bound:.3g} "
        f"({int((diff > 2 * bound).sum())} of {diff.numel()} elements)")


def first_divergence(ours: Sequence[int], theirs: Sequence[int], margins: Sequence[float], bound: float) -> int:
    """Compare two greedy sequences picked by float32 paths whose logits are within ``bound`` of the exact
    ones, ``margins[t]`` the exact top-2 margin at step t of ``theirs``: where the margin exceeds twice the
    bound both must pick the exact argmax, so their tokens must agree (asserted); the first step where they
    differ is returned (len when they never do) and must be one whose margin is within twice the bound.
    Nothing after it is compared: the two contexts differ from there."""
    assert len(ours) == len(theirs) <= len(margins), (len(ours), len(theirs), len(margins))
    for t, (x, y) in enumerate(zip(ours, theirs)):
        if x != y:
            assert margins[t] <= 2 * bound, (
                f"step {t}: token {x} != {y} though the top-2 margin {margins[t]:.3g} exceeds 2 x {bound:.3g}")
            return t
    return len(ours)


def assert_decided(rows: Reference, tokens: Sequence[int], what: str = "") -> None:
    """``tokens`` are the exact greedy picks of ``rows`` (the exact logits each step picked from), and
    each one by a top-2 margin over twice the float32 bound, so any float32 path of the model picks the
    same tokens: tests that compare tokens across paths use prompts for which this holds (a prompt
    with a closer call needs another prompt, not a looser check)."""
    picks = rows.exact.argmax(-1).tolist()
    assert len(picks) == len(tokens), (len(picks), len(tokens))
    margins = rows.margins().tolist()
    for t, (ours, exact) in enumerate(zip(tokens, picks)):
        assert margins[t] > 2 * rows.bound, (
            f"{what}: step {t} is decided by a top-2 margin of {margins[t]:.3g}, within 2 x the float32 bound "
            f"{rows.bound:.3g}: float32 paths may pick either token; choose another prompt")
        assert ours == exact, f"{what}: step {t}: token {ours}, the exact (float64) greedy pick is {exact}"


def decided_greedy(model, model64, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens for ``ids`` (``model``: float32; ``model64``: the same weights in
    float64), each asserted to be decided by more than the float32 error (`assert_decided`): the tokens
    any float32 path of this model gives, on any CPU, so a reference other paths can be compared to."""
    prompt = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=model.generation_config.eos_token_id)
        tokens = out[0, len(ids):].tolist()
        seq = torch.tensor([ids + tokens[:-1]])
        ref = Reference.measure(model64(seq).logits[0], model(seq).logits[0])
    assert_decided(Reference(ref.exact[len(ids) - 1 :], ref.bound), tokens, "reference")
    return tokens


def assert_roundings_apart(a: torch.Tensor, b: torch.Tensor, n: float = 1.0, what: str = "") -> None:
    """``a`` and ``b`` (of one low-precision dtype) are one value computed in float32 in two orders and
    rounded: the float32 error (FACTOR * eps32 at the largest magnitude) may move a value across a
    rounding boundary, so they are at most ``n`` units in the last place of their dtype apart (at the
    larger of the two) plus that error."""
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    x, y = a.detach().double(), b.detach().double()
    bound = ulps(torch.maximum(x.abs(), y.abs()), n, a.dtype) + FACTOR * EPS32 * float(y.abs().max())
    over = (x - y).abs() > bound
    assert not over.any(), (f"{what}: {int(over.sum())} of {over.numel()} elements more than {n:g} {a.dtype} "
                            f"rounding(s) apart, e.g. {x[over][:3].tolist()} vs {y[over][:3].tolist()}")
