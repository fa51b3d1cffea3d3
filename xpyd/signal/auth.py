"""Who may join the signal plane: peers prove they hold the cluster token, which is never sent.

Mutual challenge-response, once per connection (decode D dials prefill P)::

    D -> P  hello(sender, instance, nonce_d, token?)     what D is: its signal address, its process
    P -> D  challenge(nonce_p, proof_p)                   proof_p = HMAC(token, "xpyd-signal-p" | nonce_d | nonce_p | H)
    D -> P  proof(proof_d)                                proof_d = HMAC(token, "xpyd-signal-d" | nonce_p | nonce_d | H)
    P -> D  auth_reply(ok)                                the session is open

``H`` is SHA-256 of the hello frame as sent (protocol version, sender, instance, nonce_d), so the proofs
vouch for what D said it is. Each side checks the other's proof (constant time) before it says anything
more: D sends its proof only after P proved the token, P serves nothing but a hello and a proof before D
proved it. Both nonces are fresh random 32 bytes, so a recorded exchange proves nothing later (P's new
nonce_p makes a replayed proof_d wrong), the two labels keep a proof from being reflected back as the
other side's, and a passive observer learns two nonces and two HMACs: nothing that opens a session
without the token (guessing it offline from them is as hard as the token is; the worker config asks for 8
characters or more: use a long random one).

A rotation window: a worker may also accept a second token (``--cluster-token-accept``). It proves only
with its own (the primary) and checks the peer's proof against each token it holds, so a pair whose
primaries differ opens a session as long as each holds the other's token; ``check_proof`` says which token
the peer proved (the decode side needs it to check the peer's block hashes, keyed with that token).

Without a cluster token on either side there is nothing to prove: both proofs are ``None`` and the
exchange only opens the session. A token on one side only is refused with a message that says which
side lacks it (the transfers are keyed with the token too, so such a pair could not move a byte).

What the session is bound to, and why later messages carry no MAC: see ``xpyd.signal.server``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence

NONCE_BYTES = 32
PROOF_BYTES = 32  # HMAC-SHA256
_PREFILL_LABEL = b"xpyd-signal-p\0"
_DECODE_LABEL = b"xpyd-signal-d\0"


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def new_instance() -> str:
    """A process's instance id (random): a restarted worker on the same address is a new instance."""
    return secrets.token_hex(8)


def _key(token: str) -> bytes:
    return token.encode("utf-8", "surrogatepass")


def prefill_proof(token: str, nonce_d: bytes, nonce_p: bytes, hello_frame: bytes) -> bytes:
    """What the prefill worker answers a hello with, to prove it holds ``token``."""
    return hmac.new(_key(token), _PREFILL_LABEL + nonce_d + nonce_p + hashlib.sha256(hello_frame).digest(),
                    hashlib.sha256).digest()


def decode_proof(token: str, nonce_p: bytes, nonce_d: bytes, hello_frame: bytes) -> bytes:
    """What the decode worker answers a challenge with, to prove it holds ``token``."""
    return hmac.new(_key(token), _DECODE_LABEL + nonce_p + nonce_d + hashlib.sha256(hello_frame).digest(),
                    hashlib.sha256).digest()


def check_proof(expected: Sequence[bytes] | None, got: bytes | None, peer: str) -> tuple[int | None, str | None]:
    """Which of this side's tokens the ``peer`` side proved (its index in ``expected``: the proofs this side
    computed with each of its tokens, the primary first; None: it has none), or why the proof is refused.
    (None, None): neither side has a token. Every candidate is compared, in constant time each."""
    if expected is None:
        if got is not None:
            return None, (f"the {peer} worker proves a cluster token and this worker has none: set the same "
                          "--cluster-token on both (KV transfers are keyed with it)")
        return None, None
    if got is None:
        return None, f"cluster token required (set --cluster-token / XPYD_CLUSTER_TOKEN on the {peer} worker)"
    matches = [hmac.compare_digest(e, got) for e in expected]
    if not any(matches):
        return None, "cluster token mismatch"
    return matches.index(True), None


def presence_refusal(ours: str | None, theirs: bool, peer: str) -> str | None:
    """Why a hello is refused before any proof: a cluster token on one side only (``theirs``: the peer
    says it proves one). None when both have one or neither has."""
    if ours is None and theirs:
        return (f"the {peer} worker presents a cluster token and this worker has none: set the same "
                "--cluster-token on both (KV transfers are keyed with it)")
    if ours is not None and not theirs:
        return f"cluster token required (set --cluster-token / XPYD_CLUSTER_TOKEN on the {peer} worker)"
    return None
