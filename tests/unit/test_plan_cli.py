"""`xpyd plan` end to end on a small trace and profile written here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from xpyd.cli import main

from tests.unit.planner_fixtures import linear_profile

ROOT = Path(__file__).resolve().parents[2]


def _files(tmp_path: Path, rate_s: float = 0.1) -> tuple[Path, Path]:
    trace = tmp_path / "trace.jsonl"
    lines = [{"timestamp": int(i * rate_s * 1000), "input_length": 1000, "output_length": 4,
              "hash_ids": [i % 3, 1000 + i]} for i in range(60)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in lines))
    profile = tmp_path / "profile.json"
    linear_profile(prefill_per_token=4e-4, prefill_per_cached=1e-5).save(profile)
    return trace, profile


def test_plan_prints_the_answer_and_writes_json(tmp_path):
    trace, profile = _files(tmp_path)
    out = tmp_path / "plan.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "xpyd", "plan", "--profile", str(profile), "--trace", str(trace),
                           "--slo", "ttft=1s,itl=100ms,attainment=0.9", "--max-workers", "6", "--batch-sizes", "4,8",
                           "--trace-block-size", "512", "--json", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Answer:" in proc.stdout and "requests/s meeting the SLO" in proc.stdout
    report = json.loads(out.read_text())
    best = report["best"]
    assert best["meets_slo"] and best["attainment"] >= 0.9 and best["goodput_rps"] > 0
    assert best["prefill_workers"] >= 2  # 0.2 s of prefill (the first block reused) every 0.1 s
    assert report["workload"]["requests"] == 60 and report["slo"]["ttft_ms"] == 1000.0
    assert len(report["attempts"]) >= 2 and all("config" in a for a in report["attempts"])
    assert f"{best['prefill_workers']}P{best['decode_workers']}D" in proc.stdout


def test_no_configuration_meets_the_slo_exits_1(tmp_path, capsys):
    trace, profile = _files(tmp_path, rate_s=0.01)
    code = main(["plan", "--profile", str(profile), "--trace", str(trace), "--slo", "ttft=10ms",
                 "--max-workers", "3", "--max-requests", "20"])
    assert code == 1
    assert "None meets" in capsys.readouterr().out


def test_bad_arguments_exit_2_and_say_what(tmp_path, capsys):
    trace, profile = _files(tmp_path)
    assert main(["plan", "--profile", str(profile), "--trace", str(trace), "--slo", "ttft=soon"]) == 2
    assert "ttft" in capsys.readouterr().err
    assert main(["plan", "--profile", str(tmp_path / "none.json"), "--trace", str(trace), "--slo", "ttft=1s"]) == 2
    assert "none.json" in capsys.readouterr().err
    assert main(["plan", "--profile", str(profile), "--trace", str(trace), "--slo", "ttft=1s",
                 "--batch-sizes", "8,x"]) == 2
    assert "--batch-sizes" in capsys.readouterr().err


def test_shipped_profiles_by_name(tmp_path, capsys):
    trace, _ = _files(tmp_path)
    code = main(["plan", "--profile", "llama3-8b-h100-estimate", "--trace", str(trace), "--slo", "ttft=2s",
                 "--max-workers", "2", "--batch-sizes", "8"])
    assert code == 0
    assert "Llama-3-8B" in capsys.readouterr().out
