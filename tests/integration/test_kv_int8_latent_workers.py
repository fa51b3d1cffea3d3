"""int8 KV for DeepSeek's multi-head latent attention through real worker processes (a file of its own: the
suite's two pytest processes take files, and the quantized-KV worker tests together are one of its longest)."""

from __future__ import annotations

from pathlib import Path

from tests.integration.test_kv_fp8_workers import _pd_against_colocated


def test_int8_latents_prefill_to_decode_give_the_colocated_tokens(tmp_path: Path, smollm_dir: Path):
    """DeepSeek's multi-head latent attention on an int8 pool: each latent row (the compressed KV and the rotary
    key part) moves with its own scale, 1 byte per value and 2 for the scale, and decode answers as a colocated
    worker on the same int8 latents does."""
    import torch
    from transformers import AutoTokenizer

    from tests.families import save_tiny

    tokenizer = AutoTokenizer.from_pretrained(str(smollm_dir))
    torch.manual_seed(0)
    model = save_tiny("deepseek_v2", tmp_path / "model", len(tokenizer), max_positions=256, tokenizer=tokenizer)
    c = model.config
    (tmp_path / "pd").mkdir()
    (tmp_path / "co").mkdir()
    _pd_against_colocated(tmp_path, tmp_path / "model", ["--kv-cache-dtype", "int8"],
                          c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim + 2),
                          # (latent attention runs torch's attention: its bfloat16 bits depend on the chunks, and
                          # int8 codes amplify that; both sides compute whole prompts here)
                          prefill_chunk=None)
