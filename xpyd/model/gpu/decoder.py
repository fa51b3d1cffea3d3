"""Decode steps on a CUDA device: one token per request over the paged pool, each step one CUDA graph.

`PagedDecoder` runs the lean forward's weights (`FastLlama`) with the KV store and the paged attention of
`paged_attention` (Triton kernels that read the pool in place through the block tables). A step's inputs
(token ids, positions, the rows their K/V go to, the requests' lengths and block tables) are packed into
one pinned int32 buffer on the host and copied to a device buffer of fixed address in one or two
non-blocking copies; the step itself replays the graph captured for the smallest batch size that holds the
batch (the rows past the batch are padding: they write no KV and attend to nothing). Nothing in a step
waits for the device: the sampler's copy of the sampled ids is the step's one synchronisation. Batches
larger than the largest graph run the same code eagerly.

Without CUDA (Triton's interpreter on the CPU, in the tests) the same code runs eagerly: graphs are CUDA's.
"""

from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from xpyd.model.gpu import fused
from xpyd.model.gpu import paged_attention as kernels

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class StepInputs:
    """A decode step's int32 inputs for up to ``max_batch`` rows, on the host (pinned on CUDA) and on the
    device at fixed addresses (what a captured graph reads). Layout: ids | positions | slot blocks | slot
    rows | lengths (``max_batch`` each), then the block tables ``[max_batch, max_blocks]`` row-major."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device) -> None:
        self.max_batch, self.max_blocks = max_batch, max_blocks
        size = 5 * max_batch + max_batch * max_blocks
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._np = self.host.numpy()
        self.device = torch.zeros(size, dtype=torch.int32, device=device)

    def views(self, batch: int) -> tuple[torch.Tensor, ...]:
        """Device views for a (padded) batch: ids, positions, slot blocks, slot rows, lengths [batch], tables
        [batch, max_blocks]."""
        m, d = self.max_batch, self.device
        heads = tuple(d[i * m : i * m + batch] for i in range(5))
        tables = d[5 * m : 5 * m + batch * self.max_blocks].view(batch, self.max_blocks)
        return (*heads, tables)

    def fill(self, batch: int, tables: Sequence[Sequence[int]], positions: Sequence[int], ids: Sequence[int],
             block_size: int) -> None:
        """Host side: the first len(tables) rows from the batch, rows up to ``batch`` padding."""
        n, m, h = len(tables), self.max_batch, self._np
        pos = np.asarray(positions, dtype=np.int64)
        h[0:n] = ids
        h[m : m + n] = pos
        h[2 * m : 2 * m + n] = [t[p // block_size] for t, p in zip(tables, positions)]
        h[3 * m : 3 * m + n] = pos % block_size
        h[4 * m : 4 * m + n] = pos + 1
        if batch > n:  # padding rows: token 0 at position 0, no KV written (slot -1), length 0
            for i in range(4):
                h[i * m + n : i * m + batch] = 0
            h[2 * m + n : 2 * m + batch] = -1
            h[4 * m + n : 4 * m + batch] = 0
        base = 5 * m
        for i, table in enumerate(tables):
            row = base + i * self.max_blocks
            h[row : row + len(table)] = table

    def upload(self, batch: int) -> None:
        m = self.max_batch
        head, end = 5 * m, 5 * m + batch * self.max_blocks
        self.device[:head].copy_(self.host[:head], non_blocking=True)
        self.device[head:end].copy_(self.host[head:end], non_blocking=True)


class PagedDecoder:
    """Decode steps of ``fast`` (a `FastLlama` on ``pool``'s device) over ``pool``; CUDA graphs for the batch
    sizes of `GRAPH_BATCH_SIZES` up to ``max_batch`` when ``graphs`` (CUDA only)."""

    def __init__(self, fast, pool: torch.Tensor, max_blocks: int, max_batch: int, graphs: bool = True,
                 use_fused: bool | None = None) -> None:
        device = pool.device
        reason = kernels.why_unavailable(device)
        if reason is not None:
            raise ValueError(f"the paged decode kernels cannot run on {device}: {reason}")
        if graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.fast, self.pool, self.device = fast, pool, device
        self.block_size = pool.shape[4]
        sizes = [b for b in GRAPH_BATCH_SIZES if b < max_batch] + [max_batch]
        self.sizes = tuple(sorted(set(sizes)))
        self.inputs = StepInputs(self.sizes[-1], max_blocks, device)
        nh, hd = fast.num_heads, fast.head_dim
        self._out = torch.empty((self.sizes[-1], nh, hd), dtype=pool.dtype, device=device)
        sm = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
        self._workspaces = {b: kernels.DecodeWorkspace(b, nh, hd, kernels.default_splits(b, fast.num_kv_heads, sm),
                                                       device) for b in self.sizes}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # The fused pointwise kernels (`fused`): a layer in ~10 launches instead of ~35; their buffers are static.
        self.fused = fused.why_unavailable(device) is None if use_fused is None else use_fused
        if self.fused:
            m, nkv = self.sizes[-1], fast.num_kv_heads
            hidden, inter = fast.embed.shape[1], fast.layers[0].down.weight.shape[1]
            self._q = torch.empty((m, nh, hd), dtype=pool.dtype, device=device)
            self._k = torch.empty((m, nkv, hd), dtype=pool.dtype, device=device)
            self._v = torch.empty((m, nkv, hd), dtype=pool.dtype, device=device)
            self._h = torch.empty((m, hidden), dtype=pool.dtype, device=device)
            self._act = torch.empty((m, inter), dtype=pool.dtype, device=device)
        if graphs:
            self._capture()

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def step(self, tables: Sequence[Sequence[int]], positions: Sequence[int], ids: Sequence[int]) -> torch.Tensor:
        """Logits [B, vocab] (float32, on the device) of one token per request: ids[i] at positions[i] of the
        request whose blocks are tables[i] (checked by the caller: `batch_checks.decode_batch`)."""
        n = len(tables)
        at = bisect.bisect_left(self.sizes, n)
        batch = self.sizes[at] if at < len(self.sizes) else n
        if batch > self.inputs.max_batch:
            raise ValueError(f"a decode batch of {n} is over this decoder's {self.inputs.max_batch}")
        self.inputs.fill(batch, tables, positions, ids, self.block_size)
        self.inputs.upload(batch)
        captured = self._graphs.get(batch)
        if captured is not None:
            graph, logits = captured
            graph.replay()
            return logits[:n]
        return self._forward(batch)[:n]

    def _forward(self, batch: int) -> torch.Tensor:
        return self._forward_fused(batch) if self.fused else self._forward_ops(batch)

    def _forward_fused(self, batch: int) -> torch.Tensor:
        """The step with the fused kernels: per layer RMSNorm (or the previous residual add + RMSNorm), QKV,
        rotary split, KV store, attention (+ its combine), o, add + RMSNorm, gate/up, SiLU-and-multiply, down."""
        f, pool = self.fast, self.pool
        ids, pos, slot_blocks, slot_rows, lengths, tables = self.inputs.views(batch)
        q, k, v, h, act = self._q[:batch], self._k[:batch], self._v[:batch], self._h[:batch], self._act[:batch]
        out, workspace = self._out[:batch], self._workspaces[batch]
        x = F.embedding(ids.long(), f.embed)  # [B, hidden]: the residual stream, updated in place
        layers = f.layers
        fused.rms_norm(x, layers[0].ln1, layers[0].eps1, out=h)
        for index, layer in enumerate(layers):
            qkv = f.head_norms(layer, layer.qkv(h).view(batch, -1, f.head_dim))  # (q/k norms: qwen3)
            fused.rope_split(qkv, f.cos, f.sin, pos, q, k, v)
            kernels.store_kv(pool, index, k, v, slot_blocks, slot_rows)
            attn = kernels.paged_decode_attention(q, pool, index, tables, lengths, f.scale, out, workspace)
            fused.add_rms_norm(x, layer.o(attn.view(batch, -1)), layer.ln2, layer.eps2, x, h)
            fused.silu_mul(layer.gate_up(h), act)
            following = layers[index + 1] if index + 1 < len(layers) else None
            weight, eps = (following.ln1, following.eps1) if following else (f.norm, f.norm_eps)
            fused.add_rms_norm(x, layer.down(act), weight, eps, x, h)
        return f.lm_head(h).float()

    def _forward_ops(self, batch: int) -> torch.Tensor:
        f, pool = self.fast, self.pool
        nh, nkv, hd = f.num_heads, f.num_kv_heads, f.head_dim
        ids, pos, slot_blocks, slot_rows, lengths, tables = self.inputs.views(batch)
        pos = pos.long()
        x = F.embedding(ids.long(), f.embed)  # [B, hidden]
        cos, sin = f.cos[pos], f.sin[pos]
        out, workspace = self._out[:batch], self._workspaces[batch]
        for index, layer in enumerate(f.layers):
            qkv = f.qkv(layer, x)  # [B, heads + 2 kv_heads, hd]
            qk = f._rope(qkv, cos, sin)  # [B, heads + kv_heads, hd]
            kernels.store_kv(pool, index, qk[:, nh:], qkv[:, nh + nkv :], slot_blocks, slot_rows)  # (strided views)
            attn = kernels.paged_decode_attention(qk[:, :nh], pool, index, tables, lengths, f.scale, out, workspace)
            x = x + layer.o(attn.view(batch, nh * hd))
            x = f._mlp(layer, x)
        return f.logits(x)

    def _capture(self) -> None:
        """Warm every size up on a side stream (Triton compiles there), then capture one graph per size,
        largest first, all in one memory pool."""
        for batch in self.sizes:  # all padding: nothing is written to the pool
            self.inputs.fill(batch, [], [], [], self.block_size)
        self.inputs.upload(self.sizes[-1])
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for batch in reversed(self.sizes):
                for _ in range(2):
                    self._forward(batch)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        mempool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                logits = self._forward(batch)
            self._graphs[batch] = (graph, logits)
        torch.cuda.synchronize(self.device)
