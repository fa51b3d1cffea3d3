"""Real worker processes (tiny random Llama): handshake refusals and the worker HTTP edge."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port
from xpyd.signal.request_id import RequestId, parse_request_id


@pytest.fixture(scope="module")
def workers(tmp_path_factory, tiny_model_dir: Path):
    """A prefill worker serving 'model-a' and a decode worker serving 'model-b' (mismatched on purpose),
    plus a decode worker serving 'model-a'."""
    c = Cluster(tmp_path_factory.mktemp("workers"))
    common = ["--model", str(tiny_model_dir), "--dtype", "float32", "--threads", "1", "--max-model-len", "256",
              "--batch-size", "2"]
    pp, ps = free_port(), free_port()
    urls = {"prefill": f"http://127.0.0.1:{pp}", "signal": f"127.0.0.1:{ps}"}
    c.start("prefill", ["prefill", *common, "--served-model-name", "model-a", "--port", str(pp),
                        "--signal-port", str(ps)], urls["prefill"])
    for name, served in (("decode_bad", "model-b"), ("decode_ok", "model-a")):
        port = free_port()
        urls[name] = f"http://127.0.0.1:{port}"
        c.start(name, ["decode", *common, "--served-model-name", served, "--port", str(port),
                       "--kv-port", str(free_port())], urls[name])
    try:
        c.wait_healthy()
    except BaseException:
        c.stop()
        raise
    yield urls
    c.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):
    """Greedy single-process transformers generate() on the same folder, float32: (text, tokens, finish)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()

    def generate(prompt: str, n: int) -> tuple[str, int, str]:
        ids = tok(prompt).input_ids
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=n, do_sample=False)
        new = out[0, len(ids):].tolist()
        finish = "stop" if new and new[-1] == tok.eos_token_id else "length"
        return tok.decode(new, skip_special_tokens=True), len(new), finish

    return generate


def _post(url: str, body: dict | bytes, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _info(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/xpyd/info", timeout=5).read())


def test_decode_with_mismatched_model_is_refused_at_handshake(workers):
    dinfo = _info(workers["decode_bad"])
    rid = RequestId.new(workers["signal"], dinfo["signal_addr"])
    status, body = _post(workers["decode_bad"] + "/v1/completions",
                         {"prompt": "hello", "max_tokens": 4, "model": "model-b"}, {"X-Request-Id": str(rid)})
    assert status == 502
    msg = body["error"]["message"]
    assert "handshake" in msg and "model mismatch" in msg and "model-a" in msg and "model-b" in msg
    _assert_idle(workers["decode_bad"])


def _assert_idle(url: str, timeout: float = 5.0) -> None:
    """Stats are published at the end of each engine step: wait for the step that failed the request."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        stats = json.loads(urllib.request.urlopen(url + "/xpyd/stats", timeout=5).read())
        idle = stats["blocks_used"] == 0 and stats["waiting"] == 0 and stats["running"] == 0
        if idle or time.monotonic() > deadline:
            assert idle, stats
            return
        time.sleep(0.05)


def test_matching_pair_serves_through_worker_apis(workers, reference):
    dinfo = _info(workers["decode_ok"])
    pinfo = _info(workers["prefill"])
    assert pinfo["role"] == "prefill" and dinfo["role"] == "decode" and pinfo["signal_addr"] == workers["signal"]
    rid = str(RequestId.new(workers["signal"], dinfo["signal_addr"]))
    import threading

    out = {}
    body = {"prompt": "hello world", "max_tokens": 6, "temperature": 0}

    def call(name, url, b):
        out[name] = _post(url + "/v1/completions", b, {"X-Request-Id": rid})

    t = threading.Thread(target=call, args=("d", workers["decode_ok"], {**body, "kv_transfer_params": {"role": "decode"}}))
    t.start()
    call("p", workers["prefill"], {**body, "max_tokens": 1, "kv_transfer_params": {"role": "prefill", "max_tokens": 6}})
    t.join(60)
    (ps, pbody), (ds, dbody) = out["p"], out["d"]
    assert ps == 200 and ds == 200, (pbody, dbody)
    assert pbody["id"] == dbody["id"] == "cmpl-" + parse_request_id(rid).uid  # one request on both (named by the id's random part: no address)
    want_text, want_n, want_finish = reference(body["prompt"], 6)
    first_text, first_n, _ = reference(body["prompt"], 1)
    # prefill answers with the first token; decode continues after it (the proxy joins the two texts)
    assert pbody["choices"][0]["text"] == first_text and pbody["usage"]["completion_tokens"] == first_n == 1
    assert pbody["choices"][0]["text"] + dbody["choices"][0]["text"] == want_text
    assert dbody["usage"]["completion_tokens"] == want_n
    assert dbody["choices"][0]["finish_reason"] == want_finish


@pytest.mark.parametrize("headers,body,status,needle", [
    ({}, {"prompt": "x"}, 400, "X-Request-Id"),
    ({"X-Request-Id": "nope"}, {"prompt": "x"}, 400, "malformed request id"),
    ({"X-Request-Id": "RID"}, {"prompt": "x", "model": "other"}, 404, "does not exist"),
    ({"X-Request-Id": "RID"}, b"{bad json", 400, ""),
    ({"X-Request-Id": "RID"}, {"prompt": "x", "kv_transfer_params": {"max_tokens": 0}}, 400, "max_tokens"),
    ({"X-Request-Id": "RID"}, {"prompt": "x", "max_tokens": 256}, 400, "context length"),
    ({"X-Request-Id": "RID"}, {"prompt": [999999999]}, 400, "vocabulary"),  # (a token list needs no tokenizer)
    ({"X-Request-Id": "RID"}, {"prompt": list(range(1, 300))}, 400, "context length"),
])
@pytest.mark.parametrize("role", ["prefill", "decode_ok"])
def test_worker_rejects_bad_requests(workers, role, headers, body, status, needle):
    _rejects(workers, role, headers, body, status, needle)


def test_prefill_rejects_a_text_prompt_over_the_context(workers):
    """A text prompt is tokenized once, by prefill: the decode worker takes its length from prefill's "ready"
    (the proxy sends both the same request; prefill's 400 is the client's answer)."""
    _rejects(workers, "prefill", {"X-Request-Id": "RID"}, {"prompt": "x " * 400}, 400, "context length")


def _rejects(workers, role, headers, body, status, needle):
    if headers.get("X-Request-Id") == "RID":
        headers = {"X-Request-Id": str(RequestId.new(workers["signal"], _info(workers["decode_ok"])["signal_addr"]))}
    got, resp = _post(workers[role] + "/v1/completions", body, headers)
    assert got == status, resp
    assert needle in resp["error"]["message"]
    _assert_idle(workers[role])
