"""Sampling and output parameters through the proxy, P/D against colocated, token for token: penalties,
min_p, logit_bias, min_tokens with stop_token_ids (prefill samples token 1 under the same bans; decode counts it),
a stop token that ends the request on prefill, a stop string kept in the output, and ``stop_reason`` in the
JSON and in the stream. Once with simulated workers, once with the real tiny model (whose greedy penalized
tokens are also checked against a float64 reference computed here)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"
FORCED = 1234  # a token every request below can be made to pick with logit_bias


def _post(url: str, body: dict):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{url}: {e.code} {e.read()[:500]!r}") from None
    if not body.get("stream"):
        return json.loads(raw)
    events = [json.loads(ln[6:]) for ln in raw.decode().splitlines() if ln.startswith("data: {")]
    choices = [c for e in events for c in e["choices"]]
    assert all("error" not in e for e in events), events
    last = choices[-1]
    return {"text": "".join(c["text"] for c in choices), "finish_reason": last["finish_reason"],
            "stop_reason": last.get("stop_reason"), "completion_tokens": events[-1]["usage"]["completion_tokens"]}


def _answer(url: str, body: dict) -> dict:
    """The JSON answer's choice and token count, and the same from the stream (they must agree)."""
    j = _post(url, {**body, "prompt": PROMPT})
    c = j["choices"][0]
    got = {"text": c["text"], "finish_reason": c["finish_reason"], "stop_reason": c["stop_reason"],
           "completion_tokens": j["usage"]["completion_tokens"]}
    streamed = _post(url, {**body, "prompt": PROMPT, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed == got
    return got


def _start(c: Cluster, options: list[str]) -> dict[str, str]:
    pp, ps, dp, dk, xp, wp, cp = (free_port() for _ in range(7))
    urls = {"prefill": f"http://127.0.0.1:{pp}", "decode": f"http://127.0.0.1:{dp}",
            "colocated": f"http://127.0.0.1:{wp}"}
    c.start("prefill", ["prefill", *options, "--port", str(pp), "--signal-port", str(ps)], urls["prefill"])
    c.start("decode", ["decode", *options, "--port", str(dp), "--kv-port", str(dk)], urls["decode"])
    c.start("colocated", ["colocated", *options, "--port", str(wp)], urls["colocated"])
    # (the proxies start with the workers: each serves, and answers /health, once its workers answered their
    # /xpyd/info)
    pd, co = f"http://127.0.0.1:{xp}", f"http://127.0.0.1:{cp}"
    c.start("pd-proxy", ["proxy", "--port", str(xp), "--prefill", urls["prefill"], "--decode", urls["decode"]], pd)
    c.start("colocated-proxy", ["proxy", "--port", str(cp), "--colocated", urls["colocated"]], co)
    c.wait_healthy()
    return {"pd": pd, "colocated": co}


@pytest.fixture(scope="module", params=["sim", "tiny"])
def cluster(request, tmp_path_factory, smollm_dir: Path):
    if request.param == "sim":
        model = smollm_dir
        options = ["--model", str(model), "--engine", "sim", "--sim-speedup", "inf"]
    else:
        model = request.getfixturevalue("tiny_model_dir")
        options = ["--model", str(model), "--dtype", "float32"]
    options += ["--threads", "1", "--batch-size", "4", "--max-model-len", "256", "--served-model-name", "m"]
    c = Cluster(tmp_path_factory.mktemp(f"sampling-{request.param}"))
    try:
        urls = _start(c, options)
    except BaseException:
        c.stop()
        raise
    yield request.param, urls, model
    c.stop()


CASES = {
    # tiny: FORCED wins by ~11 with its bias, then the penalties put it behind (the random model repeats nothing
    # of its own, so the penalties need a token it was made to repeat)
    "penalties-greedy": {"temperature": 0, "logit_bias": {str(FORCED): 30}, "presence_penalty": 1.2,
                         "frequency_penalty": 0.5, "repetition_penalty": 2.0, "max_tokens": 12, "ignore_eos": True},
    "penalties-seeded": {"temperature": 0.9, "seed": 5, "top_k": 20, "min_p": 0.05, "frequency_penalty": 0.8,
                         "max_tokens": 12, "ignore_eos": True},
    "min-p-seeded": {"temperature": 1.3, "seed": 77, "min_p": 0.2, "max_tokens": 10, "ignore_eos": True},
    "negative-presence": {"temperature": 0, "presence_penalty": -2.0, "max_tokens": 10, "ignore_eos": True},
    # sim: FORCED (a token at -8, the floor) leads by 0.5 until generated once; then the penalty puts it behind
    "bias-and-presence": {"temperature": 0, "logit_bias": {str(FORCED): 8.5}, "presence_penalty": 1.0,
                          "max_tokens": 10, "ignore_eos": True},
}
# Where the penalties and min_p change the tokens (the case means something). On the simulated engine the greedy
# token leads the next candidate by 1 logit and a sequence rarely repeats a token: greedy penalties alone change
# nothing there.
CHANGED = {"penalties-greedy": {"tiny"}, "penalties-seeded": {"sim", "tiny"}, "min-p-seeded": {"sim", "tiny"},
           "negative-presence": set(), "bias-and-presence": {"sim"}}


@pytest.mark.parametrize("case", list(CASES))
def test_pd_gives_the_colocated_tokens(cluster, case):
    engine, urls, _ = cluster
    body = CASES[case]
    pd, co = _answer(urls["pd"], body), _answer(urls["colocated"], body)
    assert pd == co
    assert pd["completion_tokens"] == body["max_tokens"] and pd["finish_reason"] == "length"
    assert pd["stop_reason"] is None
    if engine in CHANGED[case]:
        plain = _answer(urls["colocated"], {k: v for k, v in body.items() if "penalty" not in k and k != "min_p"})
        assert plain["text"] != pd["text"]


def test_logit_bias_min_tokens_and_a_stop_token(cluster, smollm_dir):
    """logit_bias forces FORCED; min_tokens 3 bans it (a stop token id) for tokens 1-3, on prefill and decode
    alike; token 4 is FORCED and stops the request with it as the stop reason."""
    from xpyd.tokenization.tokenizer import LightTokenizer

    _, urls, _ = cluster
    forced = LightTokenizer.from_folder(smollm_dir).decode([FORCED])
    bias = {"temperature": 0, "logit_bias": {str(FORCED): 100}, "max_tokens": 10}
    only = _answer(urls["pd"], bias)
    assert only == _answer(urls["colocated"], bias)
    assert only["text"] == forced * 10
    body = {**bias, "stop_token_ids": [FORCED], "min_tokens": 3}
    pd = _answer(urls["pd"], body)
    assert pd == _answer(urls["colocated"], body)
    assert pd["completion_tokens"] == 4 and pd["finish_reason"] == "stop" and pd["stop_reason"] == FORCED
    assert forced not in pd["text"]  # the stop token's text is left out
    # no min_tokens: token 1 (sampled by prefill) stops it; the proxy answers with prefill's stop reason
    first = _answer(urls["pd"], {**bias, "stop_token_ids": [FORCED]})
    assert first == _answer(urls["colocated"], {**bias, "stop_token_ids": [FORCED]})
    assert first == {"text": "", "finish_reason": "stop", "stop_reason": FORCED, "completion_tokens": 1}
    kept = _answer(urls["pd"], {**bias, "stop_token_ids": [FORCED], "include_stop_str_in_output": True})
    assert kept["text"] == forced and kept["stop_reason"] == FORCED


def test_a_stop_string_kept_in_the_output(cluster):
    _, urls, _ = cluster
    body = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
    full = _answer(urls["colocated"], body)["text"]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip()
    cut = full.find(stop)
    for include in (False, True):
        b = {**body, "stop": [stop], "include_stop_str_in_output": include}
        pd = _answer(urls["pd"], b)
        assert pd == _answer(urls["colocated"], b)
        assert pd["text"] == full[: cut + (len(stop) if include else 0)]
        assert pd["finish_reason"] == "stop" and pd["stop_reason"] == stop


def test_penalized_greedy_tokens_match_a_float64_reference(cluster):
    """The tiny model's greedy tokens under penalties are those of its float64 logits through vLLM's penalties
    (computed here), every step decided by more than float32 error."""
    engine, urls, tiny = cluster
    if engine != "tiny":
        pytest.skip("the sim engine has no logits of a model")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    body = CASES["penalties-greedy"]
    tok = AutoTokenizer.from_pretrained(str(tiny))
    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float64).eval()
    prompt = tok(PROMPT).input_ids
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(body["max_tokens"]):
            x = model(torch.tensor([prompt + out])).logits[0, -1].clone()
            for t, b in body["logit_bias"].items():
                x[int(t)] += b
            for t in set(prompt) | set(out):
                x[t] = x[t] / body["repetition_penalty"] if x[t] > 0 else x[t] * body["repetition_penalty"]
            for t in set(out):
                x[t] -= body["frequency_penalty"] * out.count(t) + body["presence_penalty"]
            top = x.topk(2).values
            assert float(top[0] - top[1]) > 1e-4, "a step is not decided beyond float32 error"
            out.append(int(x.argmax()))
    assert _answer(urls["pd"], body)["text"] == tok.decode(out, skip_special_tokens=True)
