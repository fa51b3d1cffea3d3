"""What `GgufFacts` passes on to the conversion for Gemma, from a GGUF's metadata alone (no tensors): gemma2's
soft-caps, and query_pre_attn_scalar by llama.cpp's rule (the 27B models, known by their layer count: hidden /
heads; every other: the head size), for the released models' shapes."""

from __future__ import annotations

import pytest

from xpyd.model.gguf_facts import GgufFacts


def _metadata_only(path, arch: str, layers: int, hidden: int, heads: int, head_dim: int, caps=()):
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_head_count(heads)
    writer.add_key_length(head_dim)
    if caps:
        writer.add_attn_logit_softcapping(caps[0])
        writer.add_final_logit_softcapping(caps[1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch,layers,hidden,heads,head_dim,scalar", [
    ("gemma2", 26, 2304, 8, 256, 256),  # Gemma 2 2B
    ("gemma2", 42, 3584, 16, 256, 256),  # 9B
    ("gemma2", 46, 4608, 32, 128, 144),  # 27B
    ("gemma3", 26, 1152, 4, 256, 256),  # Gemma 3 1B
    ("gemma3", 62, 5376, 32, 128, 168),  # 27B
])
def test_gemma_query_scale_follows_llama_cpps_rule(tmp_path, arch, layers, hidden, heads, head_dim, scalar):
    path = _metadata_only(tmp_path / "m.gguf", arch, layers, hidden, heads, head_dim)
    assert GgufFacts.read(path).config_overrides()["query_pre_attn_scalar"] == scalar


def test_gemma2_soft_caps_are_passed_on_as_floats(tmp_path):
    path = _metadata_only(tmp_path / "m.gguf", "gemma2", 42, 3584, 16, 256, caps=(50.0, 30.0))
    overrides = GgufFacts.read(path).config_overrides()
    assert overrides["attn_logit_softcapping"] == 50.0 and overrides["final_logit_softcapping"] == 30.0
    assert isinstance(overrides["final_logit_softcapping"], float)


def test_other_architectures_get_no_query_scale(tmp_path):
    path = _metadata_only(tmp_path / "m.gguf", "qwen3", 2, 64, 4, 32)
    assert GgufFacts.read(path).config_overrides() == {"head_dim": 32}
