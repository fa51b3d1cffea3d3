"""Shared fixtures: the converted default model and a random tiny Llama with the same tokenizer."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported: 2 shared cores
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # as xpyd.discovery does, before any grpc import
# NIXL agents made by tests (and the workers they start) reach each other over loopback: tests/multihost adds
# and removes a veth in this namespace while other test files run, and an agent whose metadata names an
# interface gone since cannot be connected to (tests/integration/test_transfer_nixl_stale_interface.py)
os.environ.setdefault("UCX_NET_DEVICES", "lo")

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF safetensors folder (converted from the wheel's GGUF once, cached)."""
    from xpyd.model.loader import ensure_converted

    return ensure_converted(None, progress=False).path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    """A random 2-layer Llama (hidden 64, 4 heads, 2 KV heads) with the SmolLM2 tokenizer.

    initializer_range=0.5 so its outputs depend on the context: with the usual 0.02 every token
    predicts the same thing and a corrupted KV cache would go unnoticed.
    """
    return _tiny_llama(tmp_path_factory, smollm_dir, max_positions=512)


@pytest.fixture(scope="session")
def tiny_long_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    """The same tiny Llama with a 4,096-token context, for long prompts."""
    return _tiny_llama(tmp_path_factory, smollm_dir, max_positions=4096)


def _tiny_llama(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path, max_positions: int) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(smollm_dir))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        initializer_range=0.5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
