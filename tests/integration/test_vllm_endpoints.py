"""vLLM's /tokenize, /detokenize, /version, max_model_len in /v1/models and the vllm:* metrics, on real sim
workers (1P1D) and two proxies in front of them: a cache-aware one, which answers /tokenize from its copy of the
workers' tokenizer, and a round-robin one under another model name, which forwards to a worker."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

import xpyd
from tests.cluster import Cluster, free_port, wait_until
from tests.integration.test_metrics_endpoints import Delta, scrape, value
from tests.integration.test_sim_worker import sim_options  # noqa: F401 (a fixture)

MAX_LEN = 512
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
PROMPTS = ["hello world", "The capital of France is", "Héllo wörld 🙂 " * 5, "a b c d e f g"]
L = {"model_name": None, "engine": "0"}  # model_name: the served name, filled in by the fixture


def call(url: str, body: dict | None = None, content_type: str = "application/json") -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def ok(url: str, body: dict | None = None) -> dict:
    status, answer = call(url, body)
    assert status == 200, (url, answer)
    return answer


@pytest.fixture(scope="module")
def urls(tmp_path_factory, sim_options):  # noqa: F811
    c = Cluster(tmp_path_factory.mktemp("vllm-endpoints"))
    try:
        out = {}
        for role, extra in (("prefill", ["--signal-port", str(free_port())]), ("decode", ["--kv-port", str(free_port())])):
            port = free_port()
            out[role] = f"http://127.0.0.1:{port}"
            c.start(role, [role, *sim_options, "--kv-backend", "tcp", "--port", str(port), *extra], out[role])
        c.wait_healthy()
        for name, extra in (("aware", ["--policy", "cache_aware"]),
                            ("forward", ["--policy", "round_robin", "--model-name", "alias"])):
            port = free_port()
            out[name] = f"http://127.0.0.1:{port}"
            c.start(name, ["proxy", "--port", str(port), "--prefill", out["prefill"], "--decode", out["decode"],
                           *extra], out[name])
        c.wait_healthy()

        def aware_ready() -> bool:  # its tokenizer copy fetched, and the workers' max_model_len known
            return (ok(out["aware"] + "/cluster")["tokenizer"] is not None
                    and ok(out["aware"] + "/v1/models")["data"][0]["max_model_len"] == MAX_LEN)

        wait_until(aware_ready, 60, "the cache-aware proxy's tokenizer and max_model_len")
        yield out
    finally:
        c.stop()


def _tokenize_requests() -> list[dict]:
    out = []
    for prompt in PROMPTS:
        out += [{"prompt": prompt}, {"prompt": prompt, "add_special_tokens": False, "return_token_strs": True}]
    out += [{"messages": CHAT}, {"messages": CHAT, "add_generation_prompt": False},
            {"messages": CHAT, "add_special_tokens": True, "return_token_strs": True},
            {"messages": [*CHAT, {"role": "assistant", "content": "Sure, here "}], "add_generation_prompt": False,
             "continue_final_message": True},
            {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}, "documents": [{"text": "d"}]}]
    return out


def _worker_route_count(url: str, route: str) -> float:
    return sum(v for (name, labels), v in scrape(url).items()
               if name == "xpyd_http_requests_total" and dict(labels)["route"] == route)


def test_tokenize_is_the_same_on_every_worker_and_proxy(urls):
    served = ok(urls["prefill"] + "/v1/models")["data"][0]["id"]
    asked = _worker_route_count(urls["prefill"], "/tokenize") + _worker_route_count(urls["decode"], "/tokenize")
    for body in _tokenize_requests():
        answers = {name: ok(urls[name] + "/tokenize", body) for name in ("prefill", "decode", "aware")}
        answers["forward"] = ok(urls["forward"] + "/tokenize", {**body, "model": "alias"})
        answers["named"] = ok(urls["prefill"] + "/tokenize", {**body, "model": served})
        a = answers["prefill"]
        assert all(x == a for x in answers.values()), (body, answers)
        assert a["count"] == len(a["tokens"]) > 0 and a["max_model_len"] == MAX_LEN
        if body.get("return_token_strs"):
            assert len(a["token_strs"]) == a["count"] and all(isinstance(s, str) for s in a["token_strs"])
        else:
            assert a["token_strs"] is None
    # the cache-aware proxy answered from its copy (no worker was asked by it); the other forwarded each one
    n = len(_tokenize_requests())
    now = _worker_route_count(urls["prefill"], "/tokenize") + _worker_route_count(urls["decode"], "/tokenize")
    assert now - asked == 4 * n  # prefill, decode, named: 3n direct; forward: n

    # the switches do what they say
    plain = ok(urls["aware"] + "/tokenize", {"prompt": PROMPTS[1], "add_special_tokens": False})["tokens"]
    with_specials = ok(urls["aware"] + "/tokenize", {"prompt": PROMPTS[1]})["tokens"]
    assert with_specials[-len(plain):] == plain
    chat = ok(urls["aware"] + "/tokenize", {"messages": CHAT})["tokens"]
    no_prompt = ok(urls["aware"] + "/tokenize", {"messages": CHAT, "add_generation_prompt": False})["tokens"]
    assert len(no_prompt) < len(chat) and chat[:len(no_prompt)] == no_prompt


def test_tokenize_counts_what_generation_counts(urls):
    for body, path in (({"prompt": PROMPTS[2]}, "/v1/completions"), ({"messages": CHAT}, "/v1/chat/completions")):
        count = ok(urls["aware"] + "/tokenize", body)["count"]
        usage = ok(urls["aware"] + path, {**body, "max_tokens": 2})["usage"]
        assert usage["prompt_tokens"] == count


def test_detokenize_and_version(urls):
    text = "The capital of France is Paris."
    ids = ok(urls["prefill"] + "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
    for name in ("prefill", "decode", "aware", "forward"):
        assert ok(urls[name] + "/detokenize", {"tokens": ids}) == {"prompt": text}
        assert ok(urls[name] + "/detokenize", {"tokens": []}) == {"prompt": ""}
        assert ok(urls[name] + "/version") == {"version": xpyd.__version__}


@pytest.mark.parametrize("name", ["prefill", "aware", "forward"])
def test_tokenize_errors(urls, name):
    url = urls[name]
    cases = [
        ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, "messages"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": ["x"]}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs"),
        ("/tokenize", {"messages": [{"role": "nobody", "content": "x"}]}, 400, "messages"),
        ("/tokenize", {"prompt": "x", "model": "another"}, 404, "model"),
        ("/detokenize", {"tokens": [1, -2]}, 400, "tokens"),
        ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens"),
    ]
    for path, body, status, param in cases:
        got, answer = call(url + path, body)
        assert (got, answer["error"]["param"]) == (status, param), (path, body, answer)
        assert isinstance(answer["error"]["message"], str) and answer["error"]["type"]
    got, answer = call(url + "/tokenize", {"prompt": "x"}, content_type="text/plain")
    assert got == 415 and "error" in answer


def test_models_list_max_model_len(urls):
    for name in ("prefill", "decode", "aware", "forward"):
        (model,) = ok(urls[name] + "/v1/models")["data"]
        assert model["max_model_len"] == MAX_LEN and model["root"] == model["id"] and model["parent"] is None
    assert ok(urls["forward"] + "/v1/models")["data"][0]["id"] == "alias"


def _idle(urls) -> dict[str, dict]:
    got: dict[str, dict] = {}

    def idle() -> bool:
        got.update({role: scrape(urls[role]) for role in ("prefill", "decode")})
        return all(v == 0 for role in got for (name, _), v in got[role].items()
                   if name in ("xpyd_requests_in_flight", "vllm:num_requests_running", "vllm:num_requests_waiting",
                               "vllm:kv_cache_usage_perc"))

    wait_until(idle, 30, "both workers idle")
    return got


def _generate(url: str, prompt: str, stream: bool, max_tokens: int) -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        if not stream:
            return json.loads(r.read())["usage"]["prompt_tokens"]
        chunks = [json.loads(line[5:]) for line in r.read().decode().splitlines() if line.startswith("data: {")]
    return [c["usage"] for c in chunks if c.get("usage")][-1]["prompt_tokens"]


def test_vllm_metrics_count_each_request_once(urls):
    served = ok(urls["prefill"] + "/v1/models")["data"][0]["id"]
    lab = {**L, "model_name": served}
    max_tokens = 5
    before = _idle(urls)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        prompt_tokens = list(pool.map(_generate, [urls["aware"]] * len(PROMPTS), PROMPTS,
                                      [i % 2 == 0 for i in range(len(PROMPTS))], [max_tokens] * len(PROMPTS)))
    n = len(PROMPTS)
    after = _idle(urls)
    p, d = Delta(after["prefill"], before["prefill"]), Delta(after["decode"], before["decode"])

    # tokens: prefill computed every prompt and made every first token; decode made the rest
    assert value(p, "vllm:prompt_tokens_total", **lab) == sum(prompt_tokens)
    assert value(d, "vllm:prompt_tokens_total", **lab) == 0
    assert value(p, "vllm:generation_tokens_total", **lab) == n
    assert value(d, "vllm:generation_tokens_total", **lab) == n * (max_tokens - 1)
    # request ends: decode ended each (max_tokens reached: "length"), prefill none
    for reason in ("stop", "length", "abort", "error", "repetition"):
        assert value(p, "vllm:request_success_total", **lab, finished_reason=reason) == 0
        assert value(d, "vllm:request_success_total", **lab, finished_reason=reason) == (n if reason == "length"
                                                                                          else 0)
    assert value(d, "vllm:request_prompt_tokens_sum", **lab) == sum(prompt_tokens)
    assert value(d, "vllm:request_generation_tokens_sum", **lab) == n * max_tokens
    assert value(d, "vllm:request_generation_tokens_count", **lab) == n
    # histograms: each request once (TTFT on prefill, E2E on decode), each gap between decode's tokens once
    assert value(p, "vllm:time_to_first_token_seconds_count", **lab) == n
    assert value(p, "vllm:time_to_first_token_seconds_bucket", **lab, le="+Inf") == n
    assert value(d, "vllm:time_to_first_token_seconds_count", **lab) == 0
    assert value(d, "vllm:e2e_request_latency_seconds_count", **lab) == n
    assert value(p, "vllm:e2e_request_latency_seconds_count", **lab) == 0
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert value(d, name + "_count", **lab) == n * (max_tokens - 2)
        assert value(p, name + "_count", **lab) == 0
    # the prefix caches: the same counts as xpyd's own series
    for m, role in ((p, "prefill"), (d, "decode")):
        assert value(m, "vllm:prefix_cache_queries_total", **lab) == value(m, "xpyd_prefix_cache_queries_total",
                                                                            role=role)
        assert value(m, "vllm:prefix_cache_hits_total", **lab) == value(m, "xpyd_prefix_cache_hits_total", role=role)
    assert value(p, "vllm:prefix_cache_queries_total", **lab) == sum(prompt_tokens)
