"""OpenAI request parsing (xpyd.api.openai) and response builders (xpyd.api.responses)."""

import json

import pytest

from xpyd.api.openai import APIError, RequestKind, parse_request
from xpyd.api.responses import (
    SSE_DONE,
    completion_response,
    models_response,
    new_response_id,
    sse,
    stream_chunk,
    usage_chunk,
)

C, CHAT = RequestKind.COMPLETION, RequestKind.CHAT


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def completion(**fields) -> bytes:
    return body(**{"prompt": "Hello", **fields})


def chat(**fields) -> bytes:
    return body(**{"messages": [{"role": "user", "content": "Hi"}], **fields})


def test_completion_defaults():
    r = parse_request(completion(), C)
    assert r.kind is C and r.prompt == "Hello" and r.messages is None and r.model is None
    assert r.max_tokens == 16  # OpenAI / vLLM completions default
    # left out: None, so the worker applies the model's generation_config defaults (or vLLM's)
    assert (r.temperature, r.top_p, r.top_k, r.min_p, r.repetition_penalty, r.seed) == (None,) * 6
    assert (r.presence_penalty, r.frequency_penalty, r.min_tokens, r.stop_token_ids, r.logit_bias) == (0, 0, 0, (), ())
    assert (r.include_stop_str_in_output, r.skip_special_tokens, r.spaces_between_special_tokens) == (False, True, True)
    assert (r.truncate_prompt_tokens, r.add_special_tokens) == (None, None)
    assert (r.stop, r.ignore_eos, r.stream, r.include_usage) == ((), False, False, False)
    assert r.kv_transfer_params is None and r.raw == {"prompt": "Hello"}


def test_completion_all_fields():
    r = parse_request(
        completion(
            model="m", max_tokens=5, temperature=0, top_p=0.5, top_k=-1, seed=7, stop="\n",
            ignore_eos=True, stream=True, stream_options={"include_usage": True},
            kv_transfer_params={"role": "decode"}, n=1, best_of=None, logprobs=None,
            echo=False, user="u", some_unknown_field=3,
        ),
        C,
    )
    assert (r.model, r.max_tokens, r.temperature, r.top_p, r.top_k, r.seed) == ("m", 5, 0.0, 0.5, 0, 7)
    assert r.stop == ("\n",) and r.ignore_eos and r.stream and r.include_usage
    assert r.kv_transfer_params == {"role": "decode"}


@pytest.mark.parametrize(
    "prompt, expected",
    [("x", "x"), ([1, 2, 3], [1, 2, 3]), (["only"], "only"), ([[4, 5]], [4, 5])],
)
def test_prompt_forms(prompt, expected):
    assert parse_request(body(prompt=prompt), C).prompt == expected


def test_chat_defaults_and_max_completion_tokens():
    r = parse_request(chat(), CHAT)
    assert r.max_tokens is None and r.prompt is None
    assert r.messages == [{"role": "user", "content": "Hi"}]
    assert parse_request(chat(max_tokens=3), CHAT).max_tokens == 3
    assert parse_request(chat(max_tokens=3, max_completion_tokens=9), CHAT).max_tokens == 9


def test_chat_text_parts_are_joined():
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "name": "bob", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    r = parse_request(body(messages=msgs), CHAT)
    assert r.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb", "name": "bob"},
    ]


BAD_COMPLETIONS = [
    (b"{not json", None),
    (b"\xff\xfe\x00", None),
    (b"[1, 2]", None),
    (b'{"prompt": "x", "temperature": NaN}', None),
    (b"[" * 100_000 + b"]" * 100_000, None),
    (body(), "prompt"),
    (body(prompt=""), "prompt"),
    (body(prompt=[]), "prompt"),
    (body(prompt=[1, -2]), "prompt"),
    (body(prompt=[1, True]), "prompt"),
    (body(prompt=3), "prompt"),
    (completion(model=3), "model"),
    (completion(max_tokens=0), "max_tokens"),
    (completion(max_tokens=-1), "max_tokens"),
    (completion(max_tokens=1.5), "max_tokens"),
    (completion(max_tokens="5"), "max_tokens"),
    (completion(max_tokens=True), "max_tokens"),
    (completion(temperature=-0.1), "temperature"),
    (completion(temperature="hot"), "temperature"),
    (completion(top_p=0), "top_p"),
    (completion(top_p=1.5), "top_p"),
    (completion(top_k=-2), "top_k"),
    (completion(top_k=2.5), "top_k"),
    (completion(seed="x"), "seed"),
    (completion(seed=2**64), "seed"),
    (completion(stop=[""]), "stop"),
    (completion(stop=[1]), "stop"),
    (completion(stop=["s"] * 65), "stop"),
    (completion(stream="yes"), "stream"),
    (completion(ignore_eos=1), "ignore_eos"),
    (completion(stream_options={"include_usage": True}), "stream_options"),
    (completion(stream=True, stream_options=[]), "stream_options"),
    (completion(stream=True, stream_options={"include_usage": "y"}), "include_usage"),
    (completion(stream=True, stream_options={"continuous_usage_stats": True}), "stream_options"),
    (completion(kv_transfer_params="x"), "kv_transfer_params"),
    (completion(n=True), "n"),
    (completion(n=0), "n"),
    (completion(n=129), "n"),
    (completion(prompt=["a"] * 65, n=2), "n"),
    (completion(prompt=["a", [1, 2]]), "prompt"),
    (completion(prompt=["a", ""]), "prompt"),
    (completion(best_of=2), "best_of"),
    (completion(logprobs=21), "logprobs"),
    (completion(logprobs=-1), "logprobs"),
    (completion(logprobs=True), "logprobs"),
    (completion(logprobs="3"), "logprobs"),
    (completion(echo="yes"), "echo"),
    (completion(max_tokens=0), "max_tokens"),  # (0 only with echo)
    (completion(max_tokens=-1, echo=True), "max_tokens"),
    (completion(prompt_logprobs=1, stream=True), "prompt_logprobs"),
    (completion(prompt_logprobs=21), "prompt_logprobs"),
    (completion(return_tokens_as_token_ids="yes"), "return_tokens_as_token_ids"),
    (completion(suffix="s"), "suffix"),
    (completion(logit_bias={"x": 5}), "logit_bias"),
    (completion(logit_bias={"-1": 5}), "logit_bias"),
    (completion(logit_bias={"1": "5"}), "logit_bias"),
    (completion(logit_bias=[1]), "logit_bias"),
    (completion(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias"),
    (completion(presence_penalty=2.5), "presence_penalty"),
    (completion(presence_penalty="x"), "presence_penalty"),
    (completion(frequency_penalty=-2.01), "frequency_penalty"),
    (completion(repetition_penalty=0), "repetition_penalty"),
    (completion(repetition_penalty=-1), "repetition_penalty"),
    (completion(min_p=1.5), "min_p"),
    (completion(min_p=-0.1), "min_p"),
    (completion(min_tokens=-1), "min_tokens"),
    (completion(min_tokens=1.5), "min_tokens"),
    (completion(min_tokens=17), "min_tokens"),  # above the default max_tokens (16)
    (completion(max_tokens=4, min_tokens=5), "min_tokens"),
    (completion(stop_token_ids=[-1]), "stop_token_ids"),
    (completion(stop_token_ids=5), "stop_token_ids"),
    (completion(stop_token_ids=[True]), "stop_token_ids"),
    (completion(stop_token_ids=list(range(1025))), "stop_token_ids"),
    (completion(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (completion(skip_special_tokens="no"), "skip_special_tokens"),
    (completion(spaces_between_special_tokens=0), "spaces_between_special_tokens"),
    (completion(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (completion(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (completion(truncate_prompt_tokens="5"), "truncate_prompt_tokens"),
    (completion(add_special_tokens="yes"), "add_special_tokens"),
    (completion(use_beam_search=True), "use_beam_search"),
    (completion(response_format={"type": "yaml"}), "response_format"),
    (completion(guided_json=[]), "guided_json"),
]


def test_logprobs_fields_as_vllm_reads_them():
    r = parse_request(completion(logprobs=3, echo=True, max_tokens=0), C)
    assert (r.logprobs, r.echo, r.max_tokens, r.prompt_logprobs, r.prompt_scores) == (3, True, 0, None, 3)
    r = parse_request(completion(logprobs=0), C)
    assert (r.logprobs, r.echo, r.prompt_scores) == (0, False, None)  # (without echo the prompt is not scored)
    r = parse_request(completion(prompt_logprobs=5, logprobs=2, echo=True), C)
    assert r.prompt_scores == 5
    r = parse_request(completion(prompt_logprobs=0, return_tokens_as_token_ids=True), C)
    assert (r.logprobs, r.prompt_scores, r.tokens_as_ids) == (None, 0, True)
    r = parse_request(chat(logprobs=True, top_logprobs=4), CHAT)
    assert (r.logprobs, r.echo) == (4, False)
    r = parse_request(chat(logprobs=True), CHAT)
    assert r.logprobs == 0
    r = parse_request(chat(logprobs=False, top_logprobs=0), CHAT)
    assert r.logprobs is None


@pytest.mark.parametrize("raw, param", BAD_COMPLETIONS)
def test_bad_completion_bodies_are_400(raw, param):
    with pytest.raises(APIError) as ei:
        parse_request(raw, C)
    err = ei.value
    assert err.status == 400
    d = err.to_dict()
    assert set(d) == {"error"} and set(d["error"]) == {"message", "type", "param", "code"}
    assert d["error"]["type"] == "invalid_request_error" and d["error"]["message"]
    if param is not None:
        assert d["error"]["param"] == param
    json.dumps(d)  # serialisable


BAD_CHATS = [
    body(),
    body(messages=[]),
    body(messages="hi"),
    body(messages=["hi"]),
    body(messages=[{"role": "robot", "content": "x"}]),
    body(messages=[{"role": "tool", "content": "x"}]),  # (no tool_call_id)
    body(messages=[{"role": "user"}]),
    body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    body(messages=[{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]),
    chat(max_completion_tokens=0),
    chat(logprobs=True, top_logprobs=21),
    chat(top_logprobs=2),  # (needs logprobs: true)
    chat(logprobs=False, top_logprobs=1),
    chat(logprobs=1),
    chat(echo=True),
    chat(max_completion_tokens=0, echo=True),
    chat(tools=[{"type": "function", "function": {"name": "f g"}}]),
    chat(tool_choice="auto"),
    chat(chat_template=5),
]


@pytest.mark.parametrize("raw", BAD_CHATS)
def test_bad_chat_bodies_are_400(raw):
    with pytest.raises(APIError) as ei:
        parse_request(raw, CHAT)
    assert ei.value.status == 400


def test_sampling_and_output_fields_are_parsed():
    r = parse_request(completion(
        max_tokens=8, presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.3, min_p=0.05, min_tokens=8,
        stop_token_ids=[7, 3, 7], logit_bias={"5": 250, "9": -3.5, "11": -1000}, include_stop_str_in_output=True,
        skip_special_tokens=False, spaces_between_special_tokens=False, truncate_prompt_tokens=-1,
        add_special_tokens=False, temperature=0.7, top_p=0.9, top_k=-1), C)
    assert (r.presence_penalty, r.frequency_penalty, r.repetition_penalty, r.min_p) == (0.5, -1.0, 1.3, 0.05)
    assert r.min_tokens == 8 and r.stop_token_ids == (7, 3)  # duplicates dropped, order kept
    assert r.logit_bias == ((5, 100.0), (9, -3.5), (11, -100.0))  # clamped to [-100, 100], as vLLM
    assert r.include_stop_str_in_output and not r.skip_special_tokens and not r.spaces_between_special_tokens
    assert (r.truncate_prompt_tokens, r.add_special_tokens) == (-1, False)
    assert (r.temperature, r.top_p, r.top_k) == (0.7, 0.9, 0)
    # prefill's body (max_tokens 1, the client's in kv_transfer_params): min_tokens is checked by the worker
    assert parse_request(completion(max_tokens=1, min_tokens=5, kv_transfer_params={"max_tokens": 9}), C).min_tokens == 5
    assert parse_request(chat(add_special_tokens=True), CHAT).add_special_tokens is True


def test_feature_off_values_are_accepted():
    parse_request(chat(logprobs=False, tools=[], tool_choice="none", response_format={"type": "text"},
                       presence_penalty=0, frequency_penalty=0.0, n=1, top_logprobs=None), CHAT)


def test_api_error_dict_shape():
    e = APIError(404, "no such model", param="model", code="model_not_found")
    assert e.status == 404 and str(e) == "no such model"
    assert e.to_dict() == {
        "error": {"message": "no such model", "type": "invalid_request_error", "param": "model",
                  "code": "model_not_found"}
    }


def test_completion_response_shapes():
    c = completion_response("cmpl-1", 100, "m", C, "hello", "length", 3, 2)
    assert c == {
        "id": "cmpl-1", "object": "text_completion", "created": 100, "model": "m",
        "choices": [{"index": 0, "text": "hello", "logprobs": None, "finish_reason": "length", "stop_reason": None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                  "prompt_tokens_details": {"cached_tokens": 0}},
    }
    ch = completion_response("chatcmpl-1", 100, "m", CHAT, "hi", "stop", 3, 1, stop_reason=7)
    assert ch["object"] == "chat.completion"
    assert ch["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert ch["choices"][0]["finish_reason"] == "stop" and ch["choices"][0]["stop_reason"] == 7


def test_stream_chunk_shapes():
    role = stream_chunk("chatcmpl-1", 1, "m", CHAT, None, None, role=True)
    assert role["object"] == "chat.completion.chunk"
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = stream_chunk("chatcmpl-1", 1, "m", CHAT, "a", None)
    assert text["choices"][0]["delta"] == {"content": "a"} and text["choices"][0]["finish_reason"] is None
    assert "stop_reason" not in text["choices"][0]  # (only the last chunk says why it stopped)
    end = stream_chunk("chatcmpl-1", 1, "m", CHAT, None, "stop", stop_reason="###")
    assert end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == "stop"
    assert end["choices"][0]["stop_reason"] == "###"
    comp = stream_chunk("cmpl-1", 1, "m", C, None, "length")
    assert comp["object"] == "text_completion" and comp["choices"][0]["text"] == ""
    u = usage_chunk("cmpl-1", 1, "m", C, 4, 6)
    assert u["choices"] == [] and u["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10,
                                                 "prompt_tokens_details": {"cached_tokens": 0}}


def test_sse_and_models():
    frame = sse({"a": "é", "b": [1, 2]})
    assert frame == 'data: {"a":"é","b":[1,2]}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"
    m = models_response(["x"], created=5, max_model_len=512)
    assert m == {"object": "list", "data": [{"id": "x", "object": "model", "created": 5, "owned_by": "xpyd",
                                             "root": "x", "parent": None, "max_model_len": 512}]}
    assert models_response(["x"], created=5)["data"][0]["max_model_len"] is None  # (not known yet)


def test_response_ids():
    assert new_response_id(C).startswith("cmpl-")
    assert new_response_id(CHAT).startswith("chatcmpl-")
    assert new_response_id(C) != new_response_id(C)


@pytest.mark.parametrize("kind", [RequestKind.COMPLETION, RequestKind.CHAT])
def test_cache_salt(kind):
    body = {"prompt": "hi"} if kind is RequestKind.COMPLETION else {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_request(json.dumps(body).encode(), kind).cache_salt is None
    assert parse_request(json.dumps({**body, "cache_salt": "tenant-7"}).encode(), kind).cache_salt == "tenant-7"
    assert parse_request(json.dumps({**body, "cache_salt": "s" * 256}).encode(), kind).cache_salt == "s" * 256
    for bad in ("", "s" * 257, 7, ["a"]):
        with pytest.raises(APIError) as e:
            parse_request(json.dumps({**body, "cache_salt": bad}).encode(), kind)
        assert e.value.status == 400 and e.value.param == "cache_salt"
