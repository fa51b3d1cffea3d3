"""Grammar masks (`xpyd.model.grammar`) applied to logits rows in torch, on the rows' device.

The masks of a batch are joined on the host and copied to the device once (6 KB a row for a 49k vocabulary);
each mask byte then selects its 8 entries of a 256 x 8 table of 0 / -inf, and the rows get that added in place:
allowed logits unchanged, disallowed ones -inf (two kernels; ~20 us a 49k row on one CPU thread, where a
``masked_fill_`` from unpacked bits took ~120 us). Ids past a mask's bits (a row wider than the mask) get -inf.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

__all__ = ["apply_mask", "apply_masks"]


@functools.lru_cache(maxsize=16)
def _table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: entry [b, j] is 0 if bit j of byte b is set, else -inf."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.where(bits.bool(), 0.0, float("-inf")).to(device=device, dtype=dtype)


def apply_masks(logits: torch.Tensor, masks: Sequence[bytes | None]) -> None:
    """``logits`` [B, vocab] (float), in place: row i's disallowed ids get -inf (rows whose mask is None are left as
    they are). The masks of one batch come from one `Grammars`, so they have one length."""
    if logits.dim() != 2 or logits.shape[0] != len(masks):
        raise ValueError(f"apply_masks needs logits [B, vocab] and B masks; got {tuple(logits.shape)}, {len(masks)}")
    rows = [i for i, m in enumerate(masks) if m is not None]
    if not rows:
        return
    nbytes = len(masks[rows[0]])
    if any(len(masks[i]) != nbytes for i in rows):
        raise ValueError("apply_masks: the masks of one batch must have one length (one vocabulary)")
    device, vocab = logits.device, logits.shape[1]
    packed = torch.frombuffer(bytearray(b"".join(masks[i] for i in rows)), dtype=torch.uint8).to(device)
    bias = _table(device, logits.dtype).index_select(0, packed.long()).view(len(rows), nbytes * 8)
    width = min(vocab, nbytes * 8)
    if len(rows) == len(masks):
        target, index = logits, None
    else:
        index = torch.tensor(rows, device=device)
        target = logits.index_select(0, index)
    target[:, :width].add_(bias[:, :width])
    if vocab > width:
        target[:, width:] = float("-inf")
    if index is not None:
        logits.index_copy_(0, index, target)


def apply_mask(row: torch.Tensor, mask: bytes) -> torch.Tensor:
    """One logits row [vocab], in place; returns it."""
    if row.dim() != 1:
        raise ValueError(f"apply_mask needs one row [vocab]; got {tuple(row.shape)}")
    apply_masks(row.unsqueeze(0), [mask])
    return row
