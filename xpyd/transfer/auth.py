"""Who may move bytes into a registered pool: per-transfer secrets and the MACs that prove them.

A transfer is bound to the signal-plane session that asked for it. The receiver (decode) makes a fresh
random secret (``new_secret``) when it ``expect``s a transfer and hands it to the sender (prefill) inside
the pull, over the signal plane, whose session the cluster token authenticated at the handshake. The
frame that opens the transfer on the transfer connection (tcp: the header; shm and nixl: the offer)
carries a MAC instead of the secret::

    key = HMAC-SHA256(secret, "xpyd-kv-key" | cluster token, or nothing without one)
    mac = HMAC-SHA256(key, "xpyd-kv-mac" | backend | protocol version | transfer id | dst regions | src regions)

and the receiver checks it (constant time) with the key of the transfer it expects under that id (or, in a
token rotation's window, with the key of the other token it accepts: ``receive_keys``) before
any byte of the transfer lands in its pool (tcp reads nothing more; shm maps nothing and copies nothing;
nixl loads no agent and posts no READ). A frame without a MAC, with a wrong one, for an id not expected
(or no longer: a finished or aborted transfer leaves the table, so a recorded frame replayed later names
an unknown id, or one expected again under a fresh secret) is refused and leaves the expected transfer
pending for its real sender. The backend's name in the MAC keeps a tcp header from passing as an shm
offer (``auto`` announces a transfer to both with one secret); the regions in it keep a MAC from
opening the transfer with other regions.

What this does not do: the MAC covers the frame that opens a transfer, not the payload behind it
(hashing KV at memory speed would cost more than moving it), and nothing is encrypted. Someone on the
path between two workers who can read and rewrite their traffic reads the KV and can change it; keep
the transfer network private (see docs/transfer.md, "Who may write into a pool").
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from typing import Sequence

from xpyd import PROTOCOL_VERSION, TRANSFER_SECRET_BYTES
from xpyd.transfer.base import Region

SECRET_BYTES = TRANSFER_SECRET_BYTES
MAC_BYTES = 32  # HMAC-SHA256
_KEY_LABEL = b"xpyd-kv-key\0"
_MAC_LABEL = b"xpyd-kv-mac\0"


def new_secret() -> bytes:
    """A fresh secret for one transfer (the receiver makes it; the signal plane carries it to the sender)."""
    return secrets.token_bytes(SECRET_BYTES)


def check_secret(secret: object) -> bytes:
    if type(secret) is not bytes or len(secret) != SECRET_BYTES:
        raise ValueError(f"a transfer secret must be {SECRET_BYTES} bytes, got {type(secret).__name__}"
                         + (f" of {len(secret)}" if isinstance(secret, (bytes, bytearray)) else ""))
    return secret


def check_cluster_token(token: object) -> str | None:
    if token is not None and (not isinstance(token, str) or not token):
        raise ValueError("cluster_token must be a non-empty str or None")
    return token


def transfer_key(secret: bytes, cluster_token: str | None) -> bytes:
    """The key both sides of one transfer derive from its secret and the cluster token (if any)."""
    token = b"" if cluster_token is None else cluster_token.encode("utf-8", "surrogatepass")
    return hmac.new(check_secret(secret), _KEY_LABEL + token, hashlib.sha256).digest()


def receive_keys(secret: bytes, cluster_token: str | None,
                 accepted_tokens: tuple[str, ...] = ()) -> tuple[bytes, tuple[bytes, ...]]:
    """What a receiver checks a transfer's MAC with: the key of its own token, and those of the tokens it also
    accepts (a rotation window: a sender whose primary token is the other one signs with that one's key)."""
    return transfer_key(secret, cluster_token), tuple(transfer_key(secret, t) for t in accepted_tokens)


def transfer_mac(key: bytes, backend: str, transfer_id: str, dst: Sequence[Region],
                 src: Sequence[Region] = ()) -> bytes:
    """The MAC of the frame that opens a transfer (``src``: the sender's regions, where the frame names them)."""
    tid = transfer_id.encode("utf-8", "surrogatepass")
    name = backend.encode()
    msg = b"".join([_MAC_LABEL, struct.pack(">B", len(name)), name, struct.pack(">IH", PROTOCOL_VERSION, len(tid)),
                    tid, _regions(dst), _regions(src)])
    return hmac.new(key, msg, hashlib.sha256).digest()


def mac_matches(key: bytes, mac: bytes, backend: str, transfer_id: str, dst: Sequence[Region],
                src: Sequence[Region] = ()) -> bool:
    """Does ``mac`` prove the frame's sender holds ``key``? (constant-time compare)"""
    return hmac.compare_digest(mac, transfer_mac(key, backend, transfer_id, dst, src))


def _regions(regions: Sequence[Region]) -> bytes:
    flat = [x for r in regions for x in (r.offset, r.length)]
    return struct.pack(f">I{len(flat)}Q", len(regions), *flat)
