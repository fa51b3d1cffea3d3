"""The output options vLLM has (stop_token_ids, include_stop_str_in_output, min_tokens against stop strings,
skip_special_tokens, spaces_between_special_tokens) and ``stop_reason``; a request's prompt as
``add_special_tokens`` and ``truncate_prompt_tokens`` make it; the model's generation_config defaults."""

from __future__ import annotations

import json

import pytest
from tokenizers.processors import TemplateProcessing

from xpyd.api.openai import RequestKind, parse_request
from xpyd.model.loader import GenerationDefaults, generation_defaults
from xpyd.model.output import FinishReason, OutputProcessor, StopParams
from xpyd.tokenization.tokenizer import LightTokenizer
from xpyd.worker import request_params
from xpyd.worker.request_params import sampling_params

EOS = 2  # <|im_end|>
TEXT = " is Lee, and I'm a student in the college of engineering"


@pytest.fixture(scope="module")
def tok(smollm_dir):
    return LightTokenizer.from_folder(smollm_dir)


def run(tok, ids, **kw):
    out = OutputProcessor(tok, StopParams(**({"max_tokens": 10_000, "eos_token_ids": frozenset({EOS})} | kw)))
    text, reason = "", None
    for i in ids:
        delta, reason = out.append(i)
        text += delta
        if reason is not None:
            break
    assert text == out.text
    return out, reason


def test_a_stop_token_id_ends_the_output_and_is_its_stop_reason(tok):
    ids = tok(TEXT).input_ids
    out, reason = run(tok, ids, stop_token_ids=frozenset({ids[3]}))
    assert reason is FinishReason.STOP and out.stop_reason == ids[3] and out.token_ids == ids[:4]
    assert out.text == tok.decode(ids[:3])  # the stop token's text is left out
    out, _ = run(tok, ids, stop_token_ids=frozenset({ids[3]}), include_stop_str_in_output=True)
    assert out.text == tok.decode(ids[:4]) and out.stop_reason == ids[3]
    out, reason = run(tok, ids[:2] + [EOS] + ids[2:], stop_token_ids=frozenset({ids[3]}))
    assert reason is FinishReason.STOP and out.stop_reason is None  # EOS: no stop reason, as vLLM
    out, reason = run(tok, ids[:5], max_tokens=5)
    assert reason is FinishReason.LENGTH and out.stop_reason is None


def test_stop_strings_name_the_stop_reason_and_may_stay_in_the_text(tok):
    ids = tok(TEXT).input_ids
    out, reason = run(tok, ids, stop=("student", "college"))
    assert reason is FinishReason.STOP and out.stop_reason == "student" and out.text == " is Lee, and I'm a "
    out, _ = run(tok, ids, stop=("student",), include_stop_str_in_output=True)
    assert out.text == " is Lee, and I'm a student" and out.stop_reason == "student"


@pytest.mark.parametrize("min_tokens, truth", [(0, " is L"), (5, " is Lee, and I'm a stud")])
def test_min_tokens_keeps_stop_strings_out_of_the_first_tokens_text(tok, min_tokens, truth):
    """vLLM's own case (tests/detokenizer/test_min_tokens.py), on this tokenizer: no stop string that ends in
    the text of the first min_tokens tokens."""
    ids = tok(TEXT).input_ids
    first = tok.decode(ids[:min_tokens])
    out, reason = run(tok, ids, stop=("e",), min_tokens=min_tokens)
    assert reason is FinishReason.STOP and out.stop_reason == "e"
    expected = tok.decode(ids)
    cut = expected.find("e", len(first))  # the first "e" that ends after the min_tokens text
    assert out.text == expected[:cut]
    if min_tokens == 0:
        assert out.text == truth


def test_special_tokens_shown_or_skipped(tok):
    ids = tok("hi").input_ids + [1, 1] + tok(" there").input_ids  # <|im_start|> twice
    shown, _ = run(tok, ids, skip_special_tokens=False, max_tokens=len(ids))
    assert shown.text == "hi<|im_start|><|im_start|> there" == tok.decode(ids, skip_special_tokens=False)
    skipped, _ = run(tok, ids, max_tokens=len(ids))
    assert skipped.text == "hi there"
    joined, _ = run(tok, ids, skip_special_tokens=False, spaces_between_special_tokens=False, max_tokens=len(ids))
    assert joined.text == "hi<|im_start|><|im_start|> there"  # (a byte-level decoder puts no spaces there)


# --- prompts: add_special_tokens, truncate_prompt_tokens ----------------------------------------------------

@pytest.fixture()
def bos_tok(smollm_dir):
    t = LightTokenizer.from_folder(smollm_dir)
    t.backend_tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A",
                                                            special_tokens=[("<|im_start|>", 1)])
    return t


def _req(kind, **fields):
    base = {"prompt": "hello there world"} if kind is RequestKind.COMPLETION else \
        {"messages": [{"role": "user", "content": "hello"}]}
    return parse_request(json.dumps({**base, **fields}).encode(), kind)


def test_add_special_tokens_and_truncation(bos_tok):
    C, CHAT = RequestKind.COMPLETION, RequestKind.CHAT
    plain = bos_tok("hello there world", add_special_tokens=False).input_ids
    assert request_params._tokenize(bos_tok, _req(C), 100) == [1] + plain
    assert request_params._tokenize(bos_tok, _req(C, add_special_tokens=False), 100) == plain
    assert request_params._tokenize(bos_tok, _req(C, truncate_prompt_tokens=2), 100) == plain[-2:]
    assert request_params._tokenize(bos_tok, _req(C, truncate_prompt_tokens=-1), 2) == plain[-2:]
    assert request_params._tokenize(bos_tok, _req(C, truncate_prompt_tokens=2, truncation_side="right"),
                                    100) == [1, plain[0]]  # (vLLM's truncation_side: keep the first k)
    chat = bos_tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    assert request_params._tokenize(bos_tok, _req(CHAT), 100) == chat  # chat: the template's tokens only
    assert request_params._tokenize(bos_tok, _req(CHAT, add_special_tokens=True), 100) == [1] + chat
    assert request_params._tokenize(bos_tok, _req(CHAT, truncate_prompt_tokens=3), 100) == chat[-3:]


# --- generation_config.json defaults --------------------------------------------------------------------------

def test_generation_defaults_from_the_model_folder(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "min_p": 0.0, "do_sample": True,
         "max_new_tokens": 5}))
    d = generation_defaults(tmp_path)
    assert d.named() == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.1}
    assert generation_defaults(tmp_path, "vllm") == GenerationDefaults()
    other = tmp_path / "other"
    other.mkdir()
    assert generation_defaults(tmp_path / "nowhere-else", str(tmp_path)).temperature == 0.6
    assert generation_defaults(other) == GenerationDefaults()  # no file: no defaults
    with pytest.raises(ValueError):
        generation_defaults(tmp_path, str(tmp_path / "missing"))
    (other / "generation_config.json").write_text('{"temperature": "hot"}')
    with pytest.raises(ValueError):
        generation_defaults(other)

    # a request's own value wins; what it leaves out comes from the defaults, else vLLM's
    C = RequestKind.COMPLETION
    p = sampling_params(_req(C), d, frozenset({2}), 100)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    p = sampling_params(_req(C, temperature=0, top_k=-1, repetition_penalty=1.0), d, frozenset({2}), 100)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.0, 0.9, 0, 1.0)
    p = sampling_params(_req(C), GenerationDefaults(), frozenset(), 100)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)


def test_token_ids_outside_the_vocabulary_are_400():
    from xpyd.api.openai import APIError

    for fields, param in (({"logit_bias": {"100": 1}}, "logit_bias"), ({"stop_token_ids": [100]}, "stop_token_ids")):
        with pytest.raises(APIError) as e:
            sampling_params(_req(RequestKind.COMPLETION, **fields), GenerationDefaults(), frozenset(), 100)
        assert e.value.status == 400 and e.value.param == param
    p = sampling_params(_req(RequestKind.COMPLETION, min_tokens=3, stop_token_ids=[7]), GenerationDefaults(),
                        frozenset({2}), 100)
    assert p.min_tokens_ids == {2, 7}  # EOS and the stop ids are banned until min_tokens
