"""The torch-free tokenizer (xpyd.tokenization, what simulated workers use) is transformers' token for token.

Both are loaded from the same model folder; the worker's own functions (``xpyd.model.tokenizer``: encode_prompt,
encode_chat, describe_tokenizer; ``xpyd.model.output``: the streamed text) are run on each, and must agree.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_prompt_tokens import CHATS as PROXY_CHATS
from xpyd.model.output import OutputProcessor, StopParams
from xpyd.model.tokenizer import describe_tokenizer, encode_chat, encode_prompt, load_tokenizer
from xpyd.tokenization.tokenizer import LightTokenizer

TEXTS = [
    "Hello",
    "The capital of France is",
    " leading space",
    "  leading and trailing spaces  \n\n\ttabs\r\n",
    "\n",
    " ",
    "Héllo wörld, ça va? Ünïcödé — “quotes” … 日本語のテキスト 中文 한국어 العربية emoji 🙂👍🏽 ZWJ 👩‍👩‍👧",
    "special strings as text: <|im_start|>user\nhi<|im_end|> <|endoftext|>",
    "<|im_start|><|im_end|><|endoftext|>",
    "code: def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\tpass",
    "numbers 1234567890 3.14159 -42 1e-9, and don't won't I'm we've they're",
    "x" * 3000,
    " ".join(f"word{i}" for i in range(2000)),
]

CHATS = [*PROXY_CHATS,  # (the chats the proxy's tokenizing is checked on, and one more)
         [{"role": "user", "content": "  spaces \n\n and\ttabs  "}]]


@pytest.fixture(scope="module")
def pair(smollm_dir: Path):
    """(transformers' tokenizer, the light one) of the default model's folder."""
    return load_tokenizer(smollm_dir), LightTokenizer.from_folder(smollm_dir)


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_completion_ids_equal_transformers(pair, text):
    hf, light = pair
    assert encode_prompt(light, text) == encode_prompt(hf, text)


@pytest.mark.parametrize("messages", CHATS, ids=range(len(CHATS)))
def test_chat_ids_equal_transformers(pair, messages):
    hf, light = pair
    assert encode_chat(light, messages) == encode_chat(hf, messages)


def test_vocabulary_special_tokens_and_description_equal_transformers(pair):
    hf, light = pair
    assert len(light) == len(hf)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(light, name) == getattr(hf, name)
    assert light.chat_template == hf.chat_template
    desc_hf, desc_light = describe_tokenizer(hf), describe_tokenizer(light)
    assert desc_light == desc_hf  # what GET /xpyd/tokenizer serves: the proxy tokenizes the same either way
    with pytest.raises(ValueError, match="vocabulary"):
        encode_prompt(light, [len(hf)])
    assert encode_prompt(light, [0, 5, len(hf) - 1]) == [0, 5, len(hf) - 1]


@pytest.mark.parametrize("skip", [True, False])
def test_decode_equals_transformers(pair, skip):
    hf, light = pair
    for text in TEXTS + ["<|im_start|>assistant\nSure!<|im_end|>"]:
        ids = hf(text).input_ids
        for cut in {len(ids), len(ids) // 2, 1, 3}:  # a cut may end inside a character: U+FFFD, as transformers
            assert light.decode(ids[:cut], skip_special_tokens=skip) == hf.decode(ids[:cut], skip_special_tokens=skip)


def test_streamed_text_equals_transformers(pair):
    """The worker's output processor (incremental detokenizing, stop strings) streams the same text."""
    hf, light = pair
    ids = hf("Bonjour! 日本語 🙂👍🏽 done. <|im_end|> tail").input_ids
    eos = frozenset({hf.convert_tokens_to_ids("<|im_end|>")})
    for params in (StopParams(max_tokens=len(ids), eos_token_ids=eos),
                   StopParams(max_tokens=len(ids), stop=("done",)),
                   StopParams(max_tokens=len(ids), ignore_eos=True, eos_token_ids=eos)):
        streams = []
        for tok in (hf, light):
            out = OutputProcessor(tok, params)
            deltas = []
            for i in ids:
                delta, finish = out.append(i)
                deltas.append(delta)
                if finish is not None:
                    break
            streams.append((deltas, out.finished))
        assert streams[0] == streams[1]


def test_folder_variants_equal_transformers(smollm_dir: Path, tmp_path: Path):
    """tokenizer_config.json as other models write it: the template inside it (a named list), special tokens
    as serialized AddedTokens, add_bos_token/add_eos_token given (transformers keeps tokenizer.json's
    post-processor: so does the light one), a special token missing from the vocabulary."""
    folder = tmp_path / "variant"
    folder.mkdir()
    shutil.copy(smollm_dir / "tokenizer.json", folder / "tokenizer.json")
    config = json.loads((smollm_dir / "tokenizer_config.json").read_text())
    template = (smollm_dir / "chat_template.jinja").read_text()
    config.update({
        "chat_template": [{"name": "default", "template": "{{ bos_token }}" + template},
                          {"name": "tool_use", "template": "tools"}],
        "bos_token": {"content": "<|im_start|>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True, "__type": "AddedToken"},
        "pad_token": "<|pad_not_in_vocab|>",
        "add_bos_token": True, "add_eos_token": True,
    })
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    hf, light = load_tokenizer(folder), LightTokenizer.from_folder(folder)
    assert len(light) == len(hf) == len(load_tokenizer(smollm_dir)) + 1
    for text in TEXTS[:10]:
        assert encode_prompt(light, text) == encode_prompt(hf, text)
    for messages in CHATS[:7]:
        ids = encode_chat(hf, messages)
        assert ids[0] == hf.bos_token_id == ids[1]  # the named template's own bos_token, then the turn's
        assert encode_chat(light, messages) == ids
    assert light.pad_token == hf.pad_token == "<|pad_not_in_vocab|>"


def test_without_a_template_or_tokenizer_json(smollm_dir: Path, tmp_path: Path):
    folder = tmp_path / "plain"
    folder.mkdir()
    with pytest.raises(ValueError, match="tokenizer.json"):
        LightTokenizer.from_folder(folder)
    shutil.copy(smollm_dir / "tokenizer.json", folder / "tokenizer.json")
    light = LightTokenizer.from_folder(folder)
    assert light.chat_template is None and light.bos_token is None
    with pytest.raises(ValueError, match="no chat template"):
        encode_chat(light, [{"role": "user", "content": "hi"}])
    assert encode_prompt(light, "Hello") == encode_prompt(load_tokenizer(smollm_dir), "Hello")


def test_the_light_tokenizer_imports_no_torch_or_transformers(smollm_dir: Path):
    code = ("import sys; from xpyd.tokenization.tokenizer import LightTokenizer; "
            "import xpyd.model.tokenizer, xpyd.model.output, xpyd.proxy.prompt_tokens; "
            f"t = LightTokenizer.from_folder({str(smollm_dir)!r}); t.decode(t('hi').input_ids); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
