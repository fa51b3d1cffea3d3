"""How much of a CUDA device a worker's KV pool may take (``--gpu-memory-utilization``, as vLLM's).

The worker's share of the device is ``fraction x total memory``; its KV pool gets what is left of that
share after the weights (already loaded), the peak activations of the largest forward pass it runs
(measured: one prefill of that many tokens over a scratch pool, before the real pool exists), the decode
graphs' memory (estimated from the largest batch's logits and MLP activations), and a fixed reserve for
what torch's allocator does not count (the CUDA context, cuBLAS workspaces). Two workers sharing one GPU
each take their own fraction (0.45 each, say); a budget larger than the memory still free (another process
holds it) is refused with both numbers.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from xpyd.model.kv_pool import KVLayout, KVPool

log = logging.getLogger(__name__)

CONTEXT_RESERVE = 768 << 20  # CUDA context, cuBLAS/cuDNN workspaces, Triton's modules: outside torch's count
MIB = 1 << 20


def check_fraction(fraction: float) -> float:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], not {fraction!r}")
    return float(fraction)


@torch.inference_mode()
def prefill_peak_bytes(runner, layout: KVLayout, tokens: int, device: torch.device) -> int:
    """Bytes a prefill forward of ``tokens`` tokens allocates at its peak beyond what is held before it
    (activations, attention workspaces, logits), measured over a scratch pool of just those tokens: the lean
    forward's when it covers the model, else the general path's (Gemma, DeepSeek), which prefills into the
    runner's pool (the scratch one, for the measurement: the real one does not exist yet)."""
    scratch = KVPool(dataclasses.replace(layout, num_blocks=layout.blocks_for(tokens)), device=device, caching=False)
    table = scratch.blocks.allocate(scratch.layout.num_blocks)
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    if runner.fast_path is not None:
        runner.fast_path.prefill_many(scratch.tensor, [(table, ids, 0)])
    else:
        runner.pool = scratch
        try:
            runner.prefill(table, [0] * tokens)
        finally:
            del runner.pool
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del scratch
    torch.cuda.empty_cache()
    return max(0, peak)


def graph_reserve_bytes(max_batch: int, vocab: int, hidden: int, intermediate: int, elem: int) -> int:
    """Memory the decode graphs keep for the largest batch: float32 logits, the MLP's and attention's
    activations (a few of each), plus slack for the smaller graphs sharing the pool."""
    per_row = vocab * 4 * 2 + (4 * intermediate + 8 * hidden) * elem
    return max_batch * per_row + 64 * MIB


def kv_budget_bytes(device: torch.device, fraction: float, activation_peak: int, graph_reserve: int) -> int:
    """Bytes the KV pool may take on ``device``; ValueError with the numbers when nothing is left."""
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)  # weights (and the allocator's cache) of this process
    need = activation_peak + graph_reserve + CONTEXT_RESERVE
    budget = int(fraction * total) - held - need
    if budget <= 0:
        raise ValueError(f"--gpu-memory-utilization {fraction}: {fraction * total / MIB:.0f} MiB of the device's "
                         f"{total / MIB:.0f} MiB leave nothing for the KV cache after the weights "
                         f"({held / MIB:.0f} MiB), activations ({activation_peak / MIB:.0f} MiB), graphs and "
                         f"the CUDA context ({(graph_reserve + CONTEXT_RESERVE) / MIB:.0f} MiB)")
    available = free - activation_peak - graph_reserve - 256 * MIB  # (the context is already out of `free`)
    if budget > available:
        raise ValueError(f"--gpu-memory-utilization {fraction}: the KV cache would take {budget / MIB:.0f} MiB but "
                         f"only {max(0, available) / MIB:.0f} MiB of the device are free beside what this "
                         f"worker needs (other processes hold {(total - free - held) / MIB:.0f} MiB): lower "
                         f"the fraction")
    return budget


def share_blocks(utilization: float, batch_size: int, prefill_chunk: int, max_model_len: int, role: str):
    """``num_blocks`` for `ModelRunner` under ``--gpu-memory-utilization``: a function of the loaded runner that
    measures its largest prefill's activations and sizes the pool from what is left of the share."""

    def blocks(runner) -> int:
        layout = runner.layout_template
        tokens = min(runner.max_model_len, prefill_chunk or runner.max_model_len)
        peak = prefill_peak_bytes(runner, layout, tokens, runner.device)
        cfg = runner.config
        elem = layout.token_bytes // (layout.num_layers * layout.planes * layout.num_kv_heads * layout.head_dim)
        graphs = graph_reserve_bytes(batch_size, runner.vocab_size, cfg.hidden_size, cfg.intermediate_size, elem)
        budget = kv_budget_bytes(runner.device, utilization, peak, graphs)
        count = budget // layout.block_bytes
        if count * layout.block_size < max_model_len:
            raise ValueError(f"--gpu-memory-utilization {utilization}: {budget >> 20} MiB hold "
                             f"{count} blocks, not one request of --max-model-len {max_model_len}")
        log.info("%s: KV cache of %d blocks (%d MiB; prefill of %d tokens peaks at %d MiB)", role, count,
                 budget >> 20, tokens, peak >> 20)
        return count

    return blocks
