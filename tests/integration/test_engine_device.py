"""The engine's torch device: explicit CPU runs as before, every per-step tensor follows the device,
and a device this machine does not have is refused at startup (CPU only here; GPUs are untested).

'meta' tensors stand in for a GPU where a test needs a device that is not the CPU: they carry no data,
and mixing them with CPU tensors in an elementwise op raises, so the lean forward running end to end
on 'meta' shows it makes its per-step tensors (positions, slot indices, masks, rotary tables) there.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from xpyd.worker.config import WorkerConfig, add_worker_arguments, check_device, config_from_args
from xpyd.model.llama_fast import FastLlama
from xpyd.model.runner import ModelRunner

torch.set_num_threads(1)

NO_CUDA = not torch.cuda.is_available()


def test_explicit_cpu_device_gives_the_default_runner(tiny_model_dir):
    default = ModelRunner(tiny_model_dir, torch.float32, num_slots=2, max_seq_len=64)
    explicit = ModelRunner(tiny_model_dir, torch.float32, num_slots=2, max_seq_len=64, device=torch.device("cpu"))
    assert explicit.device == torch.device("cpu") and explicit.pool.device == torch.device("cpu")
    assert explicit.fast_path.device == torch.device("cpu")
    prompt = [1, 5, 9, 2, 7]
    for runner in (default, explicit):
        runner.slot = runner.pool.allocate()
    first = [r.prefill(r.slot, prompt) for r in (default, explicit)]
    assert torch.equal(first[0], first[1]) and first[1].device.type == "cpu"
    steps = [r.decode([r.slot], [3], [len(prompt)]) for r in (default, explicit)]
    assert torch.equal(steps[0], steps[1])
    explicit.use_fast_path(False)
    default.use_fast_path(False)
    steps = [r.decode([r.slot], [4], [len(prompt) + 1]) for r in (default, explicit)]
    assert torch.equal(steps[0], steps[1])


@pytest.mark.parametrize("attention", ["matmul", "sdpa"])
@pytest.mark.parametrize("slots", [[0], [0, 1, 2], [5, 1]])  # one request, the batched window, per request
def test_lean_forward_runs_on_a_non_cpu_device(tiny_model_dir, attention, slots):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16).eval().to("meta")
    fast = FastLlama(model, 64, torch.bfloat16, decode_attention=attention)
    assert fast.device.type == "meta" and fast.cos.device.type == "meta"
    assert all(lin.packed is None for lin in (fast.lm_head, fast.layers[0].qkv))  # oneDNN packing is CPU-only
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    pool = torch.zeros(8, 64, cfg.num_hidden_layers, 2, cfg.num_key_value_heads, head_dim, dtype=torch.bfloat16,
                       device="meta")
    with torch.inference_mode():
        logits = fast.prefill(pool[0, :6], torch.tensor([1, 2, 3, 4, 5, 6], device="meta"))
        assert logits.shape == (cfg.vocab_size,) and logits.device.type == "meta"
        positions = [6 + i for i in range(len(slots))]
        logits = fast.decode(pool, slots, positions, torch.tensor([7] * len(slots), device="meta"))
    assert logits.shape == (len(slots), cfg.vocab_size) and logits.device.type == "meta"
    with pytest.raises(ValueError, match="CPU-only"):
        FastLlama(model, 64, torch.bfloat16, pack=True)


def test_device_names_are_checked():
    assert WorkerConfig("decode").device == "cpu"
    for role in ("prefill", "decode", "colocated"):
        p = argparse.ArgumentParser()
        add_worker_arguments(p, role)
        assert config_from_args(p.parse_args([]), role).device == "cpu"
        assert config_from_args(p.parse_args(["--device", "cpu"]), role).device == "cpu"
    for bad in ("gpu", "cuda:", "cuda:-1", "cuda:x", "CPU", "cuda:0,1", "mps"):
        with pytest.raises(ValueError, match="--device must be cpu, cuda or cuda:N"):
            WorkerConfig("decode", device=bad)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:1"])
def test_cuda_is_refused_without_cuda(device):
    with pytest.raises(ValueError, match=rf"--device {device}: CUDA is not available on this machine"):
        WorkerConfig("prefill", device=device)


def test_cuda_index_checks_when_cuda_is_there(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_device("cuda:1") == "cuda:1"
    with pytest.raises(ValueError, match="has 2 CUDA device"):
        check_device("cuda:2")
    # nixl registers a GPU pool itself (VRAM; untested here), so the config takes it
    assert WorkerConfig("decode", device="cuda", kv_backend="nixl").kv_backend == "nixl"
    assert WorkerConfig("decode", device="cuda", kv_backend="auto").device == "cuda"


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_worker_with_cuda_fails_at_startup_with_a_clear_message():
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    argv = ["decode", "--device", "cuda", "--port", "1"]
    out = subprocess.run([sys.executable, "-c", f"import sys; from xpyd.cli import main; sys.exit(main({argv!r}))"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0
    assert "--device cuda: CUDA is not available on this machine" in out.stderr
    assert "Traceback" not in out.stderr
