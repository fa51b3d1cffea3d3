"""The package layers (pyproject.toml [tool.importlinter]) hold, cover every package, and can fail."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e .[test])")


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}  # the tree in cwd, not the installed one
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_every_contract_is_kept():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(_contracts())} kept, 0 broken." in result.stdout


def test_every_package_and_top_level_module_has_a_layer():
    layers = next(c for c in _contracts() if c["id"] == "layers")["layers"]
    named = {name.strip() for layer in layers for name in layer.split("|")}
    present = {f"xpyd.{p.name}" for p in (ROOT / "xpyd").iterdir() if (p / "__init__.py").exists()}
    present |= {f"xpyd.{p.stem}" for p in (ROOT / "xpyd").glob("*.py") if p.stem not in ("__init__", "__main__")}
    assert present - named == set(), "add new packages to the layers contract in pyproject.toml"


@pytest.mark.parametrize("module, line", [
    ("model/runner.py", "import xpyd.worker.engine  # noqa"),  # model -> worker runtime
    ("worker/loop.py", "from xpyd.prefill_worker import engine  # noqa"),  # runtime -> a role
    ("decode_worker/scheduler.py", "import xpyd.prefill_worker.scheduler  # noqa"),  # role -> role
    ("proxy/relay.py", "import torch  # noqa"),  # the proxy runs no model
    ("model/grammar.py", "import torch  # noqa"),  # the grammar masks the simulated engine shares
    ("decode_worker/engine.py", "import xpyd.transfer.base  # noqa"),  # a role past the KV connector
    ("prefill_worker/handover.py", "from xpyd.transfer import auth  # noqa"),  # (the layers allow it; kv-connector not)
])
def test_a_layer_violation_breaks_a_contract(tmp_path, module, line):
    shutil.copytree(ROOT / "xpyd", tmp_path / "xpyd", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    target = tmp_path / "xpyd" / module
    target.write_text(target.read_text() + f"\n\ndef _hidden():\n    {line}\n")  # inside a function too
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout or "broken" in result.stdout
