"""A lean forward pass for Llama-family models (llama, mistral, qwen2) over the KV pool.

Same math as transformers' modules, with less per-step work:
- fused QKV and gate/up weights (concatenated once at load), called through `F.linear` on plain
  tensors instead of module `forward`s; in bfloat16, through oneDNN with weights prepacked once
  (about 2x faster than `F.linear` for these small GEMVs on AVX-512-bf16 CPUs);
- rotary cos/sin tables built once by the model's own rotary module, indexed by position per step,
  applied to q and k in one go;
- K/V written in place into the pool; attention over each request's live tokens only.

float32 stays on `F.linear` so its results follow transformers' (the token-for-token tests).
It runs on the device of the model's weights: every tensor it makes per step is made there, and off
the CPU it uses plain `F.linear` (the oneDNN prepacking is CPU-only).
Models it does not cover (`why_not_covered`) keep the general path in `ModelRunner`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xpyd.model import native


def why_not_covered(model) -> str | None:
    """None when `FastLlama` can run this model exactly like transformers; otherwise the reason."""
    config = model.config
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r} (only silu)"
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None:
        return "no shared rotary embedding"
    rope_type = str(getattr(rotary, "rope_type", "default"))
    if "dynamic" in rope_type or "longrope" in rope_type:
        return f"rope type {rope_type!r} depends on the sequence length"
    if not _is_rms_norm(inner.norm):
        return "final norm is not RMSNorm"
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not isinstance(getattr(attn, name, None), torch.nn.Linear):
                return f"attention without a plain {name}"
        for name in ("gate_proj", "up_proj", "down_proj"):
            if not isinstance(getattr(mlp, name, None), torch.nn.Linear):
                return f"MLP without a plain {name}"
        if any(hasattr(attn, name) for name in ("q_norm", "k_norm")):
            return "q/k norms"
        if not (_is_rms_norm(layer.input_layernorm) and _is_rms_norm(layer.post_attention_layernorm)):
            return "layer norms are not RMSNorm"
        if getattr(attn, "sliding_window", None) is not None:
            return "sliding-window attention"
    return None


def _is_rms_norm(module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


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
    __slots__ = ("ln1", "eps1", "qkv", "o", "ln2", "eps2", "gate_up", "down")

    def __init__(self, layer, pack: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1 = layer.input_layernorm.weight.detach()
        self.eps1 = layer.input_layernorm.variance_epsilon
        self.qkv = _Linear(*_fuse([attn.q_proj, attn.k_proj, attn.v_proj]), pack)
        self.o = _Linear(attn.o_proj.weight.detach(), _detach(attn.o_proj.bias), pack)
        self.ln2 = layer.post_attention_layernorm.weight.detach()
        self.eps2 = layer.post_attention_layernorm.variance_epsilon
        self.gate_up = _Linear(*_fuse([mlp.gate_proj, mlp.up_proj]), pack)
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
        self.on_layer = _nothing  # called before every layer (the runner's CPU pacing)
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
            linears = [lin for l in self.layers for lin in (l.qkv, l.o, l.gate_up, l.down)] + [self.lm_head]
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

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        gate, up = layer.gate_up(self._norm(x, layer.ln2, layer.eps2)).chunk(2, dim=-1)
        return x + layer.down(F.silu(gate).mul_(up))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self._norm(x, self.norm, self.norm_eps)).float()

    def prefill(self, kv: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """ids [n]; kv = pool[slot, :n] (written in place). Returns float32 logits [vocab] of the last token."""
        n, nh, nkv, hd = ids.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(ids, self.embed)  # [n, hidden]
        cos, sin = self.cos[:n], self.sin[:n]
        for index, layer in enumerate(self.layers):
            self.on_layer()
            qkv = layer.qkv(self._norm(x, layer.ln1, layer.eps1)).view(n, nh + 2 * nkv, hd)
            qk = self._rope(qkv, cos, sin)
            kv[:, index, 0] = qk[:, nh:]
            kv[:, index, 1] = qkv[:, nh + nkv :]
            attn = F.scaled_dot_product_attention(
                qk[:, :nh].transpose(0, 1).unsqueeze(0),
                kv[:, index, 0].transpose(0, 1).unsqueeze(0),
                kv[:, index, 1].transpose(0, 1).unsqueeze(0),
                is_causal=True, scale=self.scale, enable_gqa=True,
            )  # [1, heads, n, hd]
            x = x + layer.o(attn[0].transpose(0, 1).reshape(n, nh * hd))
            x = self._mlp(layer, x)
        return self.logits(x[-1:])[0]

    def decode(self, pool: torch.Tensor, slots: list[int], positions: list[int], ids: torch.Tensor) -> torch.Tensor:
        """One token per request: ids[i] at positions[i] of slots[i]. Returns float32 logits [B, vocab]."""
        batch, nh, nkv, hd = len(slots), self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(ids, self.embed)  # [B, hidden]
        pos_t = torch.tensor(positions, device=self.device)
        cos, sin = self.cos[pos_t], self.sin[pos_t]
        attend = self._attention_plan(pool, slots, positions, pos_t)
        for index, layer in enumerate(self.layers):
            self.on_layer()
            qkv = layer.qkv(self._norm(x, layer.ln1, layer.eps1)).view(batch, nh + 2 * nkv, hd)
            qk = self._rope(qkv, cos, sin)
            attn = attend(index, qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :])  # [B, heads, hd]
            x = x + layer.o(attn.reshape(batch, nh * hd))
            x = self._mlp(layer, x)
        return self.logits(x)

    def _attention_plan(self, pool, slots, positions, pos_t):
        """A function (layer, q, k_new, v_new) -> attention output [B, heads, hd] that also writes k/v
        into the pool.

        With the native kernel: one call per layer (it writes k/v and reads each slot's live K/V in place).
        Otherwise batched when the batch's slots sit close together: one attention over the window of slots
        [lo, hi) and positions [0, longest), each row masked to its own live length (rows of slots
        outside the batch attend to their position 0 and are dropped). Otherwise one attention per
        request over a view of its live KV. Either way the pool is only read, never rearranged.
        """
        batch = len(slots)
        if self._decode_attention == "kernel":
            return self._kernel_plan(pool, slots, positions)
        lo, hi = min(slots), max(slots) + 1
        live_total = sum(positions) + batch
        # The window costs rows x longest; per request costs only the live tokens. One long prompt among
        # short streams made the window read (and copy) ~5x the KV it needed: 189 ms steps instead of ~60.
        if batch == 1 or hi - lo > 2 * batch or (hi - lo) * (max(positions) + 1) > 2 * live_total:
            live = [pool[s, : p + 1].permute(1, 2, 3, 0, 4) for s, p in zip(slots, positions)]
            new = [pool[s, p] for s, p in zip(slots, positions)]  # [layers, 2, kv_heads, hd]
            attend_one = self._matmul_attention if self.decode_attention == "matmul" else self._sdpa_attention

            def per_request(index, q, k_new, v_new):
                outs = []
                for i in range(batch):
                    slot_kv = new[i][index]
                    slot_kv[0].copy_(k_new[i])
                    slot_kv[1].copy_(v_new[i])
                    keys, values = live[i][index]  # [kv_heads, n, hd] each
                    outs.append(attend_one(q[i : i + 1], keys.unsqueeze(0), values.unsqueeze(0), None))
                return torch.cat(outs) if batch > 1 else outs[0]

            return per_request

        rows_n, length = hi - lo, max(positions) + 1
        window = pool[lo:hi, :length]  # [rows, length, layers, 2, kv_heads, hd]
        slot_t = torch.tensor(slots, device=self.device)
        in_order = slots == list(range(lo, hi))
        rows = slot_t - lo
        row_pos = torch.zeros(rows_n, dtype=torch.long, device=self.device)
        row_pos[rows] = pos_t
        mask = (torch.arange(length, device=self.device) <= row_pos.unsqueeze(1)).view(rows_n, 1, 1, length)
        if self.decode_attention == "matmul":
            attend_rows = self._matmul_attention
            # additive, float32
            mask = torch.zeros(mask.shape, device=self.device).masked_fill_(~mask, float("-inf"))
        else:
            attend_rows = self._sdpa_attention

        def windowed(index, q, k_new, v_new):
            pool[slot_t, pos_t, index, 0] = k_new
            pool[slot_t, pos_t, index, 1] = v_new
            if not in_order:
                padded = q.new_zeros((rows_n, *q.shape[1:]))
                padded[rows] = q
                q = padded
            out = attend_rows(q, window[:, :, index, 0].transpose(1, 2), window[:, :, index, 1].transpose(1, 2), mask)
            return out if in_order else out[rows]

        return windowed

    def _kernel_plan(self, pool, slots, positions):
        if pool.dtype != torch.bfloat16 or pool.device.type != "cpu":
            raise ValueError(f"the native decode attention needs a bfloat16 CPU pool, not {pool.dtype} on {pool.device}")
        for slot, pos in zip(slots, positions):  # the kernel writes at (slot, pos): keep it inside the pool
            if not (0 <= slot < pool.shape[0] and 0 <= pos < pool.shape[1]):
                raise ValueError(f"slot {slot} position {pos} outside the pool {tuple(pool.shape[:2])}")
        slot_t = torch.tensor(slots, dtype=torch.int64)
        lens_t = torch.tensor(positions, dtype=torch.int64).add_(1)
        out = torch.empty((len(slots), self.num_heads, self.head_dim), dtype=torch.bfloat16)
        kernel, scale = self._kernel, self.scale

        def native_attention(index, q, k_new, v_new):
            # `out` is reused by every layer: o_proj has consumed the previous layer's before this call
            return kernel(q, k_new, v_new, pool, index, slot_t, lens_t, scale, out)

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
