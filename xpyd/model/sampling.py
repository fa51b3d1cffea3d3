"""Token sampling: greedy, or temperature / top-k / top-p with exactly one random draw per token.

One draw per sampled token is the contract that lets a seeded request cross workers: the prefill
worker samples the first token (one draw), the decode worker makes a generator from the same seed,
calls `skip_draw` once, and continues the very same random stream from the second token on.
Greedy (temperature 0, or below 1e-5 as in vLLM) never draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from xpyd.model.sampling_params import GREEDY_BELOW, SamplingParams

__all__ = ["GREEDY_BELOW", "SamplingParams", "TorchSampler", "make_generator", "sample", "skip_draw"]


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


class TorchSampler:
    """Sampling as a runner offers it to the role engines: ``sample`` one token per logits row (a [B, vocab]
    tensor, or a list of [vocab] rows), each request's ``new_generator`` made from its seed, and
    ``skip_draw`` for the draw another worker made."""

    @staticmethod
    def sample(logits, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]) -> list[int]:
        if not isinstance(logits, torch.Tensor):
            logits = torch.stack(list(logits))
        return sample(logits, params, generators)

    new_generator = staticmethod(make_generator)
    skip_draw = staticmethod(skip_draw)
