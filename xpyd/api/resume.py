"""What a P/D request's answers say about its tokens, so that the proxy can move it to other workers mid-stream
(``xpyd.proxy.migration``).

The proxy asks both workers (``kv_transfer_params``)::

    "token_ids": true               every token chunk of decode's stream, and prefill's JSON answer, name the
                                    output tokens whose text they carry: ``"xpyd_token_ids": [ids]``, the
                                    chunk's last key (a token whose text is held back is named by the chunk
                                    that carries its text)
    "resume_token_ids": [ids]       a migrated request: the output its client already has. Prefill computes
                                    the prompt and these as one context and samples the next token; decode
                                    replays them and goes on from prefill's token.

The proxy strips the names before the client sees a chunk (``split_ids``: a search from the chunk's end, no
JSON parse on the relay's fast path). Only the proxy sends these keys: a worker with a cluster token takes
requests from it alone.
"""

from __future__ import annotations

RESUME_KEY = "resume_token_ids"
TOKEN_IDS_KEY = "token_ids"
CHUNK_IDS_KEY = "xpyd_token_ids"
MAX_CHUNK_IDS = 4096  # ids one chunk may name (a chunk names the tokens since the last one: a few)

_MARK = b',"' + CHUNK_IDS_KEY.encode() + b'":['


class TokenIdsError(ValueError):
    """A chunk's token ids are not a short list of ints."""


def split_ids(data: bytes) -> tuple[bytes, list[int] | None]:
    """A chunk's JSON (one SSE event's data) without its ``xpyd_token_ids``, and those ids (None: it names
    none). The key is the object's last: the chunk ends ``,"xpyd_token_ids":[1,2]}``."""
    i = data.rfind(_MARK)
    if i < 0:
        return data, None
    end = len(data) - 2
    if data[end:] != b"]}":
        raise TokenIdsError("a chunk's xpyd_token_ids is not its last key")
    body = data[i + len(_MARK):end]
    try:
        ids = [int(t) for t in body.split(b",")] if body else []
    except ValueError:
        raise TokenIdsError("a chunk's xpyd_token_ids are not integers") from None
    if len(ids) > MAX_CHUNK_IDS or any(t < 0 for t in ids):
        raise TokenIdsError(f"a chunk's xpyd_token_ids: more than {MAX_CHUNK_IDS}, or a negative id")
    return data[:i] + b"}", ids


def ids_of(value: object) -> list[int]:
    """The ids in a parsed answer's ``xpyd_token_ids`` (TokenIdsError if they are not a short list of ints)."""
    if not isinstance(value, list) or len(value) > MAX_CHUNK_IDS or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise TokenIdsError("xpyd_token_ids must be a list of token ids")
    return value
