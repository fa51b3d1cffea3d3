"""A request's sampling parameters, validated, and the token history its penalties read (no torch: every
engine's requests carry them).

vLLM's semantics (``vllm/sampling_params.py``, its v1 sampler): the logits of a request are adjusted, in float32,
in this order before a token is picked:

1. ``min_tokens``: while fewer than ``min_tokens`` tokens were generated, the ids in ``min_tokens_ids`` (the
   end-of-sequence ids and ``stop_token_ids``) get -inf;
2. ``logit_bias``: each named id's logit += its bias;
3. ``repetition_penalty`` over every id in the prompt or the output so far (a positive logit divided by it,
   any other multiplied), then ``frequency_penalty`` * (times an id was generated) and ``presence_penalty``
   (once per generated id) subtracted: output tokens only;

then greedy takes the argmax; sampling divides by the temperature, drops the tokens whose probability is under
``min_p`` times the most likely one's, and goes on with top-k and top-p as before.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

_MAX_SEED = 2**64
GREEDY_BELOW = 1e-5  # temperatures under this are greedy (1/T would overflow float32 scores)
MAX_LOGIT_BIAS = 100.0  # vLLM clamps every bias to [-100, 100]


def _number(name: str, value: object) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _token_id(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must hold token ids (ints >= 0), got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    min_p: float = 0.0  # 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    min_tokens: int = 0
    min_tokens_ids: frozenset[int] = frozenset()  # masked while fewer than min_tokens were generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids distinct
    plain: bool = field(init=False, default=True)  # none of min_p, penalties, min_tokens, logit_bias: raw logits

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
        if not 0 <= _number("min_p", self.min_p) <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= _number(name, getattr(self, name)) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not _number("repetition_penalty", self.repetition_penalty) > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        object.__setattr__(self, "min_tokens_ids",
                           frozenset(_token_id("min_tokens_ids", t) for t in self.min_tokens_ids))
        bias = tuple((_token_id("logit_bias", t), _number("logit_bias", b)) for t, b in self.logit_bias)
        if len({t for t, _ in bias}) != len(bias):
            raise ValueError("logit_bias names a token id twice")
        bias = tuple((t, min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, b))) for t, b in bias)
        object.__setattr__(self, "logit_bias", bias)
        object.__setattr__(self, "plain", not (self.min_p or self.penalized or bias
                                               or (self.min_tokens and self.min_tokens_ids)))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW  # as vLLM: a tiny temperature would overflow the scores

    @property
    def penalized(self) -> bool:
        """A presence, frequency or repetition penalty is set (the history of tokens matters)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def needs_prompt(self) -> bool:
        """The prompt's tokens change the logits (the repetition penalty reads them)."""
        return self.repetition_penalty != 1.0


class TokenHistory:
    """What a request's penalties read: the distinct prompt ids (only with a repetition penalty), how often
    each id was generated, and how many tokens were. ``sync`` reads the ids appended to ``output`` (the
    output processor's list of generated ids: the first one too, whichever worker sampled it) since the last
    call, so a step costs O(new tokens). ``memo``: the sampler's own per-request cache (e.g. the prompt's
    ids as a tensor)."""

    __slots__ = ("prompt_ids", "counts", "n_output", "memo", "_output")

    def __init__(self, prompt_ids: Iterable[int], output: Sequence[int]) -> None:
        self.prompt_ids: tuple[int, ...] = tuple(sorted(set(prompt_ids)))
        self.counts: dict[int, int] = {}
        self.n_output = 0
        self.memo: object = None
        self._output = output

    def sync(self) -> TokenHistory:
        output, counts = self._output, self.counts
        for token in output[self.n_output:]:
            counts[token] = counts.get(token, 0) + 1
        self.n_output = len(output)
        return self

    def below_min_tokens(self, params: SamplingParams) -> bool:
        return self.n_output < params.min_tokens
