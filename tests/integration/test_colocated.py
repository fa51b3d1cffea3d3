"""The colocated baseline (one worker, prefill + decode in one batch) behind the proxy's API."""

from __future__ import annotations

import concurrent.futures as cf
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port

PROMPTS = ["hello world", "the quick brown fox jumps", "one two three", "a b c d e f g"]


@pytest.fixture(scope="module")
def colocated(tmp_path_factory, tiny_model_dir: Path):
    c = Cluster(tmp_path_factory.mktemp("colocated"))
    wp, xp, lp = free_port(), free_port(), free_port()
    worker = f"http://127.0.0.1:{wp}"
    c.start("colocated", ["colocated", "--model", str(tiny_model_dir), "--dtype", "float32", "--threads", "1",
                          "--max-model-len", "256", "--batch-size", "3", "--port", str(wp)], worker)
    try:
        # (the proxies serve, and answer /health, once the worker answered its /xpyd/info)
        c.start("proxy", ["proxy", "--port", str(xp), "--colocated", worker], f"http://127.0.0.1:{xp}")
        c.start("limited", ["proxy", "--port", str(lp), "--colocated", worker, "--max-concurrent-requests", "1"],
                f"http://127.0.0.1:{lp}")
        c.wait_healthy()
    except BaseException:
        c.stop()
        raise
    yield {"proxy": f"http://127.0.0.1:{xp}", "worker": worker, "limited": f"http://127.0.0.1:{lp}"}
    c.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.numerics import decided_greedy

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    model64 = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float64).eval()

    def gen(prompt: str, n: int) -> str:
        """transformers' greedy text, every token decided beyond float32 error (so the worker's must match)."""
        ids = tok(prompt).input_ids
        return tok.decode(decided_greedy(model, model64, ids, n), skip_special_tokens=True)

    return gen


def _post(url: str, body: dict) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            return r.status, json.loads(raw) if not body.get("stream") else raw.decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_colocated_matches_generate_under_concurrency(colocated, reference):
    jobs = [(p, 6 + 3 * i) for i, p in enumerate(PROMPTS * 2)]  # more requests than the batch holds
    with cf.ThreadPoolExecutor(8) as ex:
        results = list(ex.map(lambda j: _post(colocated["proxy"] + "/v1/completions",
                                              {"prompt": j[0], "max_tokens": j[1], "temperature": 0}), jobs))
    for (prompt, n), (status, body) in zip(jobs, results):
        assert status == 200, body
        assert body["choices"][0]["text"] == reference(prompt, n)
        assert body["usage"]["completion_tokens"] == n


def test_colocated_streams_all_tokens(colocated, reference):
    status, raw = _post(colocated["proxy"] + "/v1/completions",
                        {"prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0, "stream": True})
    assert status == 200
    lines = [ln[6:] for ln in raw.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    text = "".join(json.loads(ln)["choices"][0]["text"] for ln in lines[:-1] if json.loads(ln)["choices"])
    assert text == reference(PROMPTS[1], 10)


def test_colocated_errors_and_metrics(colocated):
    status, body = _post(colocated["proxy"] + "/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert status == 400 and "error" in body
    status, body = _post(colocated["proxy"] + "/v1/completions", {"prompt": "x", "model": "nope"})
    assert status == 404
    metrics = urllib.request.urlopen(colocated["worker"] + "/metrics", timeout=5).read().decode()
    assert 'xpyd_kv_pool_used_bytes{role="colocated"} 0.0' in metrics
    assert 'xpyd_requests_in_flight{role="colocated",state="running"} 0.0' in metrics
    finished = [ln for ln in metrics.splitlines() if ln.startswith("xpyd_requests_total") and "finished" in ln]
    assert finished and float(finished[0].split()[-1]) >= 9


def test_colocated_proxy_limits_concurrent_requests(colocated):
    """--max-concurrent-requests 1: a stream holds the one place until it ends; meanwhile 429."""
    url = colocated["limited"] + "/v1/completions"
    body = json.dumps({"prompt": "hello", "max_tokens": 240, "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as stream:
        assert stream.readline().startswith(b"data: ")
        status, err = _post(url, {"prompt": "x", "max_tokens": 2})
        assert status == 429 and err["error"]["code"] == "rate_limit_exceeded", err
        rest = stream.read()
    assert rest.rstrip().endswith(b"data: [DONE]")
    status, body = _post(url, {"prompt": "x", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body


def test_a_clients_kv_transfer_params_never_reach_the_worker(colocated):
    """They are the proxies' to set for the workers: a client's would resume an output it names or name the
    response; the colocated proxy drops them (the answer is the plain request's)."""
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}
    status, plain = _post(colocated["proxy"] + "/v1/completions", body)
    assert status == 200
    forged = {**body, "kv_transfer_params": {"resume_token_ids": [1, 2, 3], "token_ids": True, "max_tokens": 2,
                                             "response": {"id": "cmpl-x", "created": 1, "model": "other"}}}
    status, got = _post(colocated["proxy"] + "/v1/completions", forged)
    assert status == 200, got
    assert got["choices"][0]["text"] == plain["choices"][0]["text"] and got["usage"] == plain["usage"]
    assert "xpyd_token_ids" not in got and got["model"] == plain["model"] and got["id"] != "cmpl-x"
