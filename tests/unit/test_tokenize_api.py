"""/tokenize and /detokenize (xpyd.api.tokenize): a real-engine worker's transformers tokenizer and the proxy's
copy rebuilt from GET /xpyd/tokenizer answer alike; bodies are parsed as vLLM defines them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.test_prompt_tokens import served
from xpyd.api.openai import APIError
from xpyd.api.tokenize import detokenize, parse_detokenize, parse_tokenize, tokenize
from xpyd.model.tokenizer import encode_chat, encode_prompt, load_tokenizer
from xpyd.proxy.prompt_tokens import PromptTokenizer, TokenizerSpec

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "2+2?"}]},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?", "name": "bob"}]
BODIES = [{"prompt": "Hello, world"}, {"prompt": "Héllo 🙂 <|im_end|>", "add_special_tokens": False},
          {"prompt": "", "return_token_strs": True}, {"messages": CHAT},
          {"messages": CHAT, "add_generation_prompt": False, "return_token_strs": True},
          {"messages": CHAT, "add_special_tokens": True}]


@pytest.fixture(scope="module")
def tokenizers(smollm_dir: Path):
    tok = load_tokenizer(smollm_dir)  # (transformers: a real-engine worker's)
    return tok, PromptTokenizer(TokenizerSpec.from_json(served(tok))).tokenizer


def _parse(body: dict):
    return parse_tokenize(json.dumps(body).encode())


@pytest.mark.parametrize("body", BODIES, ids=range(len(BODIES)))
def test_the_workers_tokenizer_and_the_proxys_copy_answer_alike(tokenizers, body):
    worker, copy = tokenizers
    req = _parse(body)
    a, b = tokenize(worker, req, 512), tokenize(copy, req, 512)
    assert a == b and a["count"] == len(a["tokens"]) and a["max_model_len"] == 512
    assert (a["token_strs"] is not None) == bool(body.get("return_token_strs"))
    if a["token_strs"] is not None:
        assert a["token_strs"] == worker.convert_ids_to_tokens(a["tokens"])  # (vLLM's way to name them)
    # the defaults are those of the generation endpoints
    if body == {"prompt": "Hello, world"}:
        assert a["tokens"] == encode_prompt(worker, "Hello, world")
    if body == {"messages": CHAT}:
        assert a["tokens"] == encode_chat(worker, req.messages)
    ids = a["tokens"]
    assert detokenize(worker, parse_detokenize(json.dumps({"tokens": ids}).encode())) == \
        detokenize(copy, parse_detokenize(json.dumps({"tokens": ids}).encode())) == {"prompt": worker.decode(ids)}


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "messages": CHAT}, "messages"),
    ({"model": 3, "prompt": "x"}, "model"),
    ({"prompt": None}, "prompt"),
    ({"messages": []}, "messages"),
    ({"messages": CHAT, "add_generation_prompt": 1}, "add_generation_prompt"),
    ({"messages": CHAT, "continue_final_message": True}, "continue_final_message"),  # (with the generation prompt)
    ({"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"messages": CHAT, "chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"messages": CHAT, "documents": "d"}, "documents"),
    ({"messages": CHAT, "chat_template": 5}, "chat_template"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": CHAT, "mm_processor_kwargs": {"a": 1}}, "mm_processor_kwargs"),
])
def test_bad_tokenize_bodies_name_their_field(body, param):
    with pytest.raises(APIError) as e:
        _parse(body)
    assert (e.value.status, e.value.param) == (400, param)


def test_off_values_and_unknown_fields_are_accepted():
    req = _parse({"messages": CHAT, "continue_final_message": False, "chat_template_kwargs": {}, "tools": None,
                  "max_tokens": 3, "model": "m"})  # (as vLLM, fields that change no token are ignored)
    assert req.model == "m" and req.add_generation_prompt and not req.add_special_tokens
    assert _parse({"prompt": "x"}).add_special_tokens  # completion form: on by default


def test_detokenize_checks_the_ids(tokenizers):
    worker, copy = tokenizers
    for tokens in ([1, -1], [True], "12", None):
        with pytest.raises(APIError) as e:
            parse_detokenize(json.dumps({"tokens": tokens}).encode())
        assert e.value.param == "tokens"
    req = parse_detokenize(json.dumps({"tokens": [1, len(worker)]}).encode())
    for tok in (worker, copy):
        with pytest.raises(APIError) as e:
            detokenize(tok, req)
        assert (e.value.status, e.value.param) == (400, "tokens")
