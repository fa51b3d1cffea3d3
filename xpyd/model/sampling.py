"""Token sampling: greedy, or temperature / top-k / top-p with exactly one random draw per token.

One draw per sampled token is the contract that lets a seeded request cross workers: the prefill
worker samples the first token (one draw), the decode worker makes a generator from the same seed,
calls `skip_draw` once, and continues the very same random stream from the second token on.
Greedy (temperature 0, or below 1e-5 as in vLLM) never draws.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MAX_SEED = 2**64


GREEDY_BELOW = 1e-5  # temperatures under this are greedy (1/T would overflow float32 scores)

@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool):
            raise ValueError(f"top_p must be a number, got {self.top_p!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < _MAX_SEED
        ):
            raise ValueError(f"seed must be an int in [0, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW  # as vLLM: a tiny temperature would overflow the scores


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    if seed is None:
        generator.seed()  # non-deterministic
    else:
        generator.manual_seed(seed)
    return generator


def skip_draw(generator: torch.Generator) -> None:
    """Consume the one draw the other worker made for the first token."""
    torch.rand((), generator=generator)


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> list[int]:
    """logits [B, vocab] -> one token id per row."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(
            f"sample needs logits [B, vocab] with B params and generators; "
            f"got {tuple(logits.shape)}, {len(params)}, {len(generators)}"
        )
    return [_sample_row(logits[i], p, g) for i, (p, g) in enumerate(zip(params, generators))]


def _sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits.float() / params.temperature
    ids: torch.Tensor | None = None  # None: scores are in vocabulary order
    if 0 < params.top_k < scores.numel():
        scores, ids = torch.topk(scores, params.top_k)  # sorted, descending
    elif params.top_p < 1:
        scores, ids = torch.sort(scores, descending=True)
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1:
        # Keep the smallest head of the sorted distribution whose mass reaches top_p (at least one token).
        before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill(before >= params.top_p, 0.0)
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.rand((), generator=generator)  # the one draw
    j = int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=cdf.numel() - 1))
    return int(ids[j]) if ids is not None else j
