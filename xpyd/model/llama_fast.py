"""A lean forward pass for Llama-family models (llama, mistral, qwen2, qwen3, phi3; mixtral and qwen3_moe with
their experts run by transformers' block) over the KV pool.

Same math as transformers' modules, with less per-step work:
- fused QKV and gate/up weights (concatenated once at load, or the model's own fused ones: phi3), called
  through `F.linear` on plain tensors instead of module `forward`s; in bfloat16, through oneDNN with
  weights prepacked once (about 2x faster than `F.linear` for these small GEMVs on AVX-512-bf16 CPUs);
- q/k norms (qwen3) as the same RMSNorm over each head;
- rotary cos/sin tables built once by the model's own rotary module, indexed by position per step,
  applied to q and k in one go;
- K/V written in place into the pool; attention over each request's live tokens only;
- an fp8 pool (uint8 codes, `kv_quant`): K/V quantized as they are written, dequantized as the torch
  paths gather them, and inside the native decode kernel (`kv_codec`, set by the runner).

float32 stays on `F.linear` so its results follow transformers' (the token-for-token tests).
It runs on the device of the model's weights: every tensor it makes per step is made there, and off
the CPU it uses plain `F.linear` (the oneDNN prepacking is CPU-only).
Models it does not cover (`why_not_covered`) keep the general path in `ModelRunner`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xpyd.model import kv_int8, native, paged
from xpyd.model.kv_quant import KVCodec
from xpyd.model.lean_cover import GATE_UP_NAMES, QKV_NAMES, is_sparse_moe, linears, why_not_covered


def _onednn_bf16_ok() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class _Linear:
    """y = x W^T + b for 2-D x; prepacked for oneDNN when `pack`."""

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool) -> None:
        self.weight = weight.contiguous()
        self.bias = None if bias is None else bias.contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1) if pack else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _fuse(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat([m.weight.detach() for m in linears])
    if all(m.bias is None for m in linears):
        return weight, None
    bias = torch.cat([
        m.bias.detach() if m.bias is not None else torch.zeros(m.out_features, dtype=weight.dtype,
                                                                device=weight.device)
        for m in linears
    ])
    return weight, bias


class _Layer:
    __slots__ = ("ln1", "eps1", "qkv", "q_norm", "k_norm", "o", "ln2", "eps2", "gate_up", "down", "experts")

    def __init__(self, layer, pack: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1 = layer.input_layernorm.weight.detach()
        self.eps1 = layer.input_layernorm.variance_epsilon
        self.qkv = _Linear(*_fuse(linears(attn, QKV_NAMES)), pack)
        # per-head RMSNorms of q and k before rotary (qwen3): (weight [head_dim], eps), or None
        self.q_norm = (attn.q_norm.weight.detach(), attn.q_norm.variance_epsilon) if hasattr(attn, "q_norm") else None
        self.k_norm = (attn.k_norm.weight.detach(), attn.k_norm.variance_epsilon) if hasattr(attn, "k_norm") else None
        self.o = _Linear(attn.o_proj.weight.detach(), _detach(attn.o_proj.bias), pack)
        self.ln2 = layer.post_attention_layernorm.weight.detach()
        self.eps2 = layer.post_attention_layernorm.variance_epsilon
        # a dense MLP (gate_up, down), or a mixture of experts: transformers' block (`experts`), the rest None
        self.experts = mlp if is_sparse_moe(mlp) else None
        self.gate_up = self.down = None
        if self.experts is None:
            self.gate_up = _Linear(*_fuse(linears(mlp, GATE_UP_NAMES)), pack)
            self.down = _Linear(mlp.down_proj.weight.detach(), _detach(mlp.down_proj.bias), pack)


def _detach(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op (float32 statistics, scale in the input dtype).

    (`F.rms_norm` was tried: on CPU it is a composite of the same ops, no faster.)
    """
    h = x.to(torch.float32, copy=True)  # our own buffer, so the steps below can work in place
    h.mul_(torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))
    return h.to(x.dtype).mul_(weight)


def _nothing() -> None:
    pass


class FastLlama:
    def __init__(self, model, max_len: int, dtype: torch.dtype, pack: bool | None = None,
                 decode_attention: str | None = None) -> None:
        reason = why_not_covered(model)
        if reason is not None:
            raise ValueError(f"fast path does not cover this model: {reason}")
        config, inner = model.config, model.model
        device = inner.embed_tokens.weight.device  # where the model is, so where everything runs
        if pack is None:
            pack = dtype == torch.bfloat16 and device.type == "cpu" and _onednn_bf16_ok()
        elif pack and device.type != "cpu":
            raise ValueError(f"oneDNN prepacked weights are CPU-only; the model is on {device}")
        self.dtype = dtype
        self.device = device
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # Decode attention: "kernel" (native/decode_attention.c: reads K/V in place from the pool, bfloat16 on
        # the CPU), "matmul" (two float32 bmm's and a softmax over K/V copied out of the pool) or "sdpa"
        # (torch's fused kernel). For one query token torch's fused CPU kernel is 3-4x slower than the
        # matmuls, and the matmuls 3-4x slower than the native kernel (measured: docs/benchmarks.md), so
        # bfloat16 uses the kernel when it builds here, else the matmuls; float32 keeps SDPA, what
        # transformers itself runs.
        self._kernel: native.DecodeAttention | None = None
        self._pointwise: native.Pointwise | None = None
        if dtype == torch.bfloat16 and device.type == "cpu":
            self._pointwise = native.load_pointwise()  # None (the torch ops) when it cannot be built here
        self.decode_attention = self._default_attention() if decode_attention is None else decode_attention
        # Prefill attention: "kernel" (native/prefill_attention.c: AVX512-BF16 dot products, 3.5-5x torch's CPU
        # flash attention here, and a prompt's bits the same whatever its chunks) where it builds, else "sdpa".
        self._prefill_kernel: native.PrefillAttention | None = None
        if dtype == torch.bfloat16 and device.type == "cpu":
            try:
                self.prefill_attention = "kernel"
            except ValueError:
                pass
        self.on_layer = _nothing  # called before every layer (the runner's CPU pacing)
        self.kv_codec: KVCodec | None = None  # an fp8 pool's codes <-> values (the runner's)
        self.scale = self.head_dim**-0.5
        self.embed = inner.embed_tokens.weight.detach()
        self.layers = [_Layer(layer, pack) for layer in inner.layers]
        self.norm = inner.norm.weight.detach()
        self.norm_eps = inner.norm.variance_epsilon
        self.lm_head = _Linear(model.lm_head.weight.detach(), _detach(model.lm_head.bias), pack)
        with torch.inference_mode():  # the model's own rotary module, once, for every position
            cos, sin = inner.rotary_emb(torch.zeros(1, dtype=dtype, device=device),
                                        torch.arange(max_len, device=device).unsqueeze(0))
        self.cos = cos[0].contiguous()  # [max_len, head_dim]
        half = self.head_dim // 2  # sin with rotate_half's sign folded in: see _rope
        self.sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1).contiguous()
        if pack:
            linears = [lin for l in self.layers for lin in (l.qkv, l.o, l.gate_up, l.down) if lin is not None]
            linears.append(self.lm_head)
            keep_packed = self._packed_matches()
            for lin in linears:
                if keep_packed:
                    lin.weight = None  # the packed copy is the one used; drop the fused plain copies
                else:
                    lin.packed = None

    @property
    def decode_attention(self) -> str:
        return self._decode_attention

    @decode_attention.setter
    def decode_attention(self, choice: str) -> None:
        if choice not in ("kernel", "matmul", "sdpa"):
            raise ValueError(f"decode_attention must be 'kernel', 'matmul' or 'sdpa', not {choice!r}")
        if choice == "kernel":
            if self.num_heads % self.num_kv_heads or self.num_heads // self.num_kv_heads > 16 or self.head_dim > 256:
                raise ValueError("decode_attention 'kernel' handles up to 16 query heads per KV head, head_dim <= 256")
            self._kernel = self._native(native.load_decode_attention, "decode_attention.c", "decode_attention 'kernel'")
        self._decode_attention = choice

    @property
    def prefill_attention(self) -> str:
        return "sdpa" if self._prefill_kernel is None else "kernel"

    @prefill_attention.setter
    def prefill_attention(self, choice: str) -> None:
        if choice not in ("kernel", "sdpa"):
            raise ValueError(f"prefill_attention must be 'kernel' or 'sdpa', not {choice!r}")
        if choice == "kernel":
            if self.num_heads % self.num_kv_heads or self.head_dim % 16 or self.head_dim > 256:
                raise ValueError("prefill_attention 'kernel' handles head_dim a multiple of 16 up to 256")
            self._prefill_kernel = self._native(native.load_prefill_attention, "prefill_attention.c",
                                                "prefill_attention 'kernel'")
        else:
            self._prefill_kernel = None

    def _native(self, load, source: str, what: str):
        """A native library for bfloat16 on the CPU, or ValueError saying why it cannot be used here."""
        if self.dtype != torch.bfloat16 or self.device.type != "cpu":
            raise ValueError(f"{what} runs bfloat16 on the CPU, not {self.dtype} on {self.device}")
        lib = load()
        if lib is None:
            raise ValueError(f"{what} is unavailable: {native.unavailable_reason(source)}")
        return lib

    def _default_attention(self) -> str:
        if self.dtype == torch.float32:
            return "sdpa"
        try:
            self.decode_attention = "kernel"
            return "kernel"
        except ValueError:
            return "matmul"

    def _packed_matches(self) -> bool:
        """Guard against a oneDNN build that packs but computes something else."""
        try:
            x = torch.randn(3, self.embed.shape[1], generator=torch.Generator().manual_seed(0)).to(self.dtype)
            lin = self.layers[0].qkv
            ref = F.linear(x, lin.weight, lin.bias).float()
            return bool(torch.allclose(lin(x).float(), ref, rtol=5e-2, atol=5e-2 * float(ref.abs().max())))
        except RuntimeError:
            return False

    @property
    def native_pointwise(self) -> bool:
        """RMSNorm and the rotary step as native calls (pointwise.c), bfloat16 on the CPU when it builds."""
        return self._pointwise is not None

    @native_pointwise.setter
    def native_pointwise(self, enabled: bool) -> None:
        self._pointwise = self._native(native.load_pointwise, "pointwise.c", "native pointwise kernels") \
            if enabled else None

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self._pointwise is not None:
            return self._pointwise.rms_norm(x, weight, eps)
        return _rms_norm(x, weight, eps)

    def _rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qkv [T, heads + 2 kv_heads, hd], cos/sin [T, hd] -> rotated q and k [T, heads + kv_heads, hd].

        HF's q*cos + rotate_half(q)*sin with rotate_half(q) = (-q2, q1); the minus sits in `sin` instead
        (self.sin = (-sin1, sin2)), which is the same product, one pass fewer.
        """
        if self._pointwise is not None:
            return self._pointwise.rope(qkv, self.num_heads + self.num_kv_heads, cos, sin)
        qk = qkv[:, : self.num_heads + self.num_kv_heads]
        half = self.head_dim // 2
        swapped = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
        return (qk * cos.unsqueeze(1)).add_(swapped.mul_(sin.unsqueeze(1)))

    def _codec(self, pool: torch.Tensor) -> KVCodec | None:
        """The codec of ``pool`` when it holds fp8 codes or int8 rows (uint8), else None."""
        if pool.dtype != torch.uint8:
            return None
        if self.kv_codec is None:
            raise ValueError("a quantized KV pool (uint8) needs its codec: set kv_codec")
        return self.kv_codec

    def qkv(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (the residual stream) -> the layer's q, k, v [T, heads + 2 kv_heads, hd], before rotary."""
        qkv = layer.qkv(self._norm(x, layer.ln1, layer.eps1))
        return self.head_norms(layer, qkv.view(x.shape[0], self.num_heads + 2 * self.num_kv_heads, self.head_dim))

    def head_norms(self, layer: _Layer, qkv: torch.Tensor) -> torch.Tensor:
        """``qkv`` [T, heads + 2 kv_heads, hd] with the layer's q/k norms applied (a new tensor), or as it is
        when the layer has none."""
        if layer.q_norm is None:
            return qkv
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        rows = qkv.shape[0]
        q = self._norm(qkv[:, :nh].reshape(rows * nh, hd), *layer.q_norm).view(rows, nh, hd)
        k = self._norm(qkv[:, nh : nh + nkv].reshape(rows * nkv, hd), *layer.k_norm).view(rows, nkv, hd)
        return torch.cat((q, k, qkv[:, nh + nkv :]), dim=1)

    @property
    def experts(self) -> bool:
        """Some layer is a mixture of experts (run by transformers' block: mixtral, qwen3_moe)."""
        return any(layer.experts is not None for layer in self.layers)

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        if layer.experts is not None:
            return x + layer.experts(self._norm(x, layer.ln2, layer.eps2).unsqueeze(0))[0]
        gate, up = layer.gate_up(self._norm(x, layer.ln2, layer.eps2)).chunk(2, dim=-1)
        return x + layer.down(F.silu(gate).mul_(up))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self._norm(x, self.norm, self.norm_eps)).float()

    def prefill(self, pool: torch.Tensor, table: list[int], ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        """ids [n]: the tokens at positions [start, start + n) of the request whose blocks are ``table``
        (K/V of [0, start) already there; [start, start + n) written in place). Returns float32 logits
        [vocab] of the last token."""
        return self.prefill_many(pool, [(table, ids, start)])[0]

    def prefill_many(self, pool: torch.Tensor, parts: list[tuple[list[int], torch.Tensor, int]]) -> torch.Tensor:
        """Several requests' prompt pieces in one forward pass: each part (table, ids [n], start) as in
        `prefill`. Their tokens are packed into one batch for every matmul (QKV, o, MLP); attention runs per
        part over its own cached prefix and new tokens. Returns float32 logits [parts, vocab], one row per
        part (of its last token)."""
        return self.logits(self.prefill_hidden(pool, parts)[self.last_rows(parts)])

    def last_rows(self, parts: list[tuple[list[int], torch.Tensor, int]]) -> torch.Tensor:
        """Where each part's last token lies in `prefill_hidden`'s rows."""
        ends, offset = [], 0
        for _, ids, _ in parts:
            offset += ids.shape[0]
            ends.append(offset - 1)
        return torch.tensor(ends, device=self.device)

    def prefill_hidden(self, pool: torch.Tensor, parts: list[tuple[list[int], torch.Tensor, int]]) -> torch.Tensor:
        """`prefill_many`'s forward pass up to the final norm: the hidden states [tokens, hidden] of every
        new token, the parts' one after another (``logits`` of a row gives its logits)."""
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        block_size = pool.shape[4]
        spans, positions, blocks, rows, prefixes = [], [], [], [], []
        offset = 0
        kernel = self._prefill_kernel
        for table, ids, start in parts:
            n = ids.shape[0]
            pos = torch.arange(start, start + n, device=self.device)
            where = paged.rows_of(table, pos, block_size, self.device)
            positions.append(pos)
            blocks.append(where.blocks)
            rows.append(where.rows)
            if start:  # a cached (or earlier-chunk) prefix: attend over it too, each new token up to its own position
                prefix = (paged.padded_tables([table], self.blocks_for(pool, start), self.device),
                          None if kernel is not None else
                          torch.ones(n, start + n, dtype=torch.bool, device=self.device).tril_(start))
            else:
                prefix = None
            spans.append((offset, n, start))
            prefixes.append(prefix)
            offset += n
        total = offset
        single = len(parts) == 1
        ids = parts[0][1] if single else torch.cat([p[1] for p in parts])
        pos = positions[0] if single else torch.cat(positions)
        where = paged.RowIndex(blocks[0], rows[0]) if single else paged.RowIndex(torch.cat(blocks), torch.cat(rows))
        x = F.embedding(ids, self.embed)  # [T, hidden]
        codec = self._codec(pool)
        if single:
            start = parts[0][2]
            cos, sin = self.cos[start : start + total], self.sin[start : start + total]
        else:
            cos, sin = self.cos[pos], self.sin[pos]
        for index, layer in enumerate(self.layers):
            self.on_layer()
            qkv = self.qkv(layer, x)
            qk = self._rope(qkv, cos, sin)
            # (from an fp8 pool, the new tokens' K/V as stored: attention reads every token as the pool holds it)
            k_all, v_all = paged.write(pool, index, where, qk[:, nh:], qkv[:, nh + nkv :], codec)
            outs = []
            for (off, n, start), prefix in zip(spans, prefixes):
                if kernel is not None:  # (rows [n, heads, hd] in and out: no transposes)
                    q_n, k_n, v_n = qk[off : off + n, :nh], k_all[off : off + n], v_all[off : off + n]
                    if prefix is not None and codec is None:  # the prefix read in place from the pool's blocks
                        out = kernel.paged(q_n, k_n, v_n, self.scale, pool, index, prefix[0][0], start)
                    else:  # (a quantized pool's prefix: its values, gathered)
                        old = () if prefix is None else tuple(t[0] for t in paged.gather(pool, index, prefix[0], start,
                                                                                            codec))
                        out = kernel(q_n, k_n, v_n, self.scale, *old)
                    outs.append(out.view(n, nh * hd))
                    continue
                q = qk[off : off + n, :nh].transpose(0, 1).unsqueeze(0)
                k = k_all[off : off + n].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, n, hd]
                v = v_all[off : off + n].transpose(0, 1).unsqueeze(0)
                if prefix is not None:
                    k_old, v_old = paged.gather(pool, index, prefix[0], start, codec)
                    attn = F.scaled_dot_product_attention(q, torch.cat((k_old, k), 2), torch.cat((v_old, v), 2),
                                                          attn_mask=prefix[1], scale=self.scale, enable_gqa=True)
                else:
                    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
                outs.append(attn[0].transpose(0, 1).reshape(n, nh * hd))  # (attn [1, heads, n, hd])
            x = x + layer.o(outs[0] if single else torch.cat(outs))
            x = self._mlp(layer, x)
        return x

    @staticmethod
    def blocks_for(pool: torch.Tensor, num_tokens: int) -> int:
        return -(-num_tokens // pool.shape[4])

    def decode(self, pool: torch.Tensor, tables: list[list[int]], positions: list[int], ids: torch.Tensor) -> torch.Tensor:
        """One token per request: ids[i] at positions[i] of the request whose blocks are tables[i].
        Returns float32 logits [B, vocab]."""
        width = self.blocks_for(pool, max(positions) + 1)
        return self.decode_tables(pool, paged.padded_tables(tables, width, self.device), positions, ids)

    def decode_tables(self, pool: torch.Tensor, tables: torch.Tensor, positions: list[int],
                      ids: torch.Tensor) -> torch.Tensor:
        """`decode` with the block tables as one int64 tensor [B, >= blocks of the longest request] on the
        device (row i: request i's blocks, then any padding), as `paged.padded_tables` makes it or as the
        runner gathers it from its kept tables (`block_tables`). Returns float32 logits [B, vocab]."""
        batch, nh, nkv, hd = len(positions), self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(ids, self.embed)  # [B, hidden]
        pos_t = torch.tensor(positions, device=self.device)
        cos, sin = self.cos[pos_t], self.sin[pos_t]
        attend = self._attention_plan(pool, tables, positions, pos_t)
        for index, layer in enumerate(self.layers):
            self.on_layer()
            qkv = self.qkv(layer, x)
            qk = self._rope(qkv, cos, sin)
            attn = attend(index, qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :])  # [B, heads, hd]
            x = x + layer.o(attn.reshape(batch, nh * hd))
            x = self._mlp(layer, x)
        return self.logits(x)

    def _attention_plan(self, pool, tables, positions, pos_t):
        """A function (layer, q, k_new, v_new) -> attention output [B, heads, hd] that also writes k/v
        into the pool (``tables``: int64 [B, >= blocks of the longest request]).

        With the native kernel: one call per layer (it writes k/v and reads each request's blocks in
        place). Otherwise each layer's K/V is gathered through the block tables: for the whole batch at
        once, padded to the longest request and masked, or (when one long request among short ones would
        make the padding cost more than the live tokens) one request at a time.
        """
        if self._decode_attention == "kernel":
            return self._kernel_plan(pool, tables, positions)
        batch, block_size = len(positions), pool.shape[4]
        codec = self._codec(pool)
        where = paged.RowIndex(tables[torch.arange(batch, device=self.device), pos_t // block_size],
                               pos_t % block_size)
        matmul = self._decode_attention == "matmul"
        attend_rows = self._matmul_attention if matmul else self._sdpa_attention
        lengths = [p + 1 for p in positions]
        longest = max(lengths)
        if batch > 1 and batch * longest > 2 * sum(lengths):
            singles = [tables[i : i + 1, : self.blocks_for(pool, n)] for i, n in enumerate(lengths)]

            def per_request(index, q, k_new, v_new):
                paged.write(pool, index, where, k_new, v_new, codec)
                outs = []
                for i in range(batch):
                    keys, values = paged.gather(pool, index, singles[i], lengths[i], codec)
                    outs.append(attend_rows(q[i : i + 1], keys, values, None))
                return torch.cat(outs)

            return per_request

        padded = tables[:, : self.blocks_for(pool, longest)]
        mask = None
        if batch > 1 and min(lengths) < longest:
            mask = (torch.arange(longest, device=self.device) <= pos_t.unsqueeze(1)).view(batch, 1, 1, longest)
            if matmul:  # additive, float32 (a bool mask added to the scores would mask nothing)
                mask = torch.zeros(mask.shape, device=self.device).masked_fill_(~mask, float("-inf"))

        def batched(index, q, k_new, v_new):
            paged.write(pool, index, where, k_new, v_new, codec)
            keys, values = paged.gather(pool, index, padded, longest, codec)
            return attend_rows(q, keys, values, mask)

        return batched

    def _kernel_plan(self, pool, table_t, positions):
        if pool.dtype not in (torch.bfloat16, torch.uint8) or pool.device.type != "cpu":
            raise ValueError(f"the native decode attention needs a bfloat16, fp8 or int8 CPU pool, not {pool.dtype} on "
                             f"{pool.device}")
        lens_t = torch.tensor(positions, dtype=torch.int64).add_(1)
        native.check_tables(table_t, lens_t, pool.shape[0], pool.shape[4])  # once for every layer's call
        out = torch.empty((len(positions), self.num_heads, self.head_dim), dtype=torch.bfloat16)
        kernel, scale = self._kernel, self.scale
        codec = self._codec(pool)
        if codec is not None and codec.format == kv_int8.FORMAT:

            def native_int8(index, q, k_new, v_new):  # (the kernel encodes the step's rows, turned, and turns q)
                return kernel.int8(q, k_new, v_new, pool, index, table_t, lens_t, scale, out, tables_checked=True,
                                   rotation=codec.kernel_rotation)

            return native_int8
        if codec is not None:
            fmt = codec.format

            def native_fp8(index, q, k_new, v_new):
                k_codes, v_codes = codec.encode(index, k_new, v_new)
                return kernel.fp8(q, k_codes, v_codes, pool, index, table_t, lens_t, scale, out, fmt,
                                  *codec.kernel_scales(index), tables_checked=True)

            return native_fp8

        def native_attention(index, q, k_new, v_new):
            # `out` is reused by every layer: o_proj has consumed the previous layer's before this call
            return kernel(q, k_new, v_new, pool, index, table_t, lens_t, scale, out, tables_checked=True)

        return native_attention

    def _sdpa_attention(self, q, keys, values, mask):
        """q [R, heads, hd]; keys/values [R, kv_heads, n, hd] (any strides) -> [R, heads, hd]."""
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=self.scale,
                                             enable_gqa=True)
        return out.squeeze(2)

    def _matmul_attention(self, q, keys, values, mask):
        """The same as `_sdpa_attention`, as two float32 matmuls around a softmax (mask: additive or None).

        Heads are grouped per KV head ([R, kv_heads, group, hd]), so K/V are read once per KV head, and
        both are copied once out of the strided pool into float32 (a few hundred KB per layer).
        """
        rows, kv_heads = q.shape[0], self.num_kv_heads
        grouped = q.reshape(rows, kv_heads, -1, self.head_dim).float()
        # Into fresh contiguous [R, kvh, n, hd] float32 buffers: `.float()` would keep the pool's
        # token-major strides, and matmul would then copy them once more (measured 1.8x slower).
        k32 = torch.empty(keys.shape, dtype=torch.float32, device=keys.device)
        k32.copy_(keys)
        v32 = torch.empty(values.shape, dtype=torch.float32, device=values.device)
        v32.copy_(values)
        scores = torch.matmul(grouped, k32.transpose(2, 3)).mul_(self.scale)  # [R, kvh, group, n]
        if mask is not None:
            scores.add_(mask)
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, v32).view(rows, -1, self.head_dim).to(q.dtype)
