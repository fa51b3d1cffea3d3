"""xpyd bench workloads: exact prompt lengths, shared prefixes, deterministic arrivals, prompt files, request
bodies."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from xpyd.bench.client import Endpoint, StreamingClient
from xpyd.bench.workload import (WORDS, RequestSpec, TokenizerPromptBuilder, WordPromptBuilder, WorkloadError,
                                 cycle_to, fixed_requests, load_jsonl, parse_range, poisson_offsets,
                                 random_requests, shared_prefix_requests)


@pytest.fixture(scope="module")
def smollm_builder(smollm_dir) -> TokenizerPromptBuilder:
    return TokenizerPromptBuilder.from_path(smollm_dir)


def test_tokenizer_prompts_have_exact_lengths(smollm_builder):
    rng = random.Random(0)
    for n in (1, 2, 7, 64, 1024):
        text = smollm_builder.build(n, rng)
        assert smollm_builder.count(text) == n


def test_tokenizer_prompts_are_deterministic_per_seed(smollm_builder):
    a = smollm_builder.build(32, random.Random(5))
    assert a == smollm_builder.build(32, random.Random(5))
    assert a != smollm_builder.build(32, random.Random(6))


def test_word_prompts_are_about_one_token_per_word(smollm_builder):
    text = WordPromptBuilder().build(200, random.Random(0))
    assert len(text.split()) == 200
    assert abs(smollm_builder.count(text) - 200) <= 4
    assert all(w.isalpha() for w in WORDS)


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(WorkloadError, match="cannot load a tokenizer"):
        TokenizerPromptBuilder.from_path(tmp_path / "nowhere")


def test_fixed_and_random_requests():
    b = WordPromptBuilder()
    specs = fixed_requests(b, 5, 16, 8, random.Random(0), label="short")
    assert [(s.input_len, s.max_tokens, s.label) for s in specs] == [(16, 8, "short")] * 5
    assert len({s.prompt for s in specs}) == 5  # no shared prompts (no prefix-cache hits)
    rs = random_requests(b, 200, (4, 9), (2, 3), random.Random(1))
    assert {s.input_len for s in rs} == set(range(4, 10)) and {s.max_tokens for s in rs} == {2, 3}
    assert all(len(s.prompt.split()) == s.input_len for s in rs)
    assert rs == random_requests(b, 200, (4, 9), (2, 3), random.Random(1))


def test_parse_range():
    assert parse_range("3:9") == (3, 9) and parse_range("5:5") == (5, 5)
    for bad in ("9:3", "0:4", "a:b", "7", "1:2:3"):
        with pytest.raises(WorkloadError):
            parse_range(bad)


def test_poisson_offsets_deterministic_with_seed():
    a = poisson_offsets(4.0, 2000, seed=3)
    assert a == poisson_offsets(4.0, 2000, seed=3)
    assert a != poisson_offsets(4.0, 2000, seed=4)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.1)
    with pytest.raises(ValueError):
        poisson_offsets(0.0, 3, seed=0)


def _write(tmp_path, lines: list[str]):
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_load_jsonl_prompts_and_messages(tmp_path):
    p = _write(tmp_path, [json.dumps({"prompt": "Hello there"}), "",
                          json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5})])
    specs = load_jsonl(p, chat=True, default_max_tokens=32)
    assert specs[0] == RequestSpec(prompt="Hello there", max_tokens=32)
    assert specs[1].messages == ({"role": "user", "content": "Hi"},) and specs[1].max_tokens == 5
    assert [s.max_tokens for s in cycle_to(specs, 5)] == [32, 5, 32, 5, 32]


@pytest.mark.parametrize("line, chat, match", [
    ('{"prompt": "a"', True, r"prompts.jsonl:2: invalid JSON"),
    ('{"text": "a"}', True, r":2: expected an object with exactly one of 'prompt'"),
    ('{"prompt": "a", "messages": []}', True, "exactly one of"),
    ('["a"]', True, "expected an object"),
    ('{"prompt": ""}', True, "'prompt' must be a non-empty string"),
    ('{"prompt": "a", "max_tokens": 0}', True, "'max_tokens' must be a positive integer"),
    ('{"prompt": "a", "max_tokens": "5"}', True, "'max_tokens' must be a positive integer"),
    ('{"prompt": "a", "max_tokens": true}', True, "'max_tokens' must be a positive integer"),
    ('{"messages": [{"role": "user", "content": "x"}]}', False, "'messages' needs --endpoint chat"),
    ('{"messages": ["hi"]}', True, "list of objects with a 'role'"),
])
def test_load_jsonl_errors_name_the_line(tmp_path, line, chat, match):
    p = _write(tmp_path, ['{"prompt": "fine"}', line])
    with pytest.raises(WorkloadError, match=match):
        load_jsonl(p, chat=chat, default_max_tokens=8)


def test_load_jsonl_empty_or_missing_file(tmp_path):
    with pytest.raises(WorkloadError, match="no prompts"):
        load_jsonl(_write(tmp_path, ["", "  "]), chat=False, default_max_tokens=8)
    with pytest.raises(WorkloadError, match="cannot read prompts file"):
        load_jsonl(tmp_path / "missing.jsonl", chat=False, default_max_tokens=8)


def test_request_spec_validation():
    with pytest.raises(ValueError):
        RequestSpec(max_tokens=4)
    with pytest.raises(ValueError):
        RequestSpec(max_tokens=0, prompt="x")


def test_request_bodies_stream_with_usage_and_exact_length():
    spec = RequestSpec(prompt="the cat", max_tokens=7)
    comp = StreamingClient("http://h:1/v1/", Endpoint.COMPLETIONS, "m", timeout_s=5, max_connections=1).body(spec)
    assert comp == {"model": "m", "prompt": "the cat", "max_tokens": 7, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True}
    chat = StreamingClient("http://h:1", Endpoint.CHAT, "m", timeout_s=5, max_connections=1).body(spec)
    assert chat["messages"] == [{"role": "user", "content": "the cat"}] and "prompt" not in chat
    assert chat["ignore_eos"] is True and chat["stream_options"] == {"include_usage": True}


# ---- shared-prefix -------------------------------------------------------------------------------

def test_shared_prefix_exact_tokens_with_a_tokenizer(smollm_builder):
    specs = shared_prefix_requests(smollm_builder, 7, 3, 96, 12, 5, random.Random(0), chat=False)
    ids = [smollm_builder.encode(s.prompt) for s in specs]
    assert all(len(x) == 96 + 12 for x in ids) and {s.input_len for s in specs} == {108}
    assert {s.max_tokens for s in specs} == {5}
    for i, a in enumerate(ids):  # round-robin: request i has prefix i % 3
        for j, b in enumerate(ids):
            assert (a[:96] == b[:96]) == (i % 3 == j % 3)
    assert len({tuple(x[96:]) for x in ids}) == 7  # every suffix its own
    assert len({tuple(x[:96]) for x in ids}) == 3


def test_shared_prefix_with_words_is_seeded_and_round_robin():
    b = WordPromptBuilder()
    specs = shared_prefix_requests(b, 10, 4, 50, 8, 3, random.Random(1), chat=False)
    words = [s.prompt.split() for s in specs]
    assert all(len(w) == 58 for w in words)
    assert [" ".join(w[:50]) for w in words[:4]] == [" ".join(w[:50]) for w in words[4:8]]
    assert len({" ".join(w[:50]) for w in words}) == 4
    assert len({" ".join(w[50:]) for w in words}) == 10
    assert specs == shared_prefix_requests(b, 10, 4, 50, 8, 3, random.Random(1), chat=False)
    assert specs != shared_prefix_requests(b, 10, 4, 50, 8, 3, random.Random(2), chat=False)


def test_shared_prefix_chat_puts_the_prefix_in_the_system_message():
    specs = shared_prefix_requests(WordPromptBuilder(), 4, 2, 20, 5, 3, random.Random(0), chat=True)
    assert [[m["role"] for m in s.messages] for s in specs] == [["system", "user"]] * 4
    system = [s.messages[0]["content"] for s in specs]
    assert system[0] == system[2] != system[1] == system[3] and len(system[0].split()) == 20
    assert len({s.messages[1]["content"] for s in specs}) == 4
    body = StreamingClient("http://h:1", Endpoint.CHAT, "m", timeout_s=5, max_connections=1).body(specs[0])
    assert body["messages"] == list(specs[0].messages) and "prompt" not in body


def test_shared_prefix_refuses_what_it_cannot_build():
    with pytest.raises(WorkloadError, match="different suffixes"):  # 300 one-word suffixes from ~200 words
        shared_prefix_requests(WordPromptBuilder(), 300, 2, 8, 1, 3, random.Random(0), chat=False)
    with pytest.raises(WorkloadError, match="--num-prefixes"):
        shared_prefix_requests(WordPromptBuilder(), 3, 0, 8, 4, 3, random.Random(0), chat=False)
