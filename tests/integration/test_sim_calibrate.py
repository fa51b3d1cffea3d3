"""`xpyd bench calibrate` measures the real engine on a grid and writes a profile the simulated engine loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from xpyd.model.sim import SimProfile
from xpyd.model.sim_calibrate import Grid, calibrate

TINY = Grid(prefill_new=(4, 16), prefill_cached=(0, 32, 48), decode_batch=(1, 2), decode_context=(8, 64),
            repeats=2, warmup=1)


def test_calibrate_measures_every_grid_point(tiny_model_dir):
    lines: list[str] = []
    data = calibrate(tiny_model_dir, "float32", threads=1, grid=TINY, progress=lines.append)
    assert data["prefill"]["new_tokens"] == [4, 16] and data["prefill"]["cached_tokens"] == [0, 32, 48]
    assert data["decode"]["batch"] == [1, 2] and data["decode"]["context_tokens"] == [8, 64]
    assert [len(row) for row in data["prefill"]["seconds"]] == [3, 3]
    assert [len(row) for row in data["decode"]["seconds"]] == [2, 2]
    assert all(s > 0 for t in ("prefill", "decode") for row in data[t]["seconds"] for s in row)
    assert data["model"] == tiny_model_dir.name and data["dtype"] == "float32" and data["threads"] == 1
    assert data["machine"] and data["created"].endswith("Z")
    assert [line.split(":")[0] for line in lines] == [  # every grid point, in order
        f"prefill {n:>6} new after {c:>6} cached" for n in (4, 16) for c in (0, 32, 48)] + [
        f"decode batch {b:>4}, {t:>6} context tokens" for b in (1, 2) for t in (8, 64)]
    profile = SimProfile.from_dict(data)
    assert profile.prefill_seconds(16, 48) == data["prefill"]["seconds"][1][2]


def test_a_grid_longer_than_the_model_is_refused(tiny_model_dir):
    long = Grid(prefill_new=(16,), prefill_cached=(1024,), decode_batch=(1,), decode_context=(8,))
    with pytest.raises(ValueError, match="the grid needs 1040 tokens of context, the model has 512"):
        calibrate(tiny_model_dir, "float32", threads=1, grid=long)


def test_the_command_writes_a_profile_that_loads(tiny_model_dir, tmp_path):
    out = tmp_path / "profile.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "xpyd", "bench", "calibrate", "--model", str(tiny_model_dir),
                             "--out", str(out), "--quick", "--threads", "1"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert set(data) == {"format", "model", "machine", "dtype", "threads", "created", "notes", "prefill", "decode"}
    assert data["format"] == "xpyd-sim-profile/1" and data["threads"] == 1
    profile = SimProfile.load(out)
    assert profile.prefill.x == (16, 128) and profile.decode.x == (1, 4)  # the quick grid
    assert "prefill     16 new after      0 cached" in result.stderr
    bad = subprocess.run([sys.executable, "-m", "xpyd", "bench", "calibrate", "--model", str(tiny_model_dir),
                          "--out", str(tmp_path / "no" / "p.json"), "--quick"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "--out: no folder" in bad.stderr
    help_text = subprocess.run([sys.executable, "-m", "xpyd", "bench", "--help"], capture_output=True, text=True,
                               timeout=60, check=True).stdout
    assert "xpyd bench calibrate --model M --out FILE" in help_text
