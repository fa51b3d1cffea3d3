"""The whole 1P1D cluster as real processes with the real model (SmolLM2-135M, float32).

Text through the proxy must be token-for-token what single-process
transformers ``generate`` produces on the same converted model. The prefill worker runs with
``--prefill-chunk 16``: every prompt here but the shortest is computed in chunks, and concurrent
requests share forward passes, and each prompt's KV streams to decode in parts while its later chunks
compute, so these checks cover chunked and packed prefill and streamed KV end to end.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import start_1p1d

MAX_MODEL_LEN = 512
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smollm_dir: Path):
    c, urls = start_1p1d(tmp_path_factory.mktemp("cluster"), str(smollm_dir), dtype="float32",
                         batch_size=8, max_model_len=MAX_MODEL_LEN, prefill_extra=["--prefill-chunk", "16"])
    yield urls
    c.stop()


@pytest.fixture(scope="module")
def reference(smollm_dir: Path):
    """Greedy single-process generate() on the same folder, float32; each token decided by more than
    float32 error (tests/numerics.py), so the cluster's float32 paths must give the same ones."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.numerics import decided_greedy
    from xpyd.model.tokenizer import encode_chat, encode_prompt

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(str(smollm_dir))
    model = AutoModelForCausalLM.from_pretrained(str(smollm_dir), dtype=torch.float32).eval()
    model64 = copy.deepcopy(model).double()  # every reference token is decided beyond float32 error
    cache: dict = {}

    def generate(*, prompt=None, messages=None, max_tokens=NEW_TOKENS) -> tuple[str, int, str]:
        key = (json.dumps(prompt), json.dumps(messages), max_tokens)
        if key not in cache:
            ids = encode_chat(tok, messages) if messages is not None else encode_prompt(tok, prompt)
            new = decided_greedy(model, model64, ids, max_tokens)
            finish = "stop" if new and new[-1] in (tok.eos_token_id,) else "length"
            cache[key] = (tok.decode(new, skip_special_tokens=True), len(new), finish)
        return cache[key]

    return generate


@pytest.fixture(scope="module")
def sampled_reference(smollm_dir: Path):
    """Seeded sampling in one process: the model runner and sampling here, one generator made from the
    request's seed and drawing once per token, as the colocated worker runs it. The disaggregated path
    must produce the same tokens: prefill draws for the first token, decode skips that draw and goes on
    with the rest of the same stream."""
    import torch

    from xpyd.model.output import OutputProcessor, StopParams
    from xpyd.model.runner import ModelRunner
    from xpyd.model.sampling import SamplingParams, make_generator, sample
    from xpyd.model.tokenizer import encode_prompt, load_tokenizer

    torch.set_num_threads(1)  # as the workers (--threads 1)
    runner = ModelRunner(smollm_dir, torch.float32, num_blocks=MAX_MODEL_LEN // 16, max_seq_len=MAX_MODEL_LEN)
    tok = load_tokenizer(smollm_dir)

    def generate(body: dict) -> tuple[str, int, str]:
        params = SamplingParams(temperature=body["temperature"], top_p=body["top_p"], top_k=body["top_k"],
                                seed=body["seed"])
        generator = make_generator(params.seed)
        out = OutputProcessor(tok, StopParams(max_tokens=body["max_tokens"], eos_token_ids=runner.eos_token_ids))
        ids = encode_prompt(tok, body["prompt"])
        blocks = runner.pool.blocks
        table = blocks.allocate(runner.pool.layout.blocks_for(len(ids)))
        try:
            token = sample(runner.prefill(table, ids).unsqueeze(0), [params], [generator])[0]
            while out.append(token)[1] is None:
                position = len(ids) + len(out.token_ids) - 1
                if position // runner.block_size == len(table):  # the token starts a new block
                    table += blocks.allocate(1)
                token = sample(runner.decode([table], [token], [position]), [params], [generator])[0]
        finally:
            blocks.release(table)
        return out.text, len(out.token_ids), out.finished.value

    return generate


@pytest.fixture(scope="module")
def background():
    """One thread of this process for the references: a test starts computing what it expects, then sends
    the same request through the cluster while it runs (the workers run one thread each, and while decode
    steps run, the other core is free). Tests wait for the result before comparing."""
    with cf.ThreadPoolExecutor(1, thread_name_prefix="reference") as ex:
        yield ex


def post(url: str, body: dict | bytes, timeout: float = 120) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream(url: str, body: dict, timeout: float = 120) -> list[dict]:
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for raw in r:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: ")
            if line == "data: [DONE]":
                chunks.append({"done": True})
                break
            chunks.append(json.loads(line[6:]))
    assert chunks and chunks[-1] == {"done": True}
    return chunks[:-1]


def _text(kind: str, resp: dict) -> str:
    c = resp["choices"][0]
    return c["text"] if kind == "completion" else c["message"]["content"]


def _stream_text(kind: str, chunks: list[dict]) -> str:
    parts = []
    for ch in chunks:
        for c in ch.get("choices", []):
            parts.append(c["text"] if kind == "completion" else (c["delta"].get("content") or ""))
    return "".join(parts)


CASES = [
    ("completion", {"prompt": "Once upon a time, in a small village by the sea,"}),
    ("chat", {"messages": [{"role": "user", "content": "Write a short poem about the ocean."}]}),
    ("chat", {"messages": [{"role": "user", "content": "Explique-moi la photosynthèse. 光合作用是什么？ 🌱🌞"}]}),
    ("completion", {"prompt": "Café, naïve, façade — 東京と大阪 😀👍🏽 are words in"}),
]


@pytest.mark.parametrize("kind,body", CASES, ids=["completion", "chat", "chat-non-ascii", "completion-non-ascii"])
def test_matches_transformers_generate(cluster, reference, background, kind, body):
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    expected = background.submit(reference, **body)
    req = {**body, "max_tokens": NEW_TOKENS, "temperature": 0}
    status, resp = post(cluster["proxy"] + path, req)
    want_text, want_n, want_finish = expected.result()
    assert want_n >= 32 or want_finish == "stop"
    assert status == 200, resp
    assert _text(kind, resp) == want_text
    assert resp["usage"]["completion_tokens"] == want_n
    assert resp["choices"][0]["finish_reason"] == want_finish

    chunks = stream(cluster["proxy"] + path, {**req, "stream_options": {"include_usage": True}})
    assert _stream_text(kind, chunks) == want_text
    if kind == "chat":
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finishes = [c["finish_reason"] for ch in chunks for c in ch.get("choices", []) if c.get("finish_reason")]
    assert finishes == [want_finish]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == want_n
    ids = {ch["id"] for ch in chunks}
    assert len(ids) == 1


def test_prompts_were_computed_in_chunks(cluster):
    """(Runs after the exactness tests above: the prefill worker chunked and packed their prompts.)"""
    with urllib.request.urlopen(cluster["prefill"] + "/xpyd/stats", timeout=10) as r:
        stats = json.load(r)
    assert stats["prefill_chunk"] == 16
    assert stats["prefill_partial_chunks"] > 0 and stats["prefill_steps"] > 0
    assert stats["prefill_tokens"] >= stats["prefill_steps"]
    assert stats["kv_stream"] and stats["kv_parts_streamed"] > 0  # KV sent while later chunks computed


def test_capital_of_france(cluster):
    status, resp = post(cluster["proxy"] + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 20,
        "temperature": 0})
    assert status == 200
    assert resp["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert resp["choices"][0]["finish_reason"] == "stop"


def test_openai_client(cluster):
    import openai

    client = openai.OpenAI(base_url=cluster["proxy"] + "/v1", api_key="unused", timeout=120)
    models = client.models.list()
    model = models.data[0].id
    c = client.completions.create(model=model, prompt="The three primary colors are", max_tokens=12,
                                  temperature=0)
    assert c.choices[0].text and c.usage.completion_tokens == 12
    s = "".join(ch.choices[0].text for ch in client.completions.create(
        model=model, prompt="The three primary colors are", max_tokens=12, temperature=0, stream=True)
        if ch.choices)
    assert s == c.choices[0].text
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].message.role == "assistant"
    parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=model, messages=msgs, max_tokens=20, temperature=0, stream=True) if ch.choices]
    assert "".join(parts) == "The capital of France is Paris."


def test_eight_concurrent_requests_continuous_batching(cluster, reference, background):
    prompts = [
        "The history of Rome",
        "In computer science, a hash table is",
        "My favourite recipe for pancakes starts with",
        "Photosynthesis is the process by which plants convert sunlight into chemical energy. It",
        "List of planets:",
        "A long time ago in a galaxy far, far away, there lived a young farmer who dreamed of",
        "Once",
        "The quick brown fox jumps over the lazy dog. The quick brown fox",
    ]
    max_tokens = [5, 33, 12, 40, 20, 8, 27, 16]
    jobs = [({"prompt": p, "max_tokens": m, "temperature": 0}, m) for p, m in zip(prompts, max_tokens)]
    expected = [background.submit(reference, prompt=body["prompt"], max_tokens=m) for body, m in jobs]
    with cf.ThreadPoolExecutor(8) as ex:
        results = list(ex.map(lambda j: post(cluster["proxy"] + "/v1/completions", j[0]), jobs))
    for (body, m), (status, resp), want in zip(jobs, results, expected):
        assert status == 200, resp
        want_text, want_n, want_finish = want.result()
        assert resp["choices"][0]["text"] == want_text, body["prompt"]
        assert resp["usage"]["completion_tokens"] == want_n
        assert resp["choices"][0]["finish_reason"] == want_finish


def _assert_openai_error(status: int, resp: dict, code_range=(400, 499)) -> None:
    assert code_range[0] <= status <= code_range[1], (status, resp)
    assert isinstance(resp.get("error"), dict) and resp["error"]["message"], resp


def test_bad_requests_get_openai_errors_and_cluster_keeps_serving(cluster):
    url = cluster["proxy"]
    _assert_openai_error(*post(url + "/v1/completions", b"{not json"))
    _assert_openai_error(*post(url + "/v1/chat/completions", {"max_tokens": 5}))
    _assert_openai_error(*post(url + "/v1/completions", {"max_tokens": 5}))
    _assert_openai_error(*post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 0}))
    _assert_openai_error(*post(url + "/v1/completions", {"prompt": "hi", "max_tokens": -3}))
    status, resp = post(url + "/v1/completions", {"prompt": "hi", "model": "no-such-model"})
    _assert_openai_error(status, resp)
    assert status == 404
    long_prompt = "hello " * (MAX_MODEL_LEN + 50)
    status, resp = post(url + "/v1/completions", {"prompt": long_prompt, "max_tokens": 5})
    _assert_openai_error(status, resp)
    assert "context length" in resp["error"]["message"]
    status, resp = post(url + "/v1/completions", {"prompt": "hi " * 100, "max_tokens": MAX_MODEL_LEN})
    _assert_openai_error(status, resp)
    # still serving, and nothing was left behind on either worker
    status, resp = post(url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 20,
        "temperature": 0})
    assert status == 200 and resp["choices"][0]["message"]["content"] == "The capital of France is Paris."
    _assert_workers_idle(cluster)


def _assert_workers_idle(cluster, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while True:
        stats = [json.loads(urllib.request.urlopen(cluster[r] + "/xpyd/stats", timeout=5).read())
                 for r in ("prefill", "decode")]
        idle = all(s["kv_used_bytes"] == 0 and s["blocks_used"] == 0 and s["waiting"] == 0
                   and s["running"] == 0 and s["transferring"] == 0 for s in stats)
        if idle or time.monotonic() > deadline:
            assert idle, stats
            return
        time.sleep(0.1)


SEEDED = {"prompt": "Here is a list of fruits:", "max_tokens": 24, "temperature": 0.9, "top_p": 0.95,
          "top_k": 50, "seed": 1234}


@pytest.mark.parametrize("seed", [1234, 7])
def test_seeded_sampling_matches_a_single_process_run(cluster, sampled_reference, background, seed):
    """Prefill samples token 1, decode tokens 2..n from the same seeded stream: together they must give
    exactly the text one process sampling the whole request gives (not only the same text twice)."""
    url = cluster["proxy"] + "/v1/completions"
    body = {**SEEDED, "seed": seed}
    expected = background.submit(sampled_reference, body)
    other_seed = background.submit(sampled_reference, {**body, "seed": seed + 1})
    status, resp = post(url, body)
    want_text, want_n, want_finish = expected.result()
    assert want_text != other_seed.result()[0]  # the seed matters for this prompt
    assert status == 200, resp
    assert resp["choices"][0]["text"] == want_text
    assert resp["usage"]["completion_tokens"] == want_n
    assert resp["choices"][0]["finish_reason"] == want_finish
    assert post(url, body)[1]["choices"][0]["text"] == want_text  # and again
    assert _stream_text("completion", stream(url, body)) == want_text


def test_stop_strings_max_tokens_and_ignore_eos(cluster):
    url = cluster["proxy"] + "/v1/completions"
    # stop strings: output truncated before the stop string, finish_reason stop
    greedy = {"prompt": "Count: 1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 30, "temperature": 0}
    full = post(url, greedy)[1]["choices"][0]["text"]
    assert " 11" in full
    status, resp = post(url, {**greedy, "stop": [" 11"]})
    assert status == 200
    assert resp["choices"][0]["text"] == full[: full.index(" 11")]
    assert resp["choices"][0]["finish_reason"] == "stop"
    st = stream(url, {**greedy, "stop": [" 11"]})
    assert _stream_text("completion", st) == full[: full.index(" 11")]
    # max_tokens=1 and ignore_eos
    status, resp = post(url, {**greedy, "max_tokens": 1})
    assert resp["usage"]["completion_tokens"] == 1 and resp["choices"][0]["finish_reason"] == "length"
    chat = cluster["proxy"] + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    status, resp = post(chat, {"messages": msgs, "max_tokens": 30, "temperature": 0, "ignore_eos": True})
    assert resp["usage"]["completion_tokens"] == 30 and resp["choices"][0]["finish_reason"] == "length"
    _assert_workers_idle(cluster)
