"""Where a P/D request's prompt is computed: on a prefill worker (remote) or on its decode worker (local).

A remote prefill runs beside the decode steps instead of between them, but costs a second worker's queue, a KV
transfer and a hop. For a short prompt, or one its decode worker already caches most of, that is more than
the prompt itself: the decode worker computes it between its steps (``xpyd.api.local_prefill``). The proxy
picks the decode worker first, then::

    max_tokens 0 (--local-prefill-max-tokens)                 -> remote (conditional disaggregation off)
    resumed output, echo, prompt logprobs                     -> remote (prefill's part of the answer)
    the prompt's tokens unknown (no tokenizer yet, untokenizable) -> remote
    uncached tokens on that decode worker <= max_tokens        -> local
    otherwise                                                 -> remote

Uncached tokens: the prompt's, less the leading full blocks the proxy's prefix index says the decode worker
holds (its KV events, and the requests routed there lately); at least one (the last prompt token is always
computed: its logits give the first token).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from xpyd.api.openai import CompletionRequest
from xpyd.proxy.prefix_index import PromptKeys

# Off unless asked for: measured on the CPU (docs/benchmarks.md, "Conditional disaggregation"), a 64-token cold
# prompt's first token came no sooner from its decode worker than from a prefill worker (the prompt's compute is
# the TTFT there, the hop and the transfer ~5 ms of it); measure the hardware served on (scripts/bench_local_prefill.py).
DEFAULT_MAX_TOKENS = 0
MAX_TOKENS_LIMIT = 1 << 20


class PrefillPath(str, Enum):
    REMOTE = "remote"  # a prefill worker computes the prompt; decode pulls its KV
    LOCAL = "local"  # the decode worker computes it itself


@dataclass(frozen=True, slots=True)
class PrefillDecider:
    """``max_tokens``: the most uncached prompt tokens a decode worker prefills itself (0: never)."""

    max_tokens: int = DEFAULT_MAX_TOKENS

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or not 0 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise ValueError(f"local_prefill_max_tokens must be in 0..{MAX_TOKENS_LIMIT}, got {self.max_tokens!r}")

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def eligible(self, req: CompletionRequest, resume: tuple[int, ...] = ()) -> bool:
        """Could the request be prefilled on its decode worker at all (its prompt's tokens aside)?"""
        return self.enabled and not resume and not req.echo and req.prompt_scores is None

    def decide(self, req: CompletionRequest, keys: PromptKeys | None, cached_blocks: int,
               resume: tuple[int, ...] = ()) -> PrefillPath:
        """``cached_blocks``: the prompt's leading full blocks the chosen decode worker holds."""
        if keys is None or not self.eligible(req, resume):
            return PrefillPath.REMOTE
        return PrefillPath.LOCAL if uncached_tokens(keys, cached_blocks) <= self.max_tokens else PrefillPath.REMOTE


def uncached_tokens(keys: PromptKeys, cached_blocks: int) -> int:
    """Prompt tokens a worker holding its first ``cached_blocks`` full blocks still computes (at least one)."""
    cached = min(max(cached_blocks, 0), len(keys.hashes)) * keys.block_size
    return max(1, keys.num_tokens - cached)
