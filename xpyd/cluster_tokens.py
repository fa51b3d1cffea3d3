"""What every receiver of a cluster token's proof checks about the tokens it accepts besides its own.

During a token rotation a worker accepts a second token (`--cluster-token-accept`) wherever its own is checked:
the signal plane's handshake, request-id signatures and bearers, KV transfer MACs. An accepted token is never
"no token": a None among them would make the key of an empty token valid, which any sender holding no token at
all can compute.
"""

from __future__ import annotations


def check_accepted_tokens(tokens: object) -> tuple[str, ...]:
    """``tokens`` as a tuple, each a non-empty str; anything else (None among them, bytes, one bare str) raises."""
    if not isinstance(tokens, (tuple, list)) or not all(isinstance(t, str) and t for t in tokens):
        raise ValueError("accepted tokens must be a sequence of non-empty str (never None: that is no token)")
    return tuple(tokens)
