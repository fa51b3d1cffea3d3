"""Nothing a client sends is silently ignored: every field of vLLM's completion and chat requests (vLLM 0.32.0,
``vllm.entrypoints.openai.{completion,chat_completion}.protocol``, read from its pydantic models) is either
honoured (the test module named checks what it does), a field that changes no output here either (as in vLLM),
or a 400 naming it for any value but its "off" one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xpyd.api.openai import APIError, RequestKind, parse_request

VLLM_VERSION = "0.32.0"
COMPLETION_FIELDS = (
    "model prompt echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop stream "
    "stream_options suffix temperature top_p user use_beam_search top_k min_p repetition_penalty watermarking "
    "length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens "
    "spaces_between_special_tokens truncate_prompt_tokens truncation_side allowed_token_ids prompt_logprobs "
    "logprob_token_ids bad_words prompt_embeds add_special_tokens response_format structured_outputs priority "
    "request_id session_id return_tokens_as_token_ids return_token_ids routed_experts_prompt_start "
    "return_token_offsets mm_payload return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs "
    "repetition_detection thinking_token_budget stream_interval").split()
CHAT_FIELDS = (
    "messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens n "
    "presence_penalty response_format seed stop stream stream_options temperature top_p tools tool_choice "
    "reasoning_effort thinking_token_budget include_reasoning parallel_tool_calls user use_beam_search top_k min_p "
    "repetition_penalty watermarking length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens "
    "skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens truncation_side prompt_logprobs "
    "logprob_token_ids allowed_token_ids bad_words echo add_generation_prompt continue_final_message "
    "add_special_tokens documents chat_template chat_template_kwargs media_io_kwargs mm_processor_kwargs "
    "structured_outputs priority request_id session_id return_tokens_as_token_ids return_token_ids "
    "routed_experts_prompt_start return_token_offsets return_prompt_text mm_payload return_mm_kwargs cache_salt "
    "kv_transfer_params ec_transfer_params vllm_xargs repetition_detection stream_interval").split()

TESTS = Path(__file__).resolve().parents[1]
SAMPLING = "integration/test_sampling_pd.py"
OUTPUT = "unit/test_output_options.py"
LOGPROBS = "integration/test_logprobs_pd.py"
CHAT_ARGS = "integration/test_chat_options.py"
STRUCTURED = "integration/test_structured_tools.py"
# honoured: where it is checked
HONOURED = {
    "model": "integration/test_proxy.py", "prompt": "integration/test_choices_pd.py", "messages": CHAT_ARGS,
    "echo": LOGPROBS, "frequency_penalty": SAMPLING, "presence_penalty": SAMPLING, "repetition_penalty": SAMPLING,
    "logit_bias": SAMPLING, "logprobs": LOGPROBS, "top_logprobs": LOGPROBS, "prompt_logprobs": LOGPROBS,
    "return_tokens_as_token_ids": LOGPROBS, "max_tokens": LOGPROBS, "max_completion_tokens": "integration/test_proxy.py",
    "n": "integration/test_choices_pd.py", "seed": SAMPLING, "stop": SAMPLING, "stream": SAMPLING,
    "stream_options": SAMPLING, "temperature": SAMPLING, "top_p": "unit/test_sampling.py", "top_k": SAMPLING,
    "min_p": SAMPLING, "stop_token_ids": SAMPLING, "include_stop_str_in_output": SAMPLING, "ignore_eos": SAMPLING,
    "min_tokens": SAMPLING, "skip_special_tokens": OUTPUT, "spaces_between_special_tokens": OUTPUT,
    "truncate_prompt_tokens": OUTPUT, "truncation_side": OUTPUT, "add_special_tokens": OUTPUT,
    "response_format": STRUCTURED, "structured_outputs": STRUCTURED, "tools": STRUCTURED, "tool_choice": STRUCTURED,
    "parallel_tool_calls": STRUCTURED, "add_generation_prompt": CHAT_ARGS, "continue_final_message": CHAT_ARGS,
    "documents": CHAT_ARGS, "chat_template_kwargs": CHAT_ARGS, "chat_template": CHAT_ARGS, "reasoning_effort": "unit/test_vllm_fields.py",
    "request_id": CHAT_ARGS, "cache_salt": "integration/test_proxy_cache_routing.py",
    "kv_transfer_params": "integration/test_workers.py",  # (xpyd's own between proxy and workers: the proxy sets it)
}
# changes no output here, as in vLLM: metadata (user, session_id), or reasoning with no reasoning parser
NO_EFFECT = {"user": "u-1", "session_id": "s-1", "include_reasoning": False}
# a value other than "off": a 400 that names the field
REFUSED = {
    "suffix": "x", "use_beam_search": True, "watermarking": {"gamma": 0.25}, "length_penalty": 2.0,
    "allowed_token_ids": [1, 2], "logprob_token_ids": [5], "bad_words": ["x"], "prompt_embeds": "AAAA",
    "priority": 1, "return_token_ids": True, "routed_experts_prompt_start": 3, "return_token_offsets": True,
    "mm_payload": "other", "return_mm_kwargs": True, "ec_transfer_params": {"x": 1}, "vllm_xargs": {"a": 1},
    "repetition_detection": {"max_pattern_size": 4}, "thinking_token_budget": 100, "stream_interval": 4,
    "media_io_kwargs": {"video": {}}, "mm_processor_kwargs": {"x": 1},
    "return_prompt_text": True,
}


def _body(kind: RequestKind, **fields) -> bytes:
    base = {"messages": [{"role": "user", "content": "hi"}]} if kind is RequestKind.CHAT else {"prompt": "hi"}
    return json.dumps({**base, **fields}).encode()


@pytest.mark.parametrize("kind, fields", [(RequestKind.COMPLETION, COMPLETION_FIELDS), (RequestKind.CHAT, CHAT_FIELDS)])
def test_every_vllm_field_is_classified(kind, fields):
    unclassified = [f for f in fields if f not in HONOURED and f not in NO_EFFECT and f not in REFUSED]
    assert not unclassified, f"vLLM {VLLM_VERSION} fields nobody decided about: {unclassified}"
    for f in fields:
        if f in HONOURED:
            text = (TESTS / HONOURED[f]).read_text()
            assert f'"{f}"' in text or f"{f}=" in text, f"{HONOURED[f]} does not exercise {f}"


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_refused_fields_are_400_naming_them(field):
    kind = RequestKind.CHAT if field in CHAT_FIELDS and field not in COMPLETION_FIELDS else RequestKind.COMPLETION
    with pytest.raises(APIError) as e:
        parse_request(_body(kind, **{field: REFUSED[field]}), kind)
    assert (e.value.status, e.value.param) == (400, field)


@pytest.mark.parametrize("field", sorted(NO_EFFECT))
def test_fields_without_effect_are_taken(field):
    parse_request(_body(RequestKind.CHAT, **{field: NO_EFFECT[field]}), RequestKind.CHAT)


def test_request_id_names_the_response_and_reasoning_effort_reaches_the_template():
    r = parse_request(_body(RequestKind.CHAT, request_id="job-7", reasoning_effort="low"), RequestKind.CHAT)
    assert r.request_id == "job-7" and r.chat.as_kwargs()["reasoning_effort"] == "low"
    r = parse_request(_body(RequestKind.CHAT, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "x"}),
                      RequestKind.CHAT)
    assert r.chat.as_kwargs()["reasoning_effort"] == "x"  # (the request's template kwargs say it last)
    for bad, param in (({"request_id": 5}, "request_id"), ({"reasoning_effort": 1}, "reasoning_effort"),
                       ({"include_reasoning": "no"}, "include_reasoning"), ({"truncation_side": "up"},
                                                                            "truncation_side")):
        with pytest.raises(APIError) as e:
            parse_request(_body(RequestKind.CHAT, **bad), RequestKind.CHAT)
        assert e.value.param == param


def test_a_requests_own_chat_template_runs_only_where_trusted():
    """As vLLM's --trust-request-chat-template: a template is code (sandboxed Jinja, yet a stranger's may spend the
    server's CPU), so without the flag it is a 400 naming chat_template, in the chat endpoint and /tokenize."""
    from xpyd.api.tokenize import parse_tokenize

    body = _body(RequestKind.CHAT, chat_template="{{ messages[0]['content'] }}")
    for parse in (lambda: parse_request(body, RequestKind.CHAT), lambda: parse_tokenize(body)):
        with pytest.raises(APIError) as e:
            parse()
        assert (e.value.status, e.value.param) == (400, "chat_template") and "trust" in e.value.message
    assert parse_request(body, RequestKind.CHAT, trusted_templates=True).chat.template is not None
    assert parse_tokenize(body, trusted_templates=True).chat.template is not None
