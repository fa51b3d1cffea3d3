"""Forward passes for Llama-family models over the preallocated, paged KV pool (the families: `families`).

The Hugging Face model supplies the weights and the per-token submodules (embeddings, projections,
norms, MLP, rotary embedding, lm_head); attention is ours: each layer writes the new K/V in place
into the request's blocks, then attends over that request's tokens only, read through its block
table (multi-head latent attention, DeepSeek-V2's: one latent per token and layer instead, `latent_attention`).
No DynamicCache, so the pool stays the single copy of every request's KV. The caller owns the
block tables (which blocks a request holds, shared prefix blocks included); a prefill may start after a
cached prefix (``start``), computing only the rest. The runner checks every batch, then runs it through the
lean forward (`llama_fast`) when it covers the model, else the general path (`general_path`: the transformers
modules, latent attention included); on CUDA, decode steps through the paged kernels (`gpu.decoder`).

Weights, pool and every per-step tensor live on one torch device (`device`, CPU by default); the
logits come back on the CPU, where sampling runs (one copy per step on another device, none on CPU).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from xpyd.model import batch_checks, families, kv_int8, kv_quant, kv_rotation, latent_attention, paged
from xpyd.model.block_tables import BlockTables
from xpyd.model.dummy_weights import LOAD_FORMATS, dummy_identity, dummy_model
from xpyd.model.general_path import GeneralPath
from xpyd.model.kv_layout import ROW_SCALE_BYTES, ROW_SCALED
from xpyd.model.kv_pool import ELEMENT_BYTES, KVLayout, KVPool, dtype_name
from xpyd.model.kv_quant import KVCodec
from xpyd.model.lean_cover import why_not_covered
from xpyd.model.llama_fast import FastLlama
from xpyd.model.logprobs import ScoreSpec, TokenLogprob, check_scores
from xpyd.model.logprobs_torch import prompt_logprobs
from xpyd.model.sampling import TorchSampler

SUPPORTED_MODEL_TYPES = families.SUPPORTED_MODEL_TYPES
UnsupportedModel = families.UnsupportedModel


class CoreShare(Protocol):
    """How many threads a forward pass may use right now, when workers share a host's cores (the
    worker runtime's `cpu_share.CpuShare` is the real one): ``hold`` before each layer, ``mark_busy``
    when the pass ended."""

    def hold(self) -> None: ...
    def threads(self) -> int: ...
    def mark_busy(self) -> None: ...


def _released(forward):
    """After a forward pass (or its failure), turn the CPU board's hold into an ordinary recent mark."""

    @functools.wraps(forward)
    def run(self, *args, **kwargs):
        try:
            return forward(self, *args, **kwargs)
        finally:
            if self.cpu_share is not None:
                self.cpu_share.mark_busy()

    return run


class ModelRunner:
    def __init__(self, model_dir: Path, dtype: torch.dtype, num_blocks: int | Callable[["ModelRunner"], int],
                 max_seq_len: int, block_size: int = 16, device: torch.device | str = "cpu", caching: bool = True,
                 load_format: str = "auto", max_batch: int = 8, cuda_graphs: bool = True,
                 kv_cache_dtype: str = "auto") -> None:
        """``num_blocks``: the KV pool's size, or a function of the loaded runner (its weights on the device)
        that says it (``--gpu-memory-utilization``: `xpyd.model.gpu.memory`). ``load_format``: "auto" (the
        folder's safetensors) or "dummy" (seeded random weights made on the device: `dummy_weights`).
        On CUDA, decode steps of up to ``max_batch`` requests run the paged kernels, in CUDA graphs when
        ``cuda_graphs`` (`xpyd.model.gpu.decoder`), and sampling runs on the device. ``kv_cache_dtype``: "auto"
        (the pool in ``dtype``) or an fp8 format (`kv_quant`: scales from a calibration pass here; CPU only)."""
        config = AutoConfig.from_pretrained(str(model_dir))
        max_model_len = min(max_seq_len, config.max_position_embeddings)
        families.check_supported(config, max_model_len)
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load format must be one of {LOAD_FORMATS}, not {load_format!r}")
        self.config = config
        self.device = torch.device(device)
        self._on_cpu = self.device.type == "cpu"
        self.identity: str | None = None  # what names the weights when the folder's files do not (dummy)
        if load_format == "dummy":
            self.model = dummy_model(config, dtype, self.device)
            self.identity = dummy_identity(Path(model_dir), dtype, self.device)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
            if not self._on_cpu:
                self.model.to(self.device)
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.vocab_size: int = self.model.lm_head.out_features
        self.eos_token_ids: frozenset[int] = _eos_ids(self.model)
        self.sampler = TorchSampler()  # logits -> tokens, as the role engines ask (one draw per sampled token)

        self._general = GeneralPath(self.model, config, self.device, block_size, self._pace)
        self._embed = self._general.embed
        self.block_size = block_size
        # The lean forward (llama_fast) when it covers the model; the general path below otherwise.
        self.fast_path_reason: str | None = why_not_covered(self.model)
        self._fast: FastLlama | None = None
        if self.fast_path_reason is None:
            self._fast = FastLlama(self.model, max_model_len, dtype)
        self._use_fast = self._fast is not None
        self._general_path = True  # the transformers modules still hold their weights
        self.decoder = None  # the CUDA decode steps (xpyd.model.gpu.decoder), when they run here
        self.decoder_reason: str | None = "not a CUDA device" if self.device.type != "cuda" else None
        if self.device.type == "cuda" and self._fast is not None:
            _drop_fused_copies(self.model)  # (the lean forward holds the fused weights: one copy on the device)
            self._general_path = False
            torch.cuda.empty_cache()
        layout = self._general.pool_layout(dtype_name(dtype), block_size)
        self.cpu_share: CoreShare | None = None  # set by the worker when roles share this host's cores
        self.kv_codec: KVCodec | None = None  # an fp8 pool's scales, codes <-> values
        if kv_cache_dtype != "auto":
            if self._general.latent is not None and kv_cache_dtype != kv_int8.FORMAT:
                raise ValueError(f"an fp8 KV cache is not supported for latent attention ({config.model_type}: "
                                 "its scales are per KV head); use --kv-cache-dtype int8 or auto")
            if kv_cache_dtype == kv_int8.FORMAT:  # (a scale in every row: nothing to calibrate)
                per_head = layout.kind == "kv"  # (latents are not rotated: `kv_rotation`)
                self.kv_codec = kv_int8.Int8RowCodec(dtype, kv_rotation.rotation(layout.head_dim) if per_head else None)
                layout = dataclasses.replace(layout, dtype=kv_cache_dtype)
            else:
                self.kv_codec = kv_quant.calibrate(kv_cache_dtype, layout, self.device, dtype, max_model_len,
                                                   self.vocab_size, getattr(config, "bos_token_id", None),
                                                   self._calibration_prefill)
                layout = dataclasses.replace(layout, dtype=kv_cache_dtype, scales=self.kv_codec.scales.digest())
            if self._fast is not None:
                self._fast.kv_codec = self.kv_codec
        self._layout_template = layout
        if callable(num_blocks):
            num_blocks = num_blocks(self)
        self.pool = KVPool(layout.with_blocks(num_blocks), device=self.device, caching=caching)
        self._threads = torch.get_num_threads()
        if self._fast is not None:
            self._fast.on_layer = self._pace
        if self.device.type == "cuda":
            self._start_cuda(max_batch, cuda_graphs)

    def _start_cuda(self, max_batch: int, cuda_graphs: bool) -> None:
        """Sampling on the device; decode steps through the paged kernels (in graphs) when they run here."""
        from xpyd.model.gpu.sampler import DeviceSampler

        self.sampler = DeviceSampler()
        if self._fast is None:
            self.decoder_reason = f"the lean forward does not cover this model: {self.fast_path_reason}"
            return
        if self._fast.experts:  # (their routing's shapes depend on the data: no CUDA graphs)
            self.decoder_reason = "the paged decode step does not run mixtures of experts (the lean forward does)"
            return
        from xpyd.model.gpu import paged_attention
        from xpyd.model.gpu.decoder import PagedDecoder

        reason = paged_attention.why_unavailable(self.device)
        if reason is not None:
            self.decoder_reason = reason
            return
        self.decoder = PagedDecoder(self._fast, self.pool.tensor, self.pool.layout.blocks_for(self.max_model_len),
                                    max_batch, graphs=cuda_graphs)

    def _calibration_prefill(self, scratch: KVPool, ids: list[int]) -> None:
        """Prefill the fp8 calibration prompt into ``scratch``, the pool until this returns (`kv_quant.calibrate`)."""
        self.pool = scratch
        self.prefill(scratch.blocks.allocate(scratch.layout.num_blocks), ids)
        del self.pool

    @property
    def layout_template(self) -> KVLayout:
        """The pool's layout with one block: what sizes a pool before it exists (`num_blocks` callables)."""
        return self._layout_template

    def _pace(self) -> None:
        """Before each layer: tell the host's other workers we are busy; take the cores they leave idle."""
        share = self.cpu_share
        if share is None:
            return
        share.hold()  # busy until the forward pass ends (`_released`), however long this layer takes
        threads = share.threads()
        if threads != self._threads:
            torch.set_num_threads(threads)
            self._threads = threads

    @property
    def fast_path_active(self) -> bool:
        return self._use_fast

    @property
    def fast_path(self) -> FastLlama | None:
        """The lean forward, when it covers the model (its knobs, e.g. `decode_attention`, are settable)."""
        return self._fast

    def use_fast_path(self, enabled: bool) -> None:
        """Switch between the lean forward and the general (HF-module) path, e.g. to compare them."""
        if enabled and self._fast is None:
            raise ValueError(f"the fast path does not cover this model: {self.fast_path_reason}")
        if not enabled and not self._general_path:
            raise ValueError("the general path's weights were freed (on CUDA the lean forward holds the only copy)")
        self._use_fast = enabled

    def prefill(self, blocks: list[int], token_ids: list[int], start: int = 0) -> torch.Tensor:
        """Run the prompt ``token_ids`` from position ``start`` on (the K/V of [0, start) are already in
        ``blocks``), writing the K/V of [start, n) into ``blocks``; float32 logits [vocab] of the last token.

        The blocks of [start, n) must be the request's own: held, and by no other request (a shared block
        is another request's prefix too). ValueError, and nothing written, for a bad table or start.
        A chunk of a longer prompt is its tokens so far: ``token_ids`` up to the chunk's end, ``start`` at
        the end of the chunks before it."""
        return self.prefill_many([(blocks, token_ids, start)])[0]

    @torch.inference_mode()
    @_released
    def prefill_many(self, parts: list[tuple[list[int], list[int], int]]) -> torch.Tensor:
        """Several requests' prompts (or chunks of them) in one forward pass: each part is
        (blocks, token_ids, start) as in `prefill`; float32 logits [parts, vocab] of each part's last token.
        The fast path packs every part's tokens into one batch for the matmuls; the general path runs the
        parts one after another. Every part is checked before anything is written."""
        tables = batch_checks.prefill_parts(self.pool.layout, self.pool.blocks, self.max_model_len, parts)
        checked = [(t, self._ids(token_ids[start:]), start) for t, (_, token_ids, start) in zip(tables, parts)]
        if self._use_fast:
            return self._fast.prefill_many(self.pool.tensor, checked)  # (on the device: sampled there)
        return torch.stack([self._general.logits(self._general_hidden(*part)[:, -1])[0] for part in checked])

    @torch.inference_mode()
    @_released
    def prefill_scored(
        self, parts: list[tuple[list[int], list[int], int]], scores: list[ScoreSpec | None]
    ) -> tuple[torch.Tensor, list[list[TokenLogprob] | None]]:
        """`prefill_many`, and the prompt logprobs ``scores`` asks (`xpyd.model.logprobs`): for part i with
        ``(targets, k)``, position start + j scored against targets[j] (top k), from the same final hidden
        states as the part's last row, `logprobs_torch.PROMPT_SLICE` positions at a time; None for a part
        without. Returns prefill_many's rows too. Every part and score is checked before anything is written."""
        specs = check_scores(parts, scores, self.vocab_size)
        tables = batch_checks.prefill_parts(self.pool.layout, self.pool.blocks, self.max_model_len, parts)
        checked = [(t, self._ids(token_ids[start:]), start) for t, (_, token_ids, start) in zip(tables, parts)]
        if self._use_fast:
            fast = self._fast
            hidden = fast.prefill_hidden(self.pool.tensor, checked)  # [all parts' new tokens, hidden]
            rows = fast.logits(hidden[fast.last_rows(checked)])
            states, offset = [], 0
            for _, ids, _ in checked:
                states.append(hidden[offset : offset + ids.shape[0]])
                offset += ids.shape[0]
            logits_of = fast.logits
        else:
            states = [self._general_hidden(*part)[0] for part in checked]  # each [new tokens, hidden]
            rows = torch.stack([self._general.logits(h[-1:])[0] for h in states])
            logits_of = self._general.logits
        scored = [None if spec is None else prompt_logprobs(logits_of, h, *spec) for h, spec in zip(states, specs)]
        return rows, scored

    def _general_hidden(self, blocks: list[int], ids: torch.Tensor, start: int) -> torch.Tensor:
        """The general path's forward pass of one checked part up to the final norm: [1, new tokens, hidden]."""
        pool = self.pool.tensor
        return self._general.hidden(pool, self.pool.layout.blocks_for, self._codec_of(pool), blocks, ids, start)

    @torch.inference_mode()
    @_released
    def decode(self, tables: list[list[int]], token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """One step for a batch: token i sits at positions[i] of the request whose blocks are tables[i]
        and attends over [0, positions[i]].

        Positions [0, positions[i]) of each request must already hold KV; the block of positions[i] must be
        the request's own (held by it alone), and no two requests write one row. Returns float32 logits
        [B, vocab]; ValueError, and nothing written, for a bad batch.
        """
        tables = batch_checks.decode_batch(self.pool.layout, self.pool.blocks, self.max_model_len, tables, token_ids,
                                           positions)
        if self.decoder is not None:
            self._ids(token_ids, upload=False)  # (the range check; the decoder uploads the ids with the step)
            return self.decoder.step(tables, positions, token_ids)
        width = self.pool.layout.blocks_for(max(positions) + 1)
        return self._decode(paged.padded_tables(tables, width, self.device), token_ids, positions)

    @torch.inference_mode()
    @_released
    def decode_rows(self, tables: BlockTables, rows: list[int], token_ids: list[int],
                    positions: list[int]) -> torch.Tensor:
        """`decode` for requests whose blocks are kept in ``tables`` (this pool's): request i's are row
        rows[i]. The rows the step needs are read in one gather (a zero-copy view of the tables), and the
        checks are O(batch) (`batch_checks.decode_rows`); the same guarantees as `decode`."""
        batch_checks.decode_rows(self.pool.layout, self.pool.blocks, self.max_model_len, tables, rows, token_ids,
                                 positions)
        width = self.pool.layout.blocks_for(max(positions) + 1)
        kept = np.frombuffer(tables.data, dtype=np.int32).reshape(tables.capacity, tables.width)
        gathered = kept[rows, :width]  # [B, width] int32, a copy
        if self.decoder is not None:
            self._ids(token_ids, upload=False)
            return self.decoder.step(gathered, positions, token_ids)
        padded = torch.from_numpy(gathered.astype(np.int64))
        return self._decode(padded if self._on_cpu else padded.to(self.device), token_ids, positions)

    def _decode(self, tables: torch.Tensor, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """A checked batch, its block tables int64 [B, blocks of the longest request] on the device."""
        if self._use_fast:
            return self._fast.decode_tables(self.pool.tensor, tables, positions, self._ids(token_ids))
        pool = self.pool.tensor
        return self._general.decode(pool, self.pool.layout.blocks_for, self._codec_of(pool), tables,
                                    self._ids(token_ids), positions)

    def _codec_of(self, pool: torch.Tensor) -> KVCodec | None:
        return self.kv_codec if pool.dtype == torch.uint8 else None

    def warmup(self) -> None:
        """One tiny prefill + decode so the first real request does not pay for lazy initialisation."""
        blocks = self.pool.blocks.allocate(self.pool.layout.blocks_for(5))
        try:
            self.prefill(blocks, [0, 1, 2, 3])
            self.decode([blocks], [4], [4])
        finally:
            self.pool.blocks.release(blocks)

    def _ids(self, token_ids: list[int], upload: bool = True) -> torch.Tensor:
        """Token ids on the runner's device, checked on the CPU first (no device sync for the check)."""
        ids = torch.tensor(token_ids, dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self._embed.num_embeddings):
            raise ValueError(f"token id outside the vocabulary [0, {self._embed.num_embeddings})")
        return ids if self._on_cpu or not upload else ids.to(self.device)


def _drop_fused_copies(model) -> None:
    """Free the transformers modules' own copies of the weights the lean forward fused (q/k/v, gate/up,
    o, down, or a model's own fused qkv_proj / gate_up_proj): on a GPU a second copy would cost memory the
    KV cache needs. The general path is gone after."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        modules = [getattr(owner, name) for owner, names in (
            (attn, ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")),
            (mlp, ("gate_proj", "up_proj", "gate_up_proj", "down_proj"))) for name in names if hasattr(owner, name)]
        for module in modules:
            module.weight = torch.nn.Parameter(torch.empty(0, dtype=module.weight.dtype, device=module.weight.device),
                                               requires_grad=False)


def kv_token_bytes(model_dir: Path, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one token's KV for the model in ``model_dir`` (to size a pool before loading the weights),
    in ``dtype`` or the ``kv_cache_dtype`` that is not "auto"."""
    config = AutoConfig.from_pretrained(str(model_dir))
    families.check_model_type(config)  # (before reading the attention's shape, which another type may lack)
    if families.is_latent(config):
        kv = dtype_name(dtype) if kv_cache_dtype == "auto" else kv_cache_dtype
        return latent_attention.LatentShape.of(config).layout(config.num_hidden_layers, kv, 1, 1).token_bytes
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    elem = torch.empty((), dtype=dtype).element_size() if kv_cache_dtype == "auto" else ELEMENT_BYTES[kv_cache_dtype]
    row = head_dim + (ROW_SCALE_BYTES if kv_cache_dtype in ROW_SCALED else 0)  # (an int8 row ends in its scale)
    return config.num_hidden_layers * 2 * config.num_key_value_heads * row * elem


def _eos_ids(model) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
