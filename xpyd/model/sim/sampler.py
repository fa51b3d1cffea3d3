"""The simulated engine's sampling: a token from the digest of the sequence so far (and a draw when sampling).

A row (what `SimRunner.prefill`/`decode` return per request) is the 8-byte digest of the request's last
token (`records`). Greedy: token = allowed[int(digest) % len(allowed)]. Temperature > 0: exactly one draw per
sampled token from the request's generator, token = allowed[int(blake2b(digest || draw)) % len(allowed)] (top_k
= 1 gives the greedy token, after its draw). ``allowed`` is the vocabulary without the end-of-sequence ids: a
simulated request ends by max_tokens or a stop string, never by EOS.

One draw per sampled token is the contract of the real sampler too (`xpyd.model.sampling`): the prefill worker
samples the first token, the decode worker makes a generator from the same seed, `skip_draw`s once and
continues the same stream, so seeded sampling across P/D equals colocated.
"""

from __future__ import annotations

import bisect
import os
import random
from hashlib import blake2b
from typing import Iterable, Sequence

from xpyd.model.sampling_params import SamplingParams

__all__ = ["SimGenerator", "SimSampler"]


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
               generators: Sequence[SimGenerator | None]) -> list[int]:
        if not len(rows) == len(params) == len(generators):
            raise ValueError(f"sample needs as many rows, params and generators; got {len(rows)}, {len(params)}, "
                             f"{len(generators)}")
        return [self._one(bytes(row), p, g) for row, p, g in zip(rows, params, generators)]

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

    def _token(self, value: int) -> int:
        """The (value % allowed)-th token id that is not an end-of-sequence id."""
        index = token = value % self._allowed
        # The answer is index + (eos ids at or below it): the least fixed point, reached from below.
        while True:
            shifted = index + bisect.bisect_right(self._eos, token)
            if shifted == token:
                return token
            token = shifted
