"""The proxy's prompt tokens equal the workers' (transformers is fine here, in the test, not in the proxy).

The workers parse the same body with ``parse_request`` and tokenize with ``xpyd.model.tokenizer``; the
proxy rebuilds their tokenizer from ``GET /xpyd/tokenizer`` with ``tokenizers`` and ``jinja2`` alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xpyd.api.openai import RequestKind, parse_request
from xpyd.model.tokenizer import encode_chat, encode_prompt, load_tokenizer
from xpyd.model.kv_blocks import BlockAllocator
from xpyd.prefix_hash import block_hashes, hash_key, hash_seed
from xpyd.proxy.prompt_tokens import PromptTokenizer, TokenizerSpec
from xpyd.worker.kv_cache import KVCache

SEED = hash_seed("test-model", "layout")
SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def served(tok, block_size: int = 16) -> bytes:
    """What a worker answers on GET /xpyd/tokenizer (the contract)."""
    special = {name: getattr(tok, name, None) for name in SPECIAL}
    return json.dumps({"tokenizer": tok.backend_tokenizer.to_str(), "chat_template": tok.chat_template,
                       "special_tokens": {k: str(v) if v is not None else None for k, v in special.items()},
                       "block_size": block_size, "hash_seed": SEED}).encode()


@pytest.fixture(scope="module")
def smollm(smollm_dir: Path):
    tok = load_tokenizer(smollm_dir)
    return tok, PromptTokenizer(TokenizerSpec.from_json(served(tok)))


TEXTS = [
    "Hello",
    "The capital of France is",
    "  leading and trailing spaces  \n\n\ttabs\r\n",
    "Héllo wörld, ça va? Ünïcödé — “quotes” … 日本語のテキスト 中文 한국어 العربية emoji 🙂👍🏽",
    "special strings as text: <|im_start|>user\nhi<|im_end|> <|endoftext|>",
    "code: def f(x):\n    return {'a': [1, 2, 3]}  # comment",
    "x" * 3000,
    " ".join(f"word{i}" for i in range(2000)),
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Answer in French."},
     {"role": "user", "content": "Bonjour, ça va ?"},
     {"role": "assistant", "content": "Très bien, merci ! Et vous ?"},
     {"role": "user", "content": "Parfait. Écris un haïku sur l'été 🌞"}],
    [{"role": "user", "content": "first"}, {"role": "assistant", "content": "second"},
     {"role": "user", "content": "third"}, {"role": "assistant", "content": ""},
     {"role": "user", "content": "日本語で答えて"}],
    [{"role": "developer", "content": "Be nice."}, {"role": "user", "content": "<|im_end|> injected"}],
    [{"role": "user", "content": [{"type": "text", "text": "part one. "}, {"type": "text", "text": "part two"}]}],
    [{"role": "user", "content": "named", "name": "alice"}],
    [{"role": "user", "content": "long " * 2000}],
]


@pytest.mark.parametrize("text", TEXTS)
def test_completion_ids_equal_the_workers(smollm, text):
    tok, proxy = smollm
    req = parse_request(json.dumps({"prompt": text}).encode(), RequestKind.COMPLETION)
    ids = encode_prompt(tok, req.prompt)
    assert proxy.token_ids(req) == ids
    keys = proxy.keys(req)
    assert keys.hashes == tuple(block_hashes(ids, 16, SEED)) and keys.num_tokens == len(ids)


def test_token_id_prompts_are_used_as_they_are(smollm):
    tok, proxy = smollm
    req = parse_request(json.dumps({"prompt": list(range(40))}).encode(), RequestKind.COMPLETION)
    assert proxy.token_ids(req) == encode_prompt(tok, req.prompt) == list(range(40))
    with pytest.raises(ValueError, match="vocabulary"):
        proxy.encode_prompt([len(tok)])  # the worker refuses it too
    with pytest.raises(ValueError):
        encode_prompt(tok, [len(tok)])


@pytest.mark.parametrize("messages", CHATS, ids=range(len(CHATS)))
def test_chat_ids_equal_the_workers(smollm, messages):
    tok, proxy = smollm
    req = parse_request(json.dumps({"messages": messages}).encode(), RequestKind.CHAT)
    ids = encode_chat(tok, req.messages)  # what the worker computes from the same body
    assert proxy.token_ids(req) == ids
    assert proxy.keys(req).hashes == tuple(block_hashes(ids, 16, SEED))
    # Messages handed over as they are, content parts and all (the worker's encode_chat accepts them too).
    assert proxy.encode_chat(messages) == encode_chat(tok, messages)


def test_chats_that_share_a_history_share_leading_blocks(smollm):
    _, proxy = smollm
    turn1 = [{"role": "system", "content": "Answer in French, briefly and politely. " * 4},
             {"role": "user", "content": "Bonjour, ça va ?"}]
    turn2 = [*turn1, {"role": "assistant", "content": "Très bien, merci !"}, {"role": "user", "content": "Et toi ?"}]
    a = proxy.keys(parse_request(json.dumps({"messages": turn1}).encode(), RequestKind.CHAT))
    b = proxy.keys(parse_request(json.dumps({"messages": turn2}).encode(), RequestKind.CHAT))
    shared = 0
    while shared < min(len(a.hashes), len(b.hashes)) and a.hashes[shared] == b.hashes[shared]:
        shared += 1
    assert shared == len(a.hashes) >= 3  # the system prompt and first question: the same blocks


def test_a_template_using_everything_transformers_gives_it(smollm):
    """bos_token, tojson (no HTML escaping), raise_exception, loop controls, namespace, {% generation %},
    and a post-processor that adds a BOS: added to completions, not to rendered chats."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    base, _ = smollm
    backend = Tokenizer.from_str(base.backend_tokenizer.to_str())  # a copy: the fixture's stays as it is
    backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[
        ("<|im_start|>", base.convert_tokens_to_ids("<|im_start|>"))])
    template = (
        "{{ bos_token }}{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "{% if loop.index > 5 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
        "{% else %}{{ m['content'] | tojson }}{% endif %}{{ '<|im_end|>\\n' }}\n"
        "    {% endfor %}{{ ns.n }}{% if tools is none and documents is none %}!{% endif %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  unk_token="<|endoftext|>", chat_template=template)
    proxy = PromptTokenizer(TokenizerSpec.from_json(served(tok, block_size=4)))
    for text in TEXTS[:5]:
        assert proxy.encode_prompt(text) == tok(text).input_ids
        assert proxy.encode_prompt(text)[0] == tok.bos_token_id
    for messages in CHATS[:6]:
        messages = [{**m, "content": m["content"] + " <a href='x'>&</a>"} if isinstance(m["content"], str) else m
                    for m in messages]
        ids = encode_chat(tok, messages)
        assert proxy.encode_chat(messages) == ids
        assert ids.count(tok.bos_token_id) == ids.count(tok.convert_tokens_to_ids("<|im_start|>"))
    with pytest.raises(ValueError, match="no tools"):
        proxy.encode_chat([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="no tools"):
        encode_chat(tok, [{"role": "tool", "content": "x"}])


def test_what_cannot_be_tokenized_is_a_value_error(smollm):
    tok, proxy = smollm
    no_template = json.loads(served(tok))
    no_template["chat_template"] = None
    plain = PromptTokenizer(TokenizerSpec.from_json(json.dumps(no_template)))
    with pytest.raises(ValueError, match="no chat template"):
        plain.encode_chat([{"role": "user", "content": "hi"}])
    for bad in ([], [{"role": "", "content": "x"}], [{"role": "user", "content": 3}],
                [{"role": "user", "content": [{"type": "image_url"}]}], ["hi"]):
        with pytest.raises(ValueError):
            proxy.encode_chat(bad)
    with pytest.raises(ValueError, match="chat template"):
        PromptTokenizer(TokenizerSpec.from_json(json.dumps({**no_template, "chat_template": "{% if %}"})))
    with pytest.raises(ValueError, match="tokenizer.json"):
        PromptTokenizer(TokenizerSpec.from_json(json.dumps({**no_template, "tokenizer": "{}"})))


@pytest.mark.parametrize("change", [
    {"tokenizer": ""}, {"tokenizer": None}, {"chat_template": 3}, {"special_tokens": ["<s>"]},
    {"special_tokens": {"bos_token": 1}}, {"block_size": 0}, {"block_size": True}, {"block_size": 2**17},
    {"hash_seed": -1}, {"hash_seed": 2**64}, {"hash_seed": "1"},
])
def test_spec_is_validated(change):
    good = {"tokenizer": "{}", "chat_template": None, "special_tokens": {"bos_token": "<s>", "pad_token": None},
            "block_size": 16, "hash_seed": 7}
    spec = TokenizerSpec.from_json(json.dumps(good))
    assert spec.special_tokens == {"bos_token": "<s>"}  # null: the worker has none, the template sees none
    with pytest.raises(ValueError):
        TokenizerSpec.from_json(json.dumps({**good, **change}))
    without_seed = dict(good)
    del without_seed["hash_seed"]
    with pytest.raises(ValueError, match="missing"):
        TokenizerSpec.from_json(json.dumps(without_seed))
    assert spec.digest() == TokenizerSpec.from_json(json.dumps(good)).digest()
    assert spec.digest() != TokenizerSpec.from_json(json.dumps({**good, "block_size": 32})).digest()


async def test_tokenizing_in_a_thread_lets_the_event_loop_run(smollm):
    """The proxy tokenizes long prompts in a thread; the tokenizer must let go of the GIL meanwhile: the event
    loop keeps turning while it runs (a tokenizer that held the GIL would let it turn at most at its ends). Counted
    in turns, not timed: a loaded machine slows both alike."""
    import asyncio
    import time

    _, proxy = smollm
    req = parse_request(json.dumps({"prompt": "The quick brown fox jumps over the lazy dog. " * 4000}).encode(),
                        RequestKind.COMPLETION)
    turns: list[float] = []

    async def tick(done: asyncio.Event) -> None:
        while not done.is_set():
            await asyncio.sleep(0)
            turns.append(time.perf_counter())

    done = asyncio.Event()
    ticker = asyncio.create_task(tick(done))
    await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    keys = await asyncio.to_thread(proxy.keys, req)
    t1 = time.perf_counter()
    done.set()
    await ticker
    assert keys.num_tokens > 40_000
    during = sum(t0 < t < t1 for t in turns)
    # (it turns tens of thousands of times here; held by a C call that keeps the GIL, ~10 times, at the ends)
    assert during >= 1000, f"the loop turned {during} times in the {(t1 - t0) * 1e3:.0f} ms the tokenizer ran"


@pytest.mark.parametrize("salt", [None, "tenant-a", "tenant-b"])
@pytest.mark.parametrize("kind", [RequestKind.COMPLETION, RequestKind.CHAT])
def test_keyed_salted_keys_equal_the_workers(smollm, kind, salt):
    """With the deployment's key and a request's cache_salt, the proxy names the blocks as a worker's KVCache
    does (same key from the same cluster token), and another salt (or none) shares no block with it."""
    tok, _ = smollm
    key = hash_key("a-cluster-token")
    proxy = PromptTokenizer(TokenizerSpec.from_json(served(tok)), key)
    worker = KVCache(BlockAllocator(4), 16, SEED, key)
    body = {"prompt": TEXTS[-1]} if kind is RequestKind.COMPLETION else {"messages": CHATS[-1]}
    req = parse_request(json.dumps({**body, **({} if salt is None else {"cache_salt": salt})}).encode(), kind)
    ids = proxy.token_ids(req)
    hashes = proxy.keys(req).hashes
    assert hashes == tuple(worker.hashes(ids, salt)) and len(hashes) == len(ids) // 16 > 0
    others = {tuple(worker.hashes(ids, s)) for s in (None, "tenant-a", "tenant-b") if s != salt}
    assert all(not set(o) & set(hashes) for o in others)
    assert not set(hashes) & set(PromptTokenizer(TokenizerSpec.from_json(served(tok))).keys(req).hashes)  # unkeyed


TEMPLATE_ARGS = [
    {"add_generation_prompt": False},
    {"add_generation_prompt": False, "continue_final_message": True,
     "messages_tail": [{"role": "assistant", "content": "Sure, the answer is"}]},
    {"add_generation_prompt": False, "continue_final_message": True,
     "messages_tail": [{"role": "assistant", "content": "  spaced out  "}]},
    {"chat_template_kwargs": {"enable_thinking": False, "custom": [1, 2]}, "documents": [{"title": "t", "text": "x"}]},
    {"add_special_tokens": True},
]


@pytest.mark.parametrize("args", TEMPLATE_ARGS, ids=range(len(TEMPLATE_ARGS)))
def test_chat_template_arguments_tokenize_as_the_workers_do(smollm, args):
    """add_generation_prompt, continue_final_message (transformers' cut after the final message), documents and
    chat_template_kwargs: the proxy's copy renders what the workers' transformers tokenizer renders."""
    tok, proxy = smollm
    args = dict(args)
    messages = [*CHATS[2], *args.pop("messages_tail", [])]
    req = parse_request(json.dumps({"messages": messages, **args}).encode(), RequestKind.CHAT)
    ids = encode_chat(tok, req.messages, add_special_tokens=bool(req.add_special_tokens),
                      template_args=req.chat.as_kwargs())
    assert proxy.token_ids(req) == ids
    if req.chat.continue_final_message:  # the text ends with the final message, open
        text = tok.decode(ids)
        assert text.endswith(messages[-1]["content"].rstrip()) or text.endswith(messages[-1]["content"])
        assert text.count("<|im_start|>assistant") == 2


def test_template_variables_reach_the_template(smollm):
    """A template reading documents and a chat_template_kwargs variable, in both renderers."""
    from transformers import PreTrainedTokenizerFast

    base, _ = smollm
    template = ("{% for d in documents or [] %}[{{ d['text'] }}]{% endfor %}{% if shout %}LOUD {% endif %}"
                "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, bos_token="<|im_start|>",
                                  eos_token="<|im_end|>", unk_token="<|endoftext|>", chat_template=template)
    proxy = PromptTokenizer(TokenizerSpec.from_json(served(tok)))
    body = {"messages": [{"role": "user", "content": "hi"}], "documents": [{"text": "doc one"}],
            "chat_template_kwargs": {"shout": True}}
    req = parse_request(json.dumps(body).encode(), RequestKind.CHAT)
    ids = encode_chat(tok, req.messages, template_args=req.chat.as_kwargs())
    assert proxy.token_ids(req) == ids
    assert tok.decode(ids) == "[doc one]LOUD user: hi\n"
    plain = parse_request(json.dumps({"messages": body["messages"]}).encode(), RequestKind.CHAT)
    assert tok.decode(encode_chat(tok, plain.messages, template_args=plain.chat.as_kwargs())) == "user: hi\n"


def test_tools_and_tool_calls_reach_the_template(smollm):
    """tools and an assistant's tool_calls (arguments decoded from their JSON string, as vLLM hands them) and
    tool messages render alike in the workers' transformers tokenizer and the proxy's copy."""
    from transformers import PreTrainedTokenizerFast

    base, _ = smollm
    template = ("{% if tools %}<tools>{% for t in tools %}{{ t['function'] | tojson }}{% endfor %}</tools>\n{% endif %}"
                "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ {'name': c['function']['name'], "
                "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, bos_token="<|im_start|>",
                                  eos_token="<|im_end|>", unk_token="<|endoftext|>", chat_template=template)
    proxy = PromptTokenizer(TokenizerSpec.from_json(served(tok)))
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    req = parse_request(json.dumps({"messages": messages, "tools": [tool]}).encode(), RequestKind.CHAT)
    ids = encode_chat(tok, req.messages, template_args=req.chat.as_kwargs())
    assert proxy.token_ids(req) == ids
    text = tok.decode(ids)
    assert text.startswith('<tools>{"name": "get_weather", "parameters": {"type": "object"}}</tools>\n')
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool\nsunny<|im_end|>" in text
