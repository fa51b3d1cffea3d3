"""`--load-format dummy`: seeded random weights that two workers make alike, named so KV is shared exactly
between workers holding the same weights."""

from __future__ import annotations

import json

import torch

from xpyd.model.dummy_weights import dummy_identity, dummy_model
from xpyd.model.runner import ModelRunner
from xpyd.worker.engine import model_identity


def test_two_builds_make_the_same_weights_and_norms_are_near_one(tiny_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    a, b = dummy_model(config, torch.float32, "cpu"), dummy_model(config, torch.float32, "cpu")
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), name
        assert not x.requires_grad
    assert abs(float(a.model.norm.weight.mean()) - 1) < 0.05
    assert float(a.model.layers[0].self_attn.q_proj.weight.std()) < 1  # (initializer_range 0.5 in this config)
    assert not torch.equal(a.model.layers[0].self_attn.q_proj.weight[:4, :4], a.model.layers[1].self_attn.q_proj.weight[:4, :4])


def test_the_identity_names_config_dtype_and_device_kind(tiny_model_dir, tmp_path):
    runner = ModelRunner(tiny_model_dir, torch.float32, num_blocks=8, max_seq_len=64, load_format="dummy")
    assert model_identity(runner, "served") == runner.identity == dummy_identity(tiny_model_dir, torch.float32, "cpu")
    assert runner.identity.startswith("dummy:0:float32:cpu:")
    assert dummy_identity(tiny_model_dir, torch.bfloat16, "cpu") != runner.identity
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (other / "config.json").write_text(json.dumps(config))
    assert dummy_identity(other, torch.float32, "cpu") != runner.identity
    real = ModelRunner(tiny_model_dir, torch.float32, num_blocks=8, max_seq_len=64)
    assert real.identity is None and model_identity(real, "served").startswith("weights:")
