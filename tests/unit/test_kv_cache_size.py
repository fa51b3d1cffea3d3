"""The KV cache's size as a user gives it: ``--kv-cache-memory SIZE`` (bytes, with units) or
``--kv-cache-tokens N``, through the workers' real argument parser, down to the pool's block count."""

from __future__ import annotations

import argparse

import pytest

from xpyd.worker.config import WorkerConfig, add_worker_arguments, config_from_args, parse_bytes

TOKEN_BYTES = 46_080  # SmolLM2-135M, float32: 30 layers x 2 (K, V) x 3 KV heads x 64 x 4 bytes


@pytest.mark.parametrize("text, value", [
    ("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("1000000", 1_000_000),
    ("64kib", 64 << 10), (" 3 MiB ", 3 << 20), ("1g", 10**9),
])
def test_sizes_with_units(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "2 GiBs", "-1GiB", "0", "0.0001", "1e9", "2TiB", "two"])
def test_sizes_that_are_not_sizes_are_refused_with_an_example(text):
    with pytest.raises(argparse.ArgumentTypeError, match="size"):
        parse_bytes(text)


def _config(role: str, *argv: str):
    parser = argparse.ArgumentParser(prog=f"xpyd {role}")
    add_worker_arguments(parser, role)
    return config_from_args(parser.parse_args(list(argv)), role)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_kv_cache_memory_sets_the_pool_in_whole_blocks(role):
    cfg = _config(role, "--kv-cache-memory", "64MiB", "--max-model-len", "512")
    assert cfg.kv_cache_memory == 64 << 20
    blocks = cfg.kv_blocks(TOKEN_BYTES)
    assert blocks == (64 << 20) // TOKEN_BYTES // cfg.block_size  # 1,456 tokens -> 91 blocks of 16
    assert blocks * cfg.block_size * TOKEN_BYTES <= 64 << 20


def test_kv_cache_memory_too_small_for_one_request_is_refused():
    cfg = _config("decode", "--kv-cache-memory", "1MiB", "--max-model-len", "512")  # 22 tokens
    with pytest.raises(ValueError, match="cannot hold one request of --max-model-len 512"):
        cfg.kv_blocks(TOKEN_BYTES)


def test_kv_cache_memory_and_tokens_together_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        _config("decode", "--kv-cache-memory", "64MiB", "--kv-cache-tokens", "4096")
    assert e.value.code == 2 and "not allowed with argument --kv-cache-memory" in capsys.readouterr().err
    with pytest.raises(ValueError, match="once, not --kv-cache-tokens and --kv-cache-memory"):  # the config too
        WorkerConfig(role="decode", kv_cache_memory=64 << 20, kv_cache_tokens=4096)


def test_gpu_memory_utilization_is_a_cuda_size_alone(capsys):
    with pytest.raises(SystemExit) as e:
        _config("decode", "--kv-cache-tokens", "4096", "--gpu-memory-utilization", "0.4")
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(ValueError, match="on a CUDA device: --device cuda"):
        WorkerConfig(role="decode", gpu_memory_utilization=0.4)
    with pytest.raises(ValueError, match="once, not --kv-cache-memory and --gpu-memory-utilization"):
        WorkerConfig(role="decode", kv_cache_memory=1 << 20, gpu_memory_utilization=0.4)
    with pytest.raises(ValueError, match="--load-format must be one of"):
        WorkerConfig(role="decode", load_format="pt")


def test_a_bad_size_on_the_command_line_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        _config("prefill", "--kv-cache-memory", "lots")
    assert e.value.code == 2 and "not a size: 'lots'" in capsys.readouterr().err


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_kv_cache_dtype_is_checked_at_startup(role, capsys):
    assert _config(role).kv_cache_dtype == "auto"
    for dtype in ("float32", "bfloat16"):  # fp8 KV under either model dtype
        assert _config(role, "--kv-cache-dtype", "fp8_e4m3", "--dtype", dtype).kv_cache_dtype == "fp8_e4m3"
    assert _config(role, "--kv-cache-dtype", "fp8_e5m2").kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(SystemExit) as e:
        _config(role, "--kv-cache-dtype", "int4")
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        WorkerConfig(role=role, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="runs on the CPU"):
        WorkerConfig(role=role, kv_cache_dtype="fp8_e4m3", device="cuda")
    assert WorkerConfig(role=role, kv_cache_dtype="fp8_e4m3", engine="sim").kv_cache_dtype == "fp8_e4m3"


def test_an_fp8_kv_cache_holds_twice_the_tokens_of_bfloat16_in_the_same_memory(tiny_model_dir):
    import torch

    from xpyd.model.runner import kv_token_bytes

    bf16 = kv_token_bytes(tiny_model_dir, torch.bfloat16)
    assert kv_token_bytes(tiny_model_dir, torch.bfloat16, "fp8_e4m3") * 2 == bf16
    assert kv_token_bytes(tiny_model_dir, torch.float32, "fp8_e5m2") * 4 == kv_token_bytes(tiny_model_dir, torch.float32)
    cfg = _config("decode", "--kv-cache-memory", "1MiB", "--max-model-len", "64", "--kv-cache-dtype", "fp8_e4m3")
    assert cfg.kv_blocks(bf16 // 2) == 2 * cfg.kv_blocks(bf16)
