"""The simulated engine's KV content: one 16-byte record per token, at the start of the token's K row.

    record_t = digest_t (8 bytes) || token_t (4 bytes, little-endian) || check_t (4 bytes)
    digest_t = blake2b(digest_{t-1} || token_t (4 bytes LE) || t (4 bytes LE), digest_size=8)
    digest_{-1} = 8 zero bytes
    check_t  = blake2b(digest_t || token_t, digest_size=4)

The digest is chained over the whole sequence, so the record of the last token names every token before it
and its position: the simulated engine's "logits" are that digest (`sampler`). A row that is all zeros, torn
(half of one record, half of another) or altered in any byte fails its check or the chain, and the position
is named. The rest of a token's KV row (its V half, and the K row past 16 bytes) is never read or written:
a transfer still moves every byte of a block, as for a real model.

Token t of a request lies in block ``blocks[t // block_size]``; its record starts ``t % block_size`` rows into
that block (a row: ``row_bytes``, half a token's KV).
"""

from __future__ import annotations

from hashlib import blake2b
from typing import Sequence

__all__ = ["RECORD_BYTES", "ZERO_DIGEST", "BadRecord", "KVRecords", "chain", "digest_after", "record_of"]

RECORD_BYTES = 16
ZERO_DIGEST = bytes(8)  # digest_{-1}: before the first token


class BadRecord(ValueError):
    """The KV at a position does not hold what the tokens before it make (a corrupted, missing or foreign
    record): ``position`` names the first such token."""

    def __init__(self, position: int, why: str) -> None:
        super().__init__(f"KV at position {position} does not hold what its tokens make ({why})")
        self.position = position


def digest_after(previous: bytes, token: int, position: int) -> bytes:
    """digest_t from digest_{t-1}."""
    return blake2b(previous + token.to_bytes(4, "little") + position.to_bytes(4, "little"), digest_size=8).digest()


def record_of(digest: bytes, token: int) -> bytes:
    """The 16 bytes that hold token ``token`` whose chained digest is ``digest``."""
    body = digest + token.to_bytes(4, "little")
    return body + blake2b(body, digest_size=4).digest()


def chain(token_ids: Sequence[int], start: int = 0, previous: bytes = ZERO_DIGEST) -> list[bytes]:
    """The records of ``token_ids`` placed at positions start, start+1, ..., chained from ``previous``
    (digest_{start-1})."""
    out = []
    for position, token in enumerate(token_ids, start):
        previous = digest_after(previous, token, position)
        out.append(record_of(previous, token))
    return out


class KVRecords:
    """The records inside a pool's memory: where they lie, writing and verifying them."""

    def __init__(self, memory: memoryview, block_bytes: int, row_bytes: int, block_size: int) -> None:
        if row_bytes < RECORD_BYTES:
            raise ValueError(f"a KV row of {row_bytes} bytes cannot hold a {RECORD_BYTES}-byte record")
        self._memory = memory
        self._block_bytes = block_bytes
        self._row_bytes = row_bytes
        self._block_size = block_size

    def offset(self, blocks: Sequence[int], position: int) -> int:
        """Where the record of ``position`` starts in the pool's memory."""
        block, row = divmod(position, self._block_size)
        return blocks[block] * self._block_bytes + row * self._row_bytes

    def read(self, blocks: Sequence[int], position: int) -> bytes:
        at = self.offset(blocks, position)
        return bytes(self._memory[at : at + RECORD_BYTES])

    def write(self, blocks: Sequence[int], start: int, records: Sequence[bytes]) -> None:
        """Put ``records`` at positions start, start+1, ..."""
        memory = self._memory
        for position, record in enumerate(records, start):
            at = self.offset(blocks, position)
            memory[at : at + RECORD_BYTES] = record

    def verify_tokens(self, blocks: Sequence[int], token_ids: Sequence[int], end: int) -> bytes:
        """Check that positions [0, end) hold exactly the records of ``token_ids[:end]``; digest_{end-1}
        (BadRecord naming the first position that does not)."""
        memory, digest = self._memory, ZERO_DIGEST
        for position in range(end):
            token = token_ids[position]
            digest = digest_after(digest, token, position)
            at = self.offset(blocks, position)
            if memory[at : at + RECORD_BYTES] != record_of(digest, token):
                raise BadRecord(position, self._why(bytes(memory[at : at + RECORD_BYTES]), token))
        return digest

    def verify_chain(self, blocks: Sequence[int], end: int) -> bytes:
        """Check that positions [0, end) hold one unbroken chain of intact records (their tokens are whatever
        the records name); digest_{end-1} (BadRecord naming the first position that does not)."""
        memory, digest = self._memory, ZERO_DIGEST
        for position in range(end):
            at = self.offset(blocks, position)
            row = bytes(memory[at : at + RECORD_BYTES])
            token = int.from_bytes(row[8:12], "little")
            digest = digest_after(digest, token, position)
            if row != record_of(digest, token):
                raise BadRecord(position, self._why(row, None))
        return digest

    @staticmethod
    def _why(row: bytes, token: int | None) -> str:
        if not any(row):
            return "the row is all zeros: no KV was written or transferred there"
        if row[12:] != blake2b(row[:12], digest_size=4).digest():
            return "the record is torn or altered: its check fails"
        held = int.from_bytes(row[8:12], "little")
        if token is not None and held != token:
            return f"it holds token {held}, the request has {token} there"
        return "its digest does not follow from the tokens before it"
