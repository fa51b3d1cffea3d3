"""xpyd bench --trace against real xpyd servers.

A small synthetic trace through a 1P1D cluster (tiny random Llama, token-id prompts): every request completes
with exactly its input and output lengths; the bodies the bench sent share exactly the token blocks their
hash ids share (and no others); no request goes before its timestamp / --time-scale; the server's
prefix-cache hits stay within the trace's prefix-sharing ratio. The first 20 lines of the real Mooncake trace
(prompts up to 87k tokens) go to a simulated colocated worker (--engine sim, no simulated time): a torch
model on this CPU takes minutes and runs out of memory on the 87k-token prompt.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port, start_1p1d
from xpyd.bench import main as bench_main
from xpyd.bench.client import StreamingClient

BLOCK = 32  # the synthetic trace's block (--trace-block-size); the workers' is 16
REAL_TRACE = Path("/work/shared/traces/conversation_trace.jsonl")

# (timestamp ms, input tokens, output tokens, hash ids): shared blocks, partial last blocks, one-token outputs
ROWS = [
    (0, 80, 4, [0, 1, 2]),
    (0, 70, 3, [0, 1, 3]),  # shares 0, 1 (64 tokens)
    (300, 96, 5, [0, 1, 2]),  # 0, 1 and the 16 tokens of 2 line 1 had: 80
    (300, 40, 2, [4, 5]),
    (600, 50, 6, [4, 7]),  # 32
    (900, 33, 1, [0, 8]),  # 32
    (1200, 20, 4, [0]),  # the first 20 tokens of block 0: 20
    (1500, 128, 8, [9, 10, 11, 12]),
]
SHARED = 64 + 80 + 32 + 32 + 20
TIME_SCALE = 2.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir: Path):
    c, urls = start_1p1d(tmp_path_factory.mktemp("bench-trace"), str(tiny_model_dir), max_model_len=256,
                         extra=["--block-size", "16"])
    yield urls
    c.stop()


def write_trace(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h}) + "\n"
                            for t, i, o, h in rows))
    return path


def check_blocks(prompts: dict[int, list[int]], rows: dict[int, tuple[int, list[int]]], block: int) -> None:
    """Each prompt (by trace line) is ``input_length`` token ids; the tokens of a hash id's block are the same
    wherever it appears (a partial block: the first ones), and different ids have different full blocks."""
    blocks: dict[int, list[int]] = {}  # hash id -> the longest run of tokens sent for it
    for line, (n_in, ids) in rows.items():
        prompt = prompts[line]
        assert len(prompt) == n_in and all(isinstance(t, int) for t in prompt)
        for k, h in enumerate(ids):
            part = prompt[k * block:(k + 1) * block]
            seen = blocks.get(h, [])
            common = min(len(seen), len(part))
            assert part[:common] == seen[:common], f"line {line}: the block of id {h} differs from an earlier one"
            if len(part) > len(seen):
                blocks[h] = part
    full = [tuple(b) for b in blocks.values() if len(b) == block]
    assert len(set(full)) == len(full)  # different ids, different blocks


def run_bench(argv: list[str], monkeypatch) -> list[dict]:
    """Runs xpyd bench in this process; returns the JSON bodies it sent."""
    sent: list[dict] = []
    body = StreamingClient.body

    def recording_body(self, spec):
        b = body(self, spec)
        sent.append(b | {"trace_line": spec.trace_line})
        return b

    monkeypatch.setattr(StreamingClient, "body", recording_body)
    parser = argparse.ArgumentParser(prog="xpyd bench")
    bench_main.add_arguments(parser)
    assert bench_main.run(parser.parse_args([*argv, "--no-progress"])) == 0
    return sent


def test_synthetic_trace_replays_exact_blocks_at_its_times(cluster, tiny_model_dir, tmp_path, monkeypatch, capsys):
    trace = write_trace(tmp_path / "trace.jsonl", ROWS)
    out = tmp_path / "out.json"
    sent = run_bench(["--url", cluster["proxy"], "--trace", str(trace), "--trace-block-size", str(BLOCK),
                      "--time-scale", str(TIME_SCALE), "--tokenizer", str(tiny_model_dir), "--slo", "ttft=60s",
                      "--json", str(out), "--include-requests"], monkeypatch)
    report = json.loads(out.read_text())
    assert (report["completed"], report["failed"]) == (len(ROWS), 0), report["errors"]

    # what was sent: token ids, exactly input_length of them, blocks equal exactly where the ids are
    by_line = {b["trace_line"]: b for b in sent}
    assert sorted(by_line) == list(range(1, len(ROWS) + 1)) and len(sent) == len(ROWS)
    for line, (_, n_in, n_out, ids) in enumerate(ROWS, 1):
        assert by_line[line]["max_tokens"] == n_out and by_line[line]["ignore_eos"] is True
    check_blocks({line: b["prompt"] for line, b in by_line.items()},
                 {line: (n_in, ids) for line, (_, n_in, _, ids) in enumerate(ROWS, 1)}, BLOCK)

    # what the server saw and did
    records = {r["trace_line"]: r for r in report["requests"]}
    for line, (ts, n_in, n_out, _) in enumerate(ROWS, 1):
        r = records[line]
        assert (r["prompt_tokens"], r["output_tokens"]) == (n_in, n_out)
        assert r["send_s"] >= ts / 1000.0 / TIME_SCALE  # never early (late is the machine's business)
    t = report["trace"]
    assert (t["requests"], t["total_input_tokens"], t["shared_prefix_tokens"]) == (
        len(ROWS), sum(r[1] for r in ROWS), SHARED)
    assert t["replay_span_s"] == 1.5 / TIME_SCALE
    cache = report["prefix_cache"]
    assert cache["prompt_tokens"] == sum(r[1] for r in ROWS)
    assert cache["cached_tokens"] <= SHARED  # the trace's sharing bounds any prefix cache
    assert report["good"] == len(ROWS) and report["slo_attainment"] == 1.0
    assert report["goodput_output_tokens_per_s"] == pytest.approx(report["output_tokens_per_s"])
    text = capsys.readouterr().out
    assert f"{SHARED} of {sum(r[1] for r in ROWS)} input tokens in blocks of {BLOCK} seen before" in text


SIM_PROFILE = {  # no simulated time is spent (--sim-speedup inf): only its shape matters
    "format": "xpyd-sim-profile/1", "model": "test", "machine": "test", "dtype": "float32", "threads": 1,
    "created": "2026-01-01T00:00:00Z",
    "prefill": {"new_tokens": [1, 1024], "cached_tokens": [0, 1024], "seconds": [[0.001, 0.001], [0.01, 0.01]]},
    "decode": {"batch": [1, 8], "context_tokens": [1, 4096], "seconds": [[0.001, 0.002], [0.002, 0.003]]},
}


def long_context_model(folder: Path, smollm_dir: Path) -> Path:
    """SmolLM2's files with a 128k-token context in config.json (the simulated engine reads only the config,
    the tokenizer and the weights' fingerprint)."""
    folder.mkdir()
    for f in smollm_dir.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((smollm_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 131072}))
    return folder


def test_first_20_lines_of_the_real_trace(tmp_path, smollm_dir, monkeypatch):
    if not REAL_TRACE.exists():
        pytest.skip("the Mooncake trace is not on this machine")
    lines = REAL_TRACE.read_text().splitlines()[:20]
    rows = [json.loads(x) for x in lines]
    trace = tmp_path / "head.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(SIM_PROFILE))
    model = long_context_model(tmp_path / "model", smollm_dir)
    c = Cluster(tmp_path)
    wp, xp = free_port(), free_port()
    worker, proxy = f"http://127.0.0.1:{wp}", f"http://127.0.0.1:{xp}"
    c.start("colocated", ["colocated", "--engine", "sim", "--sim-profile", str(profile), "--sim-speedup", "inf",
                          "--sim-kv-token-bytes", "64", "--model", str(model), "--max-model-len", "90000",
                          "--kv-cache-tokens", "400000", "--batch-size", "20", "--threads", "1", "--port", str(wp)],
            worker)
    try:
        # (the proxy serves, and answers /health, once the worker answered its /xpyd/info)
        c.start("proxy", ["proxy", "--port", str(xp), "--colocated", worker], proxy)
        c.wait_healthy()
        out = tmp_path / "out.json"
        sent = run_bench(["--url", proxy, "--trace", str(trace), "--max-requests", "20", "--time-scale", "100",
                          "--tokenizer", str(smollm_dir), "--json", str(out), "--include-requests"], monkeypatch)
    finally:
        c.stop()
    report = json.loads(out.read_text())
    assert (report["completed"], report["failed"]) == (20, 0), report["errors"]
    check_blocks({b["trace_line"]: b["prompt"] for b in sent},
                 {line: (row["input_length"], row["hash_ids"]) for line, row in enumerate(rows, 1)}, 512)
    for r in report["requests"]:
        row = rows[r["trace_line"] - 1]
        assert (r["prompt_tokens"], r["output_tokens"]) == (row["input_length"], row["output_length"])
        assert r["send_s"] >= row["timestamp"] / 1000.0 / 100
    assert report["prefix_cache"]["cached_tokens"] <= report["trace"]["shared_prefix_tokens"]
