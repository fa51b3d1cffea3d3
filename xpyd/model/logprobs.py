"""Log-probabilities of chosen tokens, as OpenAI's and vLLM's ``logprobs`` and ``prompt_logprobs`` report them.

As vLLM's default (``logprobs_mode="raw_logprobs"``), a token's logprob is the ``log_softmax`` of the model's
raw logits (float32, before penalties, ``logit_bias``, temperature, top-k/top-p); its rank is 1 + the number
of vocabulary ids with a strictly greater logprob; the top alternatives are the k most likely ids,
descending, ties broken by the lower id.

Each runner's sampler computes them for rows the runner returned (``sampler.logprobs(rows, tokens, ks)``), and
each runner scores prompt positions during a prefill (``runner.prefill_scored(parts, scores)``): ``scores[i]``
None, or ``(targets, k)`` with targets[j] the token that follows position start + j of part i. The torch
computation is `xpyd.model.logprobs_torch`; the simulated one is `xpyd.model.sim.sampler`. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MAX_LOGPROBS", "ScoreSpec", "TokenLogprob", "check_k", "check_scores", "check_tokens"]

MAX_LOGPROBS = 20  # the most top alternatives a request may ask (vLLM's default max_logprobs)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: int  # the chosen token id (sampled, or the prompt's next token)
    logprob: float  # its raw log-probability (may be -inf)
    rank: int  # 1 + ids with a strictly greater logprob
    # the k most likely (id, logprob), descending (ties: lower id first); () when k == 0
    top: tuple[tuple[int, float], ...]


ScoreSpec = tuple[Sequence[int], int]  # (targets, k): what `prefill_scored` scores of one part


def check_k(k: object) -> int:
    """``k`` as the number of top alternatives a request may ask: an int in [0, MAX_LOGPROBS]."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS:
        raise ValueError(f"the number of top logprobs must be an int in [0, {MAX_LOGPROBS}], got {k!r}")
    return k


def check_tokens(tokens: Sequence[object], vocab_size: int) -> list[int]:
    """``tokens`` as vocabulary ids (ints in [0, vocab_size))."""
    out = list(tokens)
    for t in out:
        if type(t) is not int or not 0 <= t < vocab_size:
            raise ValueError(f"token id {t!r} outside the vocabulary [0, {vocab_size})")
    return out


def check_scores(parts: Sequence[tuple[Sequence[int], Sequence[int], int]],
                 scores: Sequence[ScoreSpec | None], vocab_size: int) -> list[tuple[list[int], int] | None]:
    """The scores of a `prefill_scored` call, checked against its parts before anything runs: one entry per
    part, None or (targets, k) with targets vocabulary ids, at most len(token_ids) - start of them (a part
    scores only its own new positions), and k as `check_k`."""
    if len(scores) != len(parts):
        raise ValueError(f"prefill_scored needs one score entry per part; got {len(scores)} for {len(parts)} parts")
    out: list[tuple[list[int], int] | None] = []
    for (_, token_ids, start), spec in zip(parts, scores):
        if spec is None:
            out.append(None)
            continue
        if not isinstance(spec, (tuple, list)) or len(spec) != 2:
            raise ValueError(f"a score entry is None or (targets, k), got {spec!r}")
        targets, k = check_tokens(spec[0], vocab_size), check_k(spec[1])
        new = len(token_ids) - start if isinstance(start, int) and not isinstance(start, bool) else 0
        if len(targets) > new:
            raise ValueError(f"{len(targets)} targets for a part of {new} new positions (from {start!r} of "
                             f"{len(token_ids)} tokens)")
        out.append((targets, k))
    return out
