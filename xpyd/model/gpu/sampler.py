"""Sampling on the logits' own device, with the CPU sampler's one-draw-per-token contract.

`DeviceSampler` offers what `xpyd.model.sampling.TorchSampler` offers the role engines (``sample``,
``new_generator``, ``skip_draw``) and picks the same tokens: greedy rows take the argmax of the raw
logits and never draw; the others divide by their temperature, keep the top-k (sorted, descending), then
the smallest head of that whose mass reaches top-p (at least one token), and search the cdf with the one
draw ``u`` from the request's own CPU ``torch.Generator`` (so a seeded request continues one random
stream across the prefill and decode workers).

One step, for B rows on device D:

1. host: one ``torch.rand(())`` per non-greedy row from its generator, in row order, packed with the
   rows' temperature, top-k, top-p and kind (greedy, plain) into one float32 [6, B] host tensor (pinned
   when D is CUDA);
2. one non-blocking host -> device copy of that tensor;
3. on D, batched over the rows: scores, one top-k (or full sort) at the batch's largest k, per-row masks
   for k and top-p, softmax, cdf, ``searchsorted``, greedy argmax, a ``where`` per row kind;
4. ``sample`` only: one device -> host copy of the B int64 ids, the step's only synchronisation.

A batch with a row whose parameters are not plain (penalties, ``logit_bias``, ``min_tokens``, ``min_p``) is
sampled by the CPU sampler instead (``xpyd.model.sampling.sample``, the logits copied to the host; the ids
uploaded back for ``sample_device``): the same tokens as on a CPU worker, at the cost of that copy.

``sample_device`` stops after 3 and returns the ids on D. Its device part has no ``.item()`` and no
branch on tensor values: the Python branches read only the parameters (host values), so the work for one
parameter mix can be captured in a CUDA graph with the uploaded [6, B] tensor as its input
(`sample_from_draws`).

The batched cdf is summed in another order than the per-row one (softmax over masked positions, a
float64 scan), so a draw within rounding of a cdf boundary may land in the neighbouring token;
tests/unit/test_device_sampler.py bounds that distance and asserts equality for every draw farther away.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from xpyd.model.logprobs_torch import token_logprobs
from xpyd.model.sampling import make_generator, sample, skip_draw
from xpyd.model.sampling_params import SamplingParams, TokenHistory

__all__ = ["DeviceSampler", "draw_rows", "sample_from_draws"]

# The rows of the uploaded [6, B] tensor: 1.0/0.0 flags for the kind of each row.
_U, _TEMPERATURE, _TOP_K, _TOP_P, _GREEDY, _PLAIN = range(6)


def _top_k_active(params: SamplingParams, vocab: int) -> bool:
    return 0 < params.top_k < vocab


def draw_rows(
    params: Sequence[SamplingParams], generators: Sequence[torch.Generator], vocab: int, pin: bool
) -> torch.Tensor:
    """Host float32 [6, B]: each row's draw (0 for greedy rows, which do not draw), temperature (1 for
    greedy rows), effective top-k (``vocab`` when off; exact in float32 below 2**24), top-p, and flags:
    greedy, plain (samples without top-k or top-p). Draws are taken in row order, one per non-greedy
    row, exactly as the CPU sampler takes them."""
    columns = []
    for p, g in zip(params, generators):
        if p.greedy:
            columns.append((0.0, 1.0, float(vocab), 1.0, 1.0, 0.0))
        else:
            u = float(torch.rand((), generator=g))  # the one draw; float32 -> float -> float32 is exact
            k = p.top_k if _top_k_active(p, vocab) else vocab
            columns.append((u, float(p.temperature), float(k), float(p.top_p), 0.0, float(_plain_row(p, vocab))))
    return torch.tensor(list(zip(*columns)), dtype=torch.float32, pin_memory=pin)


def _plain_row(params: SamplingParams, vocab: int) -> bool:
    return not params.greedy and not _top_k_active(params, vocab) and params.top_p >= 1


def sample_from_draws(
    logits: torch.Tensor, params: Sequence[SamplingParams], rows: torch.Tensor
) -> torch.Tensor:
    """Token ids int64 [B] on ``logits.device`` from ``rows`` (`draw_rows`, already on that device). Only
    ``params`` (host values) choose which kernels run; nothing here reads a device value."""
    batch, vocab = logits.shape
    greedy = [p.greedy for p in params]
    if all(greedy):
        return torch.argmax(logits, dim=-1)
    u, temperature = rows[_U], rows[_TEMPERATURE]
    scores = logits.float() / temperature[:, None]  # per-row float32 divide, as the CPU's logits / T
    plain = [_plain_row(p, vocab) for p in params]
    truncated = [not (g or pl) for g, pl in zip(greedy, plain)]
    if any(truncated):
        full = any(p.top_p < 1 and not _top_k_active(p, vocab) for p, t in zip(params, truncated) if t)
        width = vocab if full else max(p.top_k for p, t in zip(params, truncated) if t)
        chosen = _truncated(scores, u, rows[_TOP_K], rows[_TOP_P], width)
        if any(plain):
            chosen = torch.where(rows[_PLAIN] > 0, _plain(scores, u), chosen)
    else:
        chosen = _plain(scores, u)
    if any(greedy):
        chosen = torch.where(rows[_GREEDY] > 0, torch.argmax(logits, dim=-1), chosen)
    return chosen


def _cumsum(probs: torch.Tensor) -> torch.Tensor:
    """Prefix sums in float64: CUDA's row scan would carry a float32 running total across thousands of
    chunks of a 128k vocabulary; the CPU sampler's (double accumulation, rounded once) is matched to
    within a float32 rounding."""
    return torch.cumsum(probs, dim=-1, dtype=torch.float64)


def _search(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index [B] where each row's draw lands in its cdf, as the CPU sampler. u < 1 keeps u * cdf[-1] below
    cdf[-1], so the index never reaches the zero-probability tail (masked k, cut top-p); the clamp is the
    CPU sampler's, for the last column."""
    cdf = _cumsum(probs)
    j = torch.searchsorted(cdf, u[:, None].double() * cdf[:, -1:], right=True).squeeze(1)
    return j.clamp(max=probs.shape[1] - 1)


def _plain(scores: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Rows without top-k or top-p: the cdf in vocabulary order."""
    return _search(torch.softmax(scores, dim=-1), u)


def _truncated(
    scores: torch.Tensor, u: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, width: int
) -> torch.Tensor:
    """Rows with top-k and/or top-p: sorted descending, the first ``top_k`` kept, then the head that
    reaches ``top_p``; ``width`` (a host value) is the batch's largest k, or the vocabulary."""
    if width < scores.shape[1]:
        values, ids = torch.topk(scores, width, dim=-1)  # sorted, descending
    else:
        values, ids = torch.sort(scores, dim=-1, descending=True)
    k = top_k.to(torch.int64).clamp(max=width)  # rows without top-k (plain, greedy) keep the width
    position = torch.arange(width, device=scores.device)
    values = values.masked_fill(position >= k[:, None], float("-inf"))
    probs = torch.softmax(values, dim=-1)
    before = _cumsum(probs) - probs
    cut = torch.where(top_p < 1, top_p, torch.full_like(top_p, float("inf")))  # top-p off: nothing cut
    probs = probs.masked_fill(before >= cut[:, None], 0.0)
    j = _search(probs, u)
    return ids.gather(1, j[:, None]).squeeze(1)


class DeviceSampler:
    """Sampling as a runner offers it to the role engines, on the logits' device: ``sample`` one token
    per logits row (a [B, vocab] tensor, or a list of [vocab] rows) with one device -> host copy of the
    ids; ``sample_device`` keeps them on the device; ``new_generator``, ``skip_draw`` and ``logprobs`` as the
    CPU's (``logprobs`` computes on the device and copies only its few numbers to the host)."""

    new_generator = staticmethod(make_generator)
    skip_draw = staticmethod(skip_draw)
    logprobs = staticmethod(token_logprobs)

    @staticmethod
    def sample_device(
        logits, params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
        histories: Sequence[TokenHistory | None] | None = None,
    ) -> torch.Tensor:
        """Token ids int64 [B] on the logits' device; nothing waits for the device (unless a row is not
        plain: then the CPU sampler picks the batch's ids)."""
        if not isinstance(logits, torch.Tensor):
            logits = torch.stack(list(logits))
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError(
                f"sample needs logits [B, vocab] with B params and generators; "
                f"got {tuple(logits.shape)}, {len(params)}, {len(generators)}"
            )
        if not all(p.plain for p in params):
            ids = sample(logits.float().cpu(), params, generators, histories)
            return torch.tensor(ids, dtype=torch.int64).to(logits.device)
        if all(p.greedy for p in params):  # nothing to draw, nothing to upload
            return torch.argmax(logits, dim=-1)
        on_cuda = logits.device.type == "cuda"
        host = draw_rows(params, generators, logits.shape[1], pin=on_cuda)
        rows = host.to(logits.device, non_blocking=True)
        return sample_from_draws(logits, params, rows)

    @classmethod
    def sample(
        cls, logits, params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
        histories: Sequence[TokenHistory | None] | None = None, masks: Sequence[bytes | None] | None = None,
    ) -> list[int]:
        if masks is not None and any(m is not None for m in masks):  # (grammar rows: the CPU sampler's path)
            if not isinstance(logits, torch.Tensor):
                logits = torch.stack(list(logits))
            return sample(logits.float().cpu(), params, generators, histories, masks)
        return cls.sample_device(logits, params, generators, histories).cpu().tolist()
