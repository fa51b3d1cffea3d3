"""Token sampling: greedy, or temperature / top-k / top-p with exactly one random draw per token.

One draw per sampled token is the contract that lets a seeded request cross workers: the prefill
worker samples the first token (one draw), the decode worker makes a generator from the same seed,
calls `skip_draw` once, and continues the very same random stream from the second token on.
Greedy (temperature 0, or below 1e-5 as in vLLM) never draws.

A row whose parameters are not ``plain`` (penalties, ``logit_bias``, ``min_tokens``, ``min_p``: see
``xpyd.model.sampling_params``) is adjusted first, in float32, from the request's ``TokenHistory``; a plain row
is sampled from its logits as they are, at no extra cost.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from xpyd.model.logprobs_torch import token_logprobs
from xpyd.model.sampling_params import GREEDY_BELOW, SamplingParams, TokenHistory

__all__ = ["GREEDY_BELOW", "SamplingParams", "TorchSampler", "adjust_logits", "make_generator", "sample",
           "skip_draw"]


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
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
    histories: Sequence[TokenHistory | None] | None = None, masks: Sequence[bytes | None] | None = None,
) -> list[int]:
    """logits [B, vocab] -> one token id per row; ``histories``: each row's token history (needed by the rows
    whose parameters are not plain; None for the others); ``masks``: each row's grammar mask
    (`xpyd.model.grammar`; None: unconstrained), applied to a copy after the other adjustments. A row the
    adjustments and its mask leave no token (min_tokens banning the end-of-sequence a finished grammar allows
    alone) picks among the mask's tokens as if their logits were equal: the grammar wins."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(
            f"sample needs logits [B, vocab] with B params and generators; "
            f"got {tuple(logits.shape)}, {len(params)}, {len(generators)}"
        )
    if histories is not None and len(histories) != len(params):
        raise ValueError(f"sample needs one history per row; got {len(histories)} for {len(params)} rows")
    if masks is not None and len(masks) != len(params):
        raise ValueError(f"sample needs one mask (or None) per row; got {len(masks)} for {len(params)} rows")
    out = []
    for i, (p, g) in enumerate(zip(params, generators)):
        row = logits[i]
        if not p.plain:
            row = adjust_logits(row, p, histories[i] if histories is not None else None)
        mask = masks[i] if masks is not None else None
        if mask is not None:
            row = _masked(row if not p.plain else row.to(torch.float32, copy=True), mask)
        out.append(_sample_row(row, p, g))
    return out


def _masked(row: torch.Tensor, mask: bytes) -> torch.Tensor:
    from xpyd.model.grammar_torch import apply_mask

    apply_mask(row, mask)
    if bool(torch.isneginf(row).all()):  # nothing left: the mask's tokens, alike
        row = apply_mask(torch.zeros_like(row), mask)
    return row


def adjust_logits(row: torch.Tensor, params: SamplingParams, history: TokenHistory | None) -> torch.Tensor:
    """A float32 copy of one [vocab] row with min_tokens, logit_bias and the penalties applied (the module
    docstring of ``xpyd.model.sampling_params`` gives the order); ids past the row's width are left out."""
    row = row.to(torch.float32, copy=True)
    vocab = row.numel()
    device = row.device
    if params.min_tokens_ids and params.min_tokens:
        if history is None:
            raise ValueError("min_tokens needs the request's token history")
        if history.below_min_tokens(params):
            row[_ids([t for t in params.min_tokens_ids if t < vocab], device)] = float("-inf")
    if params.logit_bias:
        pairs = [(t, b) for t, b in params.logit_bias if t < vocab]
        row[_ids([t for t, _ in pairs], device)] += torch.tensor([b for _, b in pairs], dtype=torch.float32,
                                                                 device=device)
    if not params.penalized:
        return row
    if history is None:
        raise ValueError("penalties need the request's token history")
    out_ids = [t for t in history.counts if t < vocab]
    if params.repetition_penalty != 1.0:
        prompt = history.memo
        if prompt is None:  # the prompt's distinct ids, made once per request
            prompt = history.memo = _ids([t for t in history.prompt_ids if t < vocab], device)
        seen = torch.unique(torch.cat((prompt, _ids(out_ids, device)))) if out_ids else prompt
        values = row[seen]
        rp = params.repetition_penalty
        row[seen] = torch.where(values > 0, values / rp, values * rp)
    if out_ids and (params.frequency_penalty or params.presence_penalty):
        counts = torch.tensor([history.counts[t] for t in out_ids], dtype=torch.float32, device=device)
        row[_ids(out_ids, device)] -= params.frequency_penalty * counts + params.presence_penalty
    return row


def _ids(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64, device=device)


def _sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits.float() / params.temperature
    if params.min_p > 0:  # vLLM's min_p: after the temperature, relative to the most likely token
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
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
    tensor, or a list of [vocab] rows), each request's ``new_generator`` made from its seed,
    ``skip_draw`` for the draw another worker made, and ``logprobs`` of chosen tokens from the raw rows
    (`xpyd.model.logprobs_torch.token_logprobs`)."""

    @staticmethod
    def sample(logits, params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
               histories: Sequence[TokenHistory | None] | None = None,
               masks: Sequence[bytes | None] | None = None) -> list[int]:
        if not isinstance(logits, torch.Tensor):
            logits = torch.stack(list(logits))
        return sample(logits, params, generators, histories, masks)

    new_generator = staticmethod(make_generator)
    skip_draw = staticmethod(skip_draw)
    logprobs = staticmethod(token_logprobs)
