"""The simulated engine's sampling: a token from the digest of the sequence so far (and a draw when sampling).

A row (what `SimRunner.prefill`/`decode` return per request) is the 8-byte digest of the request's last
token (`records`). Greedy: token = allowed[int(digest) % len(allowed)]. Temperature > 0: exactly one draw per
sampled token from the request's generator, token = allowed[int(blake2b(digest || draw)) % len(allowed)] (top_k
= 1 gives the greedy token, after its draw). ``allowed`` is the vocabulary without the end-of-sequence ids: a
simulated request ends by max_tokens or a stop string, never by EOS.

Parameters that are not ``plain`` (penalties, ``logit_bias``, ``min_tokens``, ``min_p``) get a small logit space
of their own, with the same meaning as on the real engine (``xpyd.model.sampling_params``): the candidates are
the greedy token above and CANDIDATES - 1 more, ``allowed[blake2b(digest || i) % len(allowed)]`` for i = 1..,
with logits 0, -1, -2, ... (a token named twice keeps its first); every other token's logit is -CANDIDATES (it
joins the candidates when ``logit_bias`` names it, or when it was generated and a penalty is set). The
adjustments are applied to those logits in vLLM's order; greedy takes the first best one; sampling takes
one draw u (its 64 bits / 2**64) and picks from the softmax after temperature, min_p, top-k and top-p
(candidates ordered by logit, then by their order above) where the cdf passes u.

Logprobs (``logprobs``: `xpyd.model.logprobs`) are those of the raw logits, what ``logits`` gives with plain
parameters: the candidates at 0, -1, -2, ... and every other vocabulary id (EOS ids included) at -CANDIDATES,
normalised over the whole vocabulary. Their top alternatives are the candidates by logit, then the other ids in
increasing id order (all tied).

One draw per sampled token is the contract of the real sampler too (`xpyd.model.sampling`): the prefill worker
samples the first token, the decode worker makes a generator from the same seed, `skip_draw`s once and
continues the same stream, so seeded sampling across P/D equals colocated.
"""

from __future__ import annotations

import bisect
import math
import os
import random
from hashlib import blake2b
from typing import Iterable, Sequence

from xpyd.model.logprobs import TokenLogprob, check_k, check_tokens
from xpyd.model.sampling_params import SamplingParams, TokenHistory

__all__ = ["CANDIDATES", "SimGenerator", "SimSampler"]

CANDIDATES = 8
_RAW = SamplingParams()  # plain parameters: ``logits`` gives the raw logits


class SimGenerator:
    """A request's random state: 64-bit draws from ``random.Random(seed)`` (a random seed without one)."""

    __slots__ = ("_random",)

    def __init__(self, seed: int | None) -> None:
        self._random = random.Random(int.from_bytes(os.urandom(8), "little") if seed is None else seed)

    def draw(self) -> bytes:
        return self._random.getrandbits(64).to_bytes(8, "little")


class SimSampler:
    """Rows (digests) -> tokens, as the role engines ask a runner's ``sampler``."""

    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._eos = sorted({e for e in eos_token_ids if 0 <= e < vocab_size})
        self._allowed = vocab_size - len(self._eos)
        if self._allowed < 1:
            raise ValueError("the vocabulary has no token besides end-of-sequence")

    def sample(self, rows: Sequence[bytes], params: Sequence[SamplingParams],
               generators: Sequence[SimGenerator | None],
               histories: Sequence[TokenHistory | None] | None = None,
               masks: Sequence[bytes | None] | None = None) -> list[int]:
        if not len(rows) == len(params) == len(generators):
            raise ValueError(f"sample needs as many rows, params and generators; got {len(rows)}, {len(params)}, "
                             f"{len(generators)}")
        if histories is not None and len(histories) != len(rows):
            raise ValueError(f"sample needs one history per row; got {len(histories)} for {len(rows)} rows")
        if masks is not None and len(masks) != len(rows):
            raise ValueError(f"sample needs one mask (or None) per row; got {len(masks)} for {len(rows)} rows")
        out = []
        for i, (row, p, g) in enumerate(zip(rows, params, generators)):
            history = histories[i] if histories is not None else None
            if masks is not None and masks[i] is not None:
                out.append(self._constrained(bytes(row), p, g, history, masks[i]))
            else:
                out.append(self._one(bytes(row), p, g) if p.plain else self._adjusted(bytes(row), p, g, history))
        return out

    def _constrained(self, digest: bytes, params: SamplingParams, generator: SimGenerator | None,
                     history: TokenHistory | None, mask: bytes) -> int:
        """Under a grammar mask: the best allowed candidate (greedy), or one of the allowed candidates picked by
        the draw; when no candidate is allowed, one of the mask's tokens (end-of-sequence ids included: a
        finished grammar allows only them), picked by the digest (greedy) or the draw. One draw when sampling."""
        from xpyd.model.grammar import mask_allows, mask_tokens  # (llguidance: loaded by the first grammar)

        logits = self.logits(digest, params, history)
        order = [t for t in sorted(logits, key=lambda t: -logits[t]) if logits[t] > -math.inf]
        allowed = [t for t in order if mask_allows(mask, t)]
        key = int.from_bytes(digest, "little")
        if not params.greedy:
            key = int.from_bytes(blake2b(digest + self._draw(generator), digest_size=8).digest(), "little")
        if allowed:
            return allowed[0] if params.greedy else allowed[key % len(allowed)]
        tokens = [t for t in mask_tokens(mask) if t < self.vocab_size]
        if not tokens:
            raise ValueError("a grammar mask allows no token")
        return tokens[key % len(tokens)]

    def logprobs(self, rows: Sequence[bytes], tokens: Sequence[int], ks: Sequence[int]) -> list[TokenLogprob]:
        """For row i (a digest), the raw logprob, rank and top ks[i] alternatives of tokens[i] (module docstring)."""
        tokens, ks = check_tokens(tokens, self.vocab_size), [check_k(k) for k in ks]
        if not len(rows) == len(tokens) == len(ks):
            raise ValueError(f"logprobs needs as many rows, tokens and ks; got {len(rows)}, {len(tokens)}, {len(ks)}")
        return [self._logprob(bytes(row), token, k) for row, token, k in zip(rows, tokens, ks)]

    def _logprob(self, digest: bytes, token: int, k: int) -> TokenLogprob:
        candidates = self.logits(digest, _RAW, None)  # distinct logits 0 > -1 > ... > -(CANDIDATES - 1)
        floor = -float(CANDIDATES)
        others = self.vocab_size - len(candidates)  # every one at the floor
        norm = math.log(math.fsum(math.exp(v) for v in candidates.values()) + others * math.exp(floor))
        value = candidates.get(token, floor)
        rank = 1 + sum(1 for v in candidates.values() if v > value)
        top = [(t, v - norm) for t, v in sorted(candidates.items(), key=lambda p: -p[1])[:k]]
        tied = 0
        while len(top) < k and tied < self.vocab_size:  # then the floor's ids, lowest first
            if tied not in candidates:
                top.append((tied, floor - norm))
            tied += 1
        return TokenLogprob(token=token, logprob=value - norm, rank=rank, top=tuple(top))

    @staticmethod
    def new_generator(seed: int | None) -> SimGenerator:
        return SimGenerator(seed)

    @staticmethod
    def skip_draw(generator: SimGenerator) -> None:
        """Consume the one draw another worker made for the first token."""
        generator.draw()

    def _one(self, digest: bytes, params: SamplingParams, generator: SimGenerator | None) -> int:
        if len(digest) != 8:
            raise ValueError(f"a simulated row is an 8-byte digest, got {len(digest)} bytes")
        if params.greedy:
            return self._token(int.from_bytes(digest, "little"))
        if generator is None:
            raise ValueError("sampling with temperature > 0 needs the request's generator")
        draw = generator.draw()
        if params.top_k == 1:
            return self._token(int.from_bytes(digest, "little"))
        return self._token(int.from_bytes(blake2b(digest + draw, digest_size=8).digest(), "little"))

    def logits(self, digest: bytes, params: SamplingParams, history: TokenHistory | None) -> dict[int, float]:
        """The candidates' logits after min_tokens, logit_bias and the penalties (insertion order: the
        candidates', then biased ids', then generated ids'); every token not in it has -CANDIDATES."""
        if len(digest) != 8:
            raise ValueError(f"a simulated row is an 8-byte digest, got {len(digest)} bytes")
        floor = -float(CANDIDATES)
        logits: dict[int, float] = {self._token(int.from_bytes(digest, "little")): 0.0}
        for i in range(1, CANDIDATES):
            token = self._token(int.from_bytes(blake2b(digest + bytes([i]), digest_size=8).digest(), "little"))
            logits.setdefault(token, -float(i))
        eos = set(self._eos)  # (a simulated request never ends by EOS: EOS ids never become candidates)
        for token, bias in params.logit_bias:
            if token not in eos and token < self.vocab_size:
                logits[token] = logits.get(token, floor) + bias
        if params.penalized or (params.min_tokens and params.min_tokens_ids):
            if history is None:
                raise ValueError("penalties and min_tokens need the request's token history")
        if params.penalized:
            for token in history.counts:
                if token not in eos:
                    logits.setdefault(token, floor)
            prompt, rp = history.prompt_ids, params.repetition_penalty
            for token, value in logits.items():
                count = history.counts.get(token, 0)
                if rp != 1.0 and (count or _contains(prompt, token)):
                    value = value / rp if value > 0 else value * rp
                logits[token] = value - params.frequency_penalty * count - (params.presence_penalty if count else 0.0)
        if params.min_tokens and history.below_min_tokens(params):
            for token in params.min_tokens_ids:
                if token in logits:
                    logits[token] = -math.inf
        return logits

    @property
    def vocab_size(self) -> int:
        return self._allowed + len(self._eos)

    def _adjusted(self, digest: bytes, params: SamplingParams, generator: SimGenerator | None,
                  history: TokenHistory | None) -> int:
        logits = self.logits(digest, params, history)
        order = sorted(logits, key=lambda t: -logits[t])  # (stable: ties keep the candidates' order)
        if params.greedy or all(logits[t] == -math.inf for t in order[1:]):
            if not params.greedy:
                self._draw(generator)
            return order[0]
        u = int.from_bytes(self._draw(generator), "little") / 2**64
        scores = [logits[t] / params.temperature for t in order]
        top = scores[0]
        weights = [math.exp(s - top) for s in scores]
        if params.min_p > 0:  # relative to the most likely candidate (weight 1)
            weights = [w if w >= params.min_p else 0.0 for w in weights]
        if 0 < params.top_k < len(weights):
            weights[params.top_k:] = [0.0] * (len(weights) - params.top_k)
        total = sum(weights)
        if params.top_p < 1:
            kept, before = [], 0.0
            for w in weights:
                kept.append(w if before < params.top_p * total else 0.0)
                before += w
            weights, total = kept, sum(kept)
        cdf = 0.0
        for token, w in zip(order, weights):
            cdf += w
            if w and u * total < cdf:
                return token
        return next(t for t, w in zip(reversed(order), reversed(weights)) if w)

    @staticmethod
    def _draw(generator: SimGenerator | None) -> bytes:
        if generator is None:
            raise ValueError("sampling with temperature > 0 needs the request's generator")
        return generator.draw()

    def _token(self, value: int) -> int:
        """The (value % allowed)-th token id that is not an end-of-sequence id."""
        index = token = value % self._allowed
        # The answer is index + (eos ids at or below it): the least fixed point, reached from below.
        while True:
            shifted = index + bisect.bisect_right(self._eos, token)
            if shifted == token:
                return token
            token = shifted


def _contains(sorted_ids: tuple[int, ...], token: int) -> bool:
    i = bisect.bisect_left(sorted_ids, token)
    return i < len(sorted_ids) and sorted_ids[i] == token
