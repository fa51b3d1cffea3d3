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

Without a cluster token on either side there is nothing to prove: both proofs are ``None`` and the
exchange only opens the session. A token on one side only is refused with a message that says which
side lacks it (the transfers are keyed with the token too, so such a pair could not move a byte).

What the session is bound to, and why later messages carry no MAC: see ``xpyd.signal.server``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

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


def proof_refusal(expected: bytes | None, got: bytes | None, peer: str) -> str | None:
    """Why the ``peer`` side's proof (None: it proves no token) is not accepted, or None if it is;
    ``expected`` is the proof this side computed with its own token (None: it has none). Constant time."""
    if expected is None:
        if got is not None:
            return (f"the {peer} worker proves a cluster token and this worker has none: set the same "
                    "--cluster-token on both (KV transfers are keyed with it)")
        return None
    if got is None:
        return f"cluster token required (set --cluster-token / XPYD_CLUSTER_TOKEN on the {peer} worker)"
    if not hmac.compare_digest(expected, got):
        return "cluster token mismatch"
    return None


def presence_refusal(ours: str | None, theirs: bool, peer: str) -> str | None:
    """Why a hello is refused before any proof: a cluster token on one side only (``theirs``: the peer
    says it proves one). None when both have one or neither has."""
    if ours is None and theirs:
        return (f"the {peer} worker presents a cluster token and this worker has none: set the same "
                "--cluster-token on both (KV transfers are keyed with it)")
    if ours is not None and not theirs:
        return f"cluster token required (set --cluster-token / XPYD_CLUSTER_TOKEN on the {peer} worker)"
    return None
