"""The general path: forward passes through the Hugging Face model's own modules, attending over the paged pool.

It serves every family (`families`), what the lean forward (`llama_fast`) does not cover included: the
model's embeddings, rotary embedding, norms, projections, MLP and lm_head compute; attention is ours, each
layer writing the new K/V in place into the request's blocks (`paged`) and attending over that request's
tokens only (`layer_attention.attend`). For multi-head latent attention (DeepSeek's MLA) a layer writes and
reads one latent per token instead (`latent_attention`); every other layer projects q, k, v per head
(`families.project_qkv`). An fp8 pool is written and read through its codec (`kv_quant.KVCodec`).

`ModelRunner` checks every batch and owns the pool; this module only computes.
"""

from __future__ import annotations

from typing import Callable

import torch

from xpyd.model import families, latent_attention, paged
from xpyd.model.kv_layout import KVLayout
from xpyd.model.kv_quant import KVCodec
from xpyd.model.layer_attention import attend


class GeneralPath:
    """The forward pass of ``model`` (a transformers causal LM of ``config``), on ``device``, over a pool of
    ``block_size``-token blocks; ``pace`` runs before each layer (the runner's share of the host's cores)."""

    def __init__(self, model, config, device: torch.device, block_size: int, pace: Callable[[], None]) -> None:
        inner = model.model
        self.embed = inner.embed_tokens
        self._rotary = inner.rotary_emb
        self._norm = inner.norm
        self._lm_head = model.lm_head
        self.layers = list(inner.layers)
        self._num_heads = config.num_attention_heads
        self._num_kv_heads = config.num_key_value_heads
        self._head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self._attention = families.layer_attention(config)  # how each layer attends (scale, window, soft-cap)
        self._rotary_kinds = tuple(dict.fromkeys(spec.rotary for spec in self._attention))
        self._final_softcap = families.final_softcap(config)
        # (multi-head latent attention: its sizes; the pool keeps one latent per token and layer)
        self.latent = latent_attention.LatentShape.of(config) if families.is_latent(config) else None
        self.device = device
        self.block_size = block_size
        self._pace = pace

    def pool_layout(self, dtype: str, block_size: int) -> KVLayout:
        """The layout of a one-block pool in ``dtype`` for what the layers write: a latent per token and layer
        (latent attention), else a K and a V per KV head."""
        if self.latent is not None:
            return self.latent.layout(len(self.layers), dtype, 1, block_size)
        return KVLayout(num_layers=len(self.layers), num_kv_heads=self._num_kv_heads, head_dim=self._head_dim,
                        dtype=dtype, num_blocks=1, block_size=block_size)

    def hidden(self, pool: torch.Tensor, blocks_for: Callable[[int], int], codec: KVCodec | None,
               blocks: list[int], ids: torch.Tensor, start: int) -> torch.Tensor:
        """One checked part's forward pass up to the final norm: hidden states [1, new tokens, hidden]. The
        K/V of [start, start + new tokens) are written into ``blocks``; ``blocks_for`` is the pool layout's."""
        m = ids.shape[0]
        n = start + m
        hidden = self.embed(ids.unsqueeze(0))  # [1, m, hidden]
        rotations = self._rotations(hidden, torch.arange(start, n, device=self.device).unsqueeze(0))
        where = paged.rows_of(blocks, torch.arange(start, n, device=self.device), self.block_size, self.device)
        prefix = paged.padded_tables([blocks], blocks_for(start), self.device) if start else None
        for index, (layer, spec) in enumerate(zip(self.layers, self._attention)):
            self._pace()
            if self.latent is not None:
                attn = latent_attention.prefill_layer(layer, spec, self.latent, pool, index, hidden,
                                                      rotations[spec.rotary], where, prefix, start)
                hidden = self._finish_layer(layer, hidden, attn)
                continue
            q, k, v = self._qkv(layer, hidden, *rotations[spec.rotary])  # [1, heads, m, head_dim]
            k_rows, v_rows = paged.write(pool, index, where, k[0].transpose(0, 1), v[0].transpose(0, 1), codec)
            if codec is not None:  # the new tokens' K/V as the fp8 pool holds them (as decode reads them too)
                k, v = k_rows.transpose(0, 1).unsqueeze(0), v_rows.transpose(0, 1).unsqueeze(0)
            first = spec.first_visible(start)  # (a local layer reads only the cached keys its window reaches)
            if first < start:
                k_old, v_old = paged.gather(pool, index, prefix, start, codec, first=first)
                k, v = torch.cat((k_old, k), 2), torch.cat((v_old, v), 2)
            attn = attend(q, k, v, spec, q_start=start, k_start=first)
            hidden = self._finish_layer(layer, hidden, attn)
        return hidden

    def decode(self, pool: torch.Tensor, blocks_for: Callable[[int], int], codec: KVCodec | None,
               tables: torch.Tensor, ids: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """One step of a checked batch: ids [B] on the device, block tables int64 [B, blocks of the longest
        request]; float32 logits [B, vocab]."""
        bs, batch = self.block_size, len(positions)
        pos_t = torch.tensor(positions, device=self.device)
        hidden = self.embed(ids.unsqueeze(1))  # [B, 1, hidden]
        rotations = self._rotations(hidden, pos_t.unsqueeze(1))
        where = paged.RowIndex(tables[torch.arange(batch, device=self.device), pos_t // bs], pos_t % bs)
        singles = [tables[i : i + 1, : blocks_for(p + 1)] for i, p in enumerate(positions)]
        for index, (layer, spec) in enumerate(zip(self.layers, self._attention)):
            self._pace()
            if self.latent is not None:
                attn = latent_attention.decode_layer(layer, spec, self.latent, pool, index, hidden,
                                                     rotations[spec.rotary], where, singles, positions)
                hidden = self._finish_layer(layer, hidden, attn)
                continue
            q, k, v = self._qkv(layer, hidden, *rotations[spec.rotary])  # q [B, heads, 1, hd]; k, v [B, kv, 1, hd]
            paged.write(pool, index, where, k[:, :, 0], v[:, :, 0], codec)
            outs = []
            for i, table in enumerate(singles):
                first = spec.first_visible(positions[i])  # (a local layer reads only its window's keys)
                keys, values = paged.gather(pool, index, table, positions[i] + 1, codec, first=first)
                outs.append(attend(q[i : i + 1], keys, values, spec, q_start=positions[i], k_start=first))
            attn = torch.cat(outs) if batch > 1 else outs[0]
            hidden = self._finish_layer(layer, hidden, attn)
        return self.logits(hidden[:, -1])

    def logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits, on the runner's device (the sampler's); soft-capped where the model does."""
        logits = self._lm_head(self._norm(last_hidden))
        if self._final_softcap is not None:
            logits = torch.tanh(logits / self._final_softcap) * self._final_softcap
        return logits.float()

    def _qkv(self, layer, hidden, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's q, k, v [batch, heads, seq, head_dim], q and k rotated (`families.project_qkv`)."""
        return families.project_qkv(layer.self_attn, layer.input_layernorm(hidden), cos, sin, self._num_heads,
                                    self._num_kv_heads, self._head_dim)

    def _rotations(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict:
        """(cos, sin) of ``positions`` for each rotary table the layers take (`LayerAttention.rotary`)."""
        return {kind: self._rotary(hidden, positions) if kind is None else self._rotary(hidden, positions, kind)
                for kind in self._rotary_kinds}

    def _finish_layer(self, layer, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        batch, _, seq, _ = attn.shape
        attn = attn.transpose(1, 2).reshape(batch, seq, -1)  # [batch, seq, heads * (value) head_dim]
        return families.finish_layer(layer, hidden, attn)
