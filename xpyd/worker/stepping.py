"""One forward pass plus sampling, for the engines of every role.

``seq`` objects are the schedulers' (prefill, decode, colocated): each has a
``slot``, a ``prompt_len`` (prefill: its ``prompt_ids``) and a ``payload`` WorkItem
whose output processor holds the tokens generated so far.
"""

from __future__ import annotations

from typing import Any, Sequence

from xpyd.worker.work_item import WorkItem
from xpyd.model.sampling import sample


def prefill_and_sample(runner: Any, seq: Any) -> int:
    """Run ``seq``'s prompt into its slot and sample its first token."""
    item: WorkItem = seq.payload
    logits = runner.prefill(seq.slot, seq.prompt_ids)
    return sample(logits.unsqueeze(0), [item.sampling], [item.generator])[0]


def decode_and_sample(runner: Any, seqs: Sequence[Any]) -> list[int]:
    """One decode step over every running ``seq`` (each feeds its last token); their next tokens."""
    slots, tokens, positions = [], [], []
    for seq in seqs:
        ids = seq.payload.output.token_ids
        slots.append(seq.slot)
        tokens.append(ids[-1])
        positions.append(seq.prompt_len + len(ids) - 1)
    logits = runner.decode(slots, tokens, positions)
    return sample(logits, [s.payload.sampling for s in seqs], [s.payload.generator for s in seqs])
