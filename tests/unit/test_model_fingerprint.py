"""The weights' fingerprint that seeds block hashes: the same files give the same digest wherever they lie and
whatever name serves them; other weights (a fine-tune of the same architecture) give another."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from xpyd.model.fingerprint import weights_fingerprint
from xpyd.worker.engine import model_identity


def _model(folder: Path, seed: int, n: int = 50_000) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    g = torch.Generator().manual_seed(seed)
    save_file({"a.weight": torch.randn(n, generator=g), "b.weight": torch.randn(8, 8, generator=g)},
              str(folder / "model.safetensors"))
    return folder


def test_same_files_anywhere_same_digest_other_weights_another(tmp_path):
    base = weights_fingerprint(_model(tmp_path / "one" / "llama", 0))
    assert weights_fingerprint(_model(tmp_path / "two" / "other-name", 0)) == base
    assert weights_fingerprint(_model(tmp_path / "tuned", 1)) != base  # same config, shapes and names


def test_one_changed_tensor_value_changes_the_digest(tmp_path):
    folder = _model(tmp_path / "m", 0)
    base = weights_fingerprint(folder)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(50_000, generator=g), torch.randn(8, 8, generator=g)
    save_file({"a.weight": a, "b.weight": b + 1e-3}, str(folder / "model.safetensors"))  # b lies in the last piece
    assert weights_fingerprint(folder) != base


def test_the_served_name_is_not_the_identity(tmp_path):
    runner = SimpleNamespace(config=SimpleNamespace(name_or_path=str(_model(tmp_path / "m", 0))))
    assert model_identity(runner, "served-a") == model_identity(runner, "served-b")
    other = SimpleNamespace(config=SimpleNamespace(name_or_path=str(_model(tmp_path / "n", 1))))
    assert model_identity(other, "served-a") != model_identity(runner, "served-a")


@pytest.mark.parametrize("files", [{}, {"config.json": b"{}"}, {"config.json": b"{}", "x.safetensors": b"\xff" * 16}])
def test_not_a_model_folder(tmp_path, files):
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError):
        weights_fingerprint(tmp_path)
