"""Raw logprobs of chosen tokens from float32 logits rows (`xpyd.model.logprobs` says what they are).

One function for both torch samplers (CPU and CUDA rows alike) and for the runner's prompt scoring: per row,
one ``log_softmax`` in float32, the chosen token's value, its rank (a count of strictly greater values) and
``torch.topk`` at the batch's largest k, all on the rows' device; then one copy of those few numbers to the
host. ``topk`` orders tied values in no set way, so each row's k alternatives are re-sorted on the host by
(logprob descending, id ascending); a row whose k-th value is tied with an id past its first k (``topk`` may
have kept the higher id) is recomputed exactly from the ids at or above that value.

Prompt positions are scored `PROMPT_SLICE` at a time (`prompt_logprobs`): the logits of a long prompt are
never made whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from xpyd.model.logprobs import TokenLogprob, check_k, check_tokens

__all__ = ["PROMPT_SLICE", "prompt_logprobs", "token_logprobs"]

PROMPT_SLICE = 256  # prompt positions whose logits exist at once while scoring


@torch.inference_mode()
def token_logprobs(rows, tokens: Sequence[int], ks: Sequence[int]) -> list[TokenLogprob]:
    """``rows``: float32 logits [B, vocab] (or a sequence of [vocab] rows) on any device; for row i the
    `TokenLogprob` of tokens[i] with its top ks[i] alternatives (0 <= k <= MAX_LOGPROBS)."""
    tokens, ks = list(tokens), [check_k(k) for k in ks]
    if not isinstance(rows, torch.Tensor):
        rows = list(rows)
        rows = torch.stack(rows) if rows else torch.empty(0, 0)
    if rows.dim() != 2 or rows.shape[0] != len(tokens) or len(ks) != len(tokens):
        raise ValueError(f"logprobs needs rows [B, vocab] with B tokens and ks; got {tuple(rows.shape)}, "
                         f"{len(tokens)}, {len(ks)}")
    if not tokens:
        return []
    vocab = rows.shape[1]
    check_tokens(tokens, vocab)
    ks = [min(k, vocab) for k in ks]
    device = rows.device
    lp = torch.log_softmax(rows.float(), dim=-1)  # [B, vocab]
    chosen = lp.gather(1, torch.tensor(tokens, device=device).unsqueeze(1))  # [B, 1]
    columns = [chosen.double(), ((lp > chosen).sum(-1, keepdim=True) + 1).double()]
    width = max(ks)
    if width:
        values, ids = torch.topk(lp, width, dim=-1)  # sorted, descending; ties in any order
        last = torch.tensor([max(k - 1, 0) for k in ks], device=device).unsqueeze(1)
        at_or_above = (lp >= values.gather(1, last)).sum(-1, keepdim=True)  # == k: the first k are exactly those
        columns += [at_or_above.double(), values.double(), ids.double()]
    host = torch.cat(columns, dim=1).tolist()  # one copy to the host (ids and counts are exact in float64)
    out = []
    for i, (token, k) in enumerate(zip(tokens, ks)):
        row = host[i]
        if k == 0:
            top = ()
        elif int(row[2]) == k:
            top = _ordered(zip((int(t) for t in row[3 + width : 3 + width + k]), row[3 : 3 + k]))
        else:
            top = _tied_top(lp[i], k)
        out.append(TokenLogprob(token=token, logprob=row[0], rank=int(row[1]), top=top))
    return out


def prompt_logprobs(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    targets: Sequence[int], k: int) -> list[TokenLogprob]:
    """``hidden`` [n, ...]: the final hidden states of a part's positions start, start + 1, ... (n >=
    len(targets)); ``logits_of`` turns a slice of them into float32 logits [rows, vocab]. Position
    start + j is scored against targets[j], `PROMPT_SLICE` positions at a time."""
    out: list[TokenLogprob] = []
    for a in range(0, len(targets), PROMPT_SLICE):
        b = min(a + PROMPT_SLICE, len(targets))
        out += token_logprobs(logits_of(hidden[a:b]), targets[a:b], [k] * (b - a))
    return out


def _ordered(pairs) -> tuple[tuple[int, float], ...]:
    return tuple(sorted(pairs, key=lambda p: (-p[1], p[0])))


def _tied_top(lp: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    """The top k of one row [vocab] when its k-th value is shared past the first k: every id above that
    value, then the lowest ids at it."""
    kth = torch.topk(lp, k).values[-1]
    above = torch.nonzero(lp > kth).squeeze(1)
    tied = torch.nonzero(lp == kth).squeeze(1)[: k - above.numel()]
    ids = torch.cat((above, tied))
    return _ordered(zip(ids.tolist(), lp[ids].tolist()))
