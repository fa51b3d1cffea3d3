"""Random weights for a model folder without any (`--load-format dummy`, as vLLM's): speed is set by the
model's shape, not its values, so a Llama-3-8B-shaped model can be served and measured where no hub is
reachable. The values are a function of (seed, parameter name, dtype, device): two workers on one device
make the very same model, so a prefill worker's KV means to the decode worker what it would mean to
itself, and a reference (transformers) built the same way computes the same function.
"""

from __future__ import annotations

import hashlib
import zlib
from pathlib import Path

import torch

LOAD_FORMATS = ("auto", "dummy")  # auto: the folder's safetensors; dummy: random weights made on the device
DEFAULT_SEED = 0


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


@torch.no_grad()
def fill_dummy(model: torch.nn.Module, seed: int = DEFAULT_SEED, std: float | None = None) -> None:
    """Overwrite every parameter of ``model`` in place with seeded random values, on its own device:
    normal(0, std) for weights and biases (std: the config's ``initializer_range``, else 0.02), around 1
    for norm scales. Tied parameters are filled once (they are one tensor)."""
    if std is None:
        std = float(getattr(getattr(model, "config", None), "initializer_range", 0.02) or 0.02)
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        generator = torch.Generator(device=param.device)
        generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
        if _is_norm(name):
            param.normal_(1.0, 0.05, generator=generator)
        else:
            param.normal_(0.0, std, generator=generator)


def dummy_model(config, dtype: torch.dtype, device: torch.device | str, seed: int = DEFAULT_SEED):
    """A transformers causal LM of ``config``'s shape built straight on ``device`` (no copy through host
    memory) with `fill_dummy`'s weights, in eval mode."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.requires_grad_(False)
    fill_dummy(model, seed)
    return model.eval()


def dummy_identity(model_dir: Path, dtype: torch.dtype, device: torch.device, seed: int = DEFAULT_SEED) -> str:
    """What names a dummy model's weights (the folder has no weight files to fingerprint): its config, dtype,
    seed and the kind of device whose random numbers made them; two workers agree on it exactly when they
    made the same weights, so KV blocks are shared between them and with nobody else."""
    digest = hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()
    return f"dummy:{seed}:{str(dtype).removeprefix('torch.')}:{torch.device(device).type}:{digest}"
