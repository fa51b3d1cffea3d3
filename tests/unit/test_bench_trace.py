"""Trace replay (xpyd bench --trace): reading and checking Mooncake-format traces, the prompts built from
hash ids (shared blocks exactly where the ids repeat), send times, the trace's statistics, the CLI's
flags, and the goodput / SLO attainment the report adds."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from xpyd.bench import main as bench_main
from xpyd.bench.client import Endpoint, RequestResult, StreamingClient
from xpyd.bench.config import Workload, config_from_args
from xpyd.bench.metrics import SLO, summarize
from xpyd.bench.report import build_report, format_table
from xpyd.bench.trace import (TraceError, TraceRecord, TraceRequests, load_trace, send_offsets, trace_stats)
from xpyd.bench.workload import TokenizerPromptBuilder

REAL_TRACE = Path("/work/shared/traces/conversation_trace.jsonl")


def write_trace(path: Path, rows: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def row(ts: float, n_in: int, n_out: int, ids: list[int]) -> dict:
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


def rec(ts: float, n_in: int, ids: list[int], n_out: int = 4, line: int = 1) -> TraceRecord:
    return TraceRecord(line, ts, n_in, n_out, tuple(ids))


# ---- reading and checking ----------------------------------------------------------------------

@pytest.mark.parametrize("bad, message", [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"input_length": 4, "output_length": 1, "hash_ids": [0]}), "missing field 'timestamp'"),
    (json.dumps({"timestamp": 0, "output_length": 1, "hash_ids": [0]}), "missing field 'input_length'"),
    (json.dumps({"timestamp": 0, "input_length": 4, "hash_ids": [0]}), "missing field 'output_length'"),
    (json.dumps({"timestamp": 0, "input_length": 4, "output_length": 1}), "missing field 'hash_ids'"),
    (json.dumps(row(-1, 4, 1, [0])), "'timestamp' must be a number of milliseconds >= 0"),
    (json.dumps(row(0, -4, 1, [0])), "'input_length' must be >= 1, got -4"),
    (json.dumps(row(0, 4, -1, [0])), "'output_length' must be >= 1, got -1"),
    (json.dumps(row(0, 4, 0, [0])), "'output_length' must be >= 1, got 0"),
    (json.dumps(row(0, 4.5, 1, [0])), "'input_length' must be an integer"),
    (json.dumps(row(0, True, 1, [0])), "'input_length' must be an integer"),
    (json.dumps(row(0, 4, 1, [0, "a"])), "'hash_ids' must be a list of integers >= 0"),
    (json.dumps(row(0, 4, 1, [-3])), "'hash_ids' must be a list of integers >= 0"),
    (json.dumps(row(0, 9, 1, [0, 1])), "2 hash_ids do not cover input_length 9 in blocks of 4 tokens (expected 3"),
    (json.dumps(row(0, 4, 1, [0, 1])), "2 hash_ids do not cover input_length 4 in blocks of 4 tokens (expected 1"),
])
def test_a_bad_line_is_an_error_naming_file_and_line(tmp_path, bad, message):
    path = write_trace(tmp_path / "t.jsonl", [row(0, 4, 1, [0]), "", bad, row(9, 4, 1, [0])])
    with pytest.raises(TraceError) as e:
        load_trace(path, block_size=4)
    assert f"{path}:3: " in str(e.value)
    assert message in str(e.value)


def test_unreadable_and_empty_traces(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "missing.jsonl")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(write_trace(tmp_path / "e.jsonl", ["", "  "]))


def test_max_requests_reads_the_first_n_lines_and_replays_in_timestamp_order(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [row(5, 4, 1, [0]), row(0, 4, 2, [1]), row(5, 4, 3, [2]),
                                              "{a bad line after the first three"])
    recs = load_trace(path, block_size=4, max_requests=3)  # the bad 4th line is never read
    assert [(r.line, r.timestamp_ms, r.output_length) for r in recs] == [(2, 0.0, 2), (1, 5.0, 1), (3, 5.0, 3)]
    with pytest.raises(TraceError, match=":4: not JSON"):
        load_trace(path, block_size=4)


def test_the_real_trace_loads_and_matches_its_readme():
    if not REAL_TRACE.exists():
        pytest.skip("the Mooncake trace is not on this machine")
    recs = load_trace(REAL_TRACE)
    stats = trace_stats(recs, 512)
    assert stats.requests == 12031
    assert round(stats.mean_input_tokens) == 12035 and round(stats.mean_output_tokens) == 343
    assert 0 < stats.prefix_sharing_ratio < 1
    assert [r.input_length for r in load_trace(REAL_TRACE, max_requests=3)] == [6758, 7322, 7236]


# ---- prompts -----------------------------------------------------------------------------------

def test_same_ids_give_the_same_blocks_and_others_differ():
    recs = [rec(0, 10, [1, 2, 3]), rec(0, 9, [1, 2, 7]), rec(0, 6, [1, 5]), rec(0, 12, [8, 2, 3])]
    reqs = TraceRequests(recs, 4, list(range(1000, 1100)))
    p = [reqs[i].prompt for i in range(4)]
    assert all(isinstance(x, tuple) and len(x) == r.input_length for x, r in zip(p, recs))
    assert p[0][:8] == p[1][:8]  # blocks 1, 2 shared
    assert p[0][8:] == tuple(reqs.block(3)[:2]) and p[1][8:] == tuple(reqs.block(7)[:1])
    assert p[0][8:9] != p[1][8:9]  # different last blocks
    assert p[0][:4] == p[2][:4] and p[0][4:6] != p[2][4:6]
    assert p[3][4:] == p[0][4:8] + tuple(reqs.block(3))  # id 2 then 3 at other positions: the same tokens
    assert p[3][:4] != p[0][:4]
    assert p[0][8:] == tuple(reqs.block(3)[:2])  # a partial last block: the first tokens of its id's block
    spec = reqs[1]
    assert (spec.max_tokens, spec.input_len, spec.trace_line) == (4, 9, 1)


def test_blocks_are_the_same_in_another_process_and_seed_changes_them():
    reqs = TraceRequests([rec(0, 8, [41, 42])], 8, list(range(50)))
    code = ("from xpyd.bench.trace import TraceRequests, TraceRecord;"
            "r = TraceRequests([TraceRecord(1, 0, 8, 1, (41, 42))], 8, list(range(50)));"
            "print(list(r[0].prompt))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""})
    assert json.loads(out.stdout) == list(reqs[0].prompt)
    assert TraceRequests([rec(0, 8, [41])], 8, list(range(50)), seed=1)[0].prompt != reqs[0].prompt


def test_word_prompts_have_one_word_per_token_and_share_blocks():
    reqs = TraceRequests.with_words([rec(0, 700, [0, 1]), rec(0, 520, [0, 2])], 512)
    a, b = (reqs[i].prompt.split(" ") for i in range(2))
    assert (len(a), len(b)) == (700, 520)
    assert a[:512] == b[:512] and a[512:] != b[512:520]


def test_tokenizer_vocabulary_gives_exact_token_blocks(smollm_dir):
    builder = TokenizerPromptBuilder.from_path(smollm_dir)
    vocab = builder.token_ids()
    reqs = TraceRequests([rec(0, 1000, [0, 1]), rec(0, 600, [0, 9])], 512, vocab)
    p0, p1 = reqs[0].prompt, reqs[1].prompt
    assert p0[:512] == p1[:512] and len(p0) == 1000 and len(p1) == 600
    text = builder._tok.decode(list(p0))
    assert builder.encode(text) == list(p0)  # single-token words: the ids decode and re-encode alike


def test_send_offsets_scale_and_start_at_the_first_timestamp():
    recs = [rec(1000, 4, [0]), rec(1500, 4, [0]), rec(4000, 4, [0])]
    assert send_offsets(recs, 1.0) == [0.0, 0.5, 3.0]
    assert send_offsets(recs, 2.0) == [0.0, 0.25, 1.5]  # 2.0: twice as fast
    with pytest.raises(ValueError):
        send_offsets(recs, 0.0)


# ---- statistics --------------------------------------------------------------------------------

def test_prefix_sharing_counts_leading_blocks_seen_before():
    recs = [
        rec(0, 10, [1, 2, 3]),  # all new: 0
        rec(0, 12, [1, 2, 3]),  # 4 + 4 + 2 (id 3 was seen with 2 tokens only): 10; id 3 now has 4
        rec(0, 12, [1, 9, 3]),  # 4, then 9 is new: the prefix breaks, id 3 is not counted: 4
        rec(0, 3, [1]),  # a partial block of a seen id: 3
    ]
    s = trace_stats(recs, 4)
    assert (s.requests, s.total_input_tokens, s.total_output_tokens) == (4, 37, 16)
    assert s.shared_prefix_tokens == 17
    assert s.prefix_sharing_ratio == pytest.approx(17 / 37)
    assert s.mean_input_tokens == pytest.approx(37 / 4)
    d = trace_stats([rec(2000, 4, [0]), rec(6000, 4, [0])], 4).as_dict(time_scale=2.0)
    assert (d["span_s"], d["replay_span_s"], d["shared_prefix_tokens"]) == (4.0, 2.0, 4)


# ---- the CLI -----------------------------------------------------------------------------------

def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_main.add_arguments(p)
    return p.parse_args(["--url", "http://127.0.0.1:1", *argv])


def test_trace_flags_build_the_config(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [row(0, 600, 2, [0, 1]), row(10, 5, 1, [0]), row(20, 5, 1, [3])])
    c = config_from_args(parse(["--trace", str(path), "--max-requests", "2", "--time-scale", "4"]))
    assert (c.workload, c.num_requests, c.trace.time_scale, c.trace.block_size) == (Workload.TRACE, 2, 4.0, 512)
    assert c.max_connections == 2 and c.describe()["concurrency"] is None
    assert c.describe()["trace"] == {"path": str(path), "time_scale": 4.0, "max_requests": 2, "block_size": 512}
    c = config_from_args(parse(["--trace", str(path), "--trace-block-size", "300"]))
    assert c.num_requests == 3 and c.trace.block_size == 300
    plan = bench_main.build_plan(c)
    assert [s.input_len for s in plan.specs] == [600, 5, 5] and plan.specs[0].prompt.count(" ") == 599


@pytest.mark.parametrize("argv, message", [
    (["--time-scale", "2"], "--time-scale goes with --trace"),
    (["--max-requests", "2"], "--max-requests goes with --trace"),
    (["--workload", "trace"], "--workload trace needs --trace FILE"),
    (["--trace", "T", "--workload", "fixed"], "does not go with --workload fixed"),
    (["--trace", "T", "--concurrency", "2"], "--concurrency does not go with --trace"),
    (["--trace", "T", "--rate", "2"], "--rate does not go with --trace"),
    (["--trace", "T", "--num-requests", "2"], "--num-requests does not go with --trace"),
    (["--trace", "T", "--output-len", "2"], "--output-len does not go with --trace"),
    (["--trace", "T", "--time-scale", "0"], "--time-scale must be a finite number > 0"),
    (["--trace", "T", "--time-scale", "inf"], "--time-scale must be a finite number > 0"),
    (["--trace", "T", "--max-requests", "0"], "--max-requests must be >= 1"),
    (["--trace", "T", "--endpoint", "chat"], "--trace needs --endpoint completions"),
    (["--trace", "T", "--trace-block-size", "4"], "T:1: 2 hash_ids do not cover input_length 600 in blocks of 4"),
])
def test_bad_trace_arguments(tmp_path, argv, message):
    path = write_trace(tmp_path / "t.jsonl", [row(0, 600, 2, [0, 1])])
    argv = [str(path) if a == "T" else a for a in argv]
    with pytest.raises(ValueError) as e:
        config_from_args(parse(argv))
    assert message.replace("T:", f"{path}:") in str(e.value)


def test_time_scale_is_explained_in_help():
    p = argparse.ArgumentParser()
    bench_main.add_arguments(p)
    assert "2.0 runs twice as fast" in " ".join(p.format_help().split())


def test_token_id_prompts_go_as_a_list_on_completions_only():
    spec = TraceRequests([rec(0, 3, [0])], 4, [7, 8, 9])[0]
    body = StreamingClient("http://h:1", Endpoint.COMPLETIONS, "m", timeout_s=1, max_connections=1).body(spec)
    assert body["prompt"] == list(spec.prompt) and body["max_tokens"] == 4 and body["ignore_eos"] is True
    with pytest.raises(ValueError, match="token ids needs the completions endpoint"):
        StreamingClient("http://h:1", Endpoint.CHAT, "m", timeout_s=1, max_connections=1).body(spec)


# ---- goodput and SLO attainment ----------------------------------------------------------------

def test_goodput_tokens_and_attainment_count_only_requests_meeting_every_slo():
    def ok(ttft: float, tokens: int) -> RequestResult:
        return RequestResult("all", 0.0, [ttft + 0.01 * i for i in range(tokens)], ttft + 0.01 * tokens,
                             output_tokens=tokens, prompt_tokens=10, trace_line=3)

    results = [ok(0.1, 10), ok(0.2, 20), ok(0.9, 40), RequestResult("all", 0.0, [], 1.0, error="timeout")]
    s = summarize(results, 2.0, SLO.parse("ttft=500ms"))
    assert (s.good, s.goodput_requests_per_s, s.goodput_output_tokens_per_s) == (2, 1.0, 15.0)
    assert s.slo_attainment == pytest.approx(0.5)  # 2 of 4 sent: the failed one misses
    assert summarize(results[:3], 2.0).goodput_output_tokens_per_s == 35.0  # no SLO: every completed one
    stats = trace_stats([rec(0, 4, [0]), rec(0, 4, [0])], 4).as_dict(1.0)
    report = build_report(s, {}, {"slo_ms": {"ttft": 500.0}}, "m", trace=stats)
    assert (report["goodput_output_tokens_per_s"], report["slo_attainment"]) == (15.0, 0.5)
    assert report["trace"]["prefix_sharing_ratio"] == 0.5
    table = format_table(s, {}, {"url": "u", "endpoint": "completions", "workload": "trace",
                                 "trace": {"path": "t.jsonl", "time_scale": 2.0}}, "m", trace=stats)
    assert "trace t.jsonl at 2x" in table and "50.0% (4 of 8 input tokens in blocks of 4 seen before)" in table
    assert "SLO attainment              50.0% (2 of 4 requests)" in table
