"""A chat's template arguments (add_generation_prompt, continue_final_message, chat_template_kwargs, documents) and
the workers' ``--chat-template FILE``, on simulated P/D and colocated workers behind real proxies: P/D gives the
colocated tokens, the prompt is what the template renders from those arguments, and the cache-aware proxy's copy
of the tokenizer (read from the workers, template included) counts the tokens the workers count."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port, post_json, start_pd_and_colocated, wait_until

TEMPLATE = ("{% for d in documents or [] %}<doc>{{ d['text'] }}</doc>\n{% endfor %}"
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
            "{% if not loop.last or not continue_open %}<|im_end|>\n{% endif %}{% endfor %}"
            "{% if style %}<|im_start|>system\nstyle={{ style }}<|im_end|>\n{% endif %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT = [{"role": "user", "content": "Name a colour."}]
OPEN = [*CHAT, {"role": "assistant", "content": "The colour is"}]


_call = post_json


@pytest.fixture(scope="module")
def urls(tmp_path_factory, smollm_dir: Path):
    tmp = tmp_path_factory.mktemp("chat-options")
    template = tmp / "template.jinja"
    template.write_text(TEMPLATE)
    options = ["--model", str(smollm_dir), "--engine", "sim", "--sim-speedup", "inf", "--threads", "1",
               "--max-model-len", "512", "--served-model-name", "m", "--chat-template", str(template),
               "--trust-request-chat-template"]  # (a request's own template: the "own-template" case)
    c = Cluster(tmp)
    try:
        trust = ["--trust-request-chat-template"]
        out = start_pd_and_colocated(c, options, pd_proxy=["--policy", "cache_aware", *trust], co_proxy=trust)
        wait_until(lambda: _call(out["pd"], "/tokenize", {"prompt": "x"}) is not None
                   and json.loads(urllib.request.urlopen(out["pd"] + "/cluster", timeout=10).read())["tokenizer"],
                   60, "the cache-aware proxy's tokenizer")
    except BaseException:
        c.stop()
        raise
    yield out
    c.stop()


CASES = {
    "plain": {"messages": CHAT},
    "no-generation-prompt": {"messages": CHAT, "add_generation_prompt": False},
    "continue": {"messages": OPEN, "add_generation_prompt": False, "continue_final_message": True},
    "kwargs-and-documents": {"messages": CHAT, "chat_template_kwargs": {"style": "terse"},
                             "documents": [{"text": "red is a colour"}]},
    "own-template": {"messages": CHAT, "chat_template": "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
                                                        "\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"},
}
RENDERED = {  # what the template file renders for each case (the sim tokenizer's text of the prompt)
    "plain": "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n",
    "no-generation-prompt": "<|im_start|>user\nName a colour.<|im_end|>\n",
    "continue": "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\nThe colour is",
    "kwargs-and-documents": "<doc>red is a colour</doc>\n<|im_start|>user\nName a colour.<|im_end|>\n"
                            "<|im_start|>system\nstyle=terse<|im_end|>\n<|im_start|>assistant\n",
    "own-template": "[user] Name a colour.\n>",
}


@pytest.mark.parametrize("case", list(CASES))
def test_template_arguments_reach_the_prompt_everywhere(urls, case):
    body = {**CASES[case], "max_tokens": 4, "temperature": 0}
    tokenized = {name: _call(urls[name], "/tokenize", CASES[case]) for name in ("prefill", "decode", "pd", "co")}
    ids = tokenized["prefill"]["tokens"]
    assert all(t["tokens"] == ids for t in tokenized.values()), tokenized  # the proxy's copy: its own answer
    assert _call(urls["prefill"], "/detokenize", {"tokens": ids})["prompt"] == RENDERED[case]
    pd = _call(urls["pd"], "/v1/chat/completions", body)
    co = _call(urls["co"], "/v1/chat/completions", body)
    assert pd["choices"][0]["message"] == co["choices"][0]["message"]
    assert pd["usage"]["prompt_tokens"] == co["usage"]["prompt_tokens"] == len(ids)


def test_template_arguments_that_make_no_sense_are_400(urls):
    for body, param in (({"messages": OPEN, "continue_final_message": True}, "continue_final_message"),
                        ({"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}},
                         "chat_template_kwargs"),
                        ({"messages": CHAT, "documents": [1]}, "documents"),
                        ({"messages": CHAT, "chat_template": "{% for m in messages %}"}, "chat_template")):
        for name in ("pd", "co"):
            err = _call(urls[name], "/v1/chat/completions", body, status=400)
            assert err["error"]["param"] == param


def test_a_worker_with_a_broken_template_file_does_not_start(tmp_path, smollm_dir):
    import subprocess
    import sys

    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    out = subprocess.run([sys.executable, "-m", "xpyd", "colocated", "--model", str(smollm_dir), "--engine", "sim",
                          "--port", str(free_port()), "--chat-template", str(bad)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "chat template" in (out.stderr + out.stdout)


def test_the_request_id_field_names_the_response(urls):
    """vLLM's request_id field names the response as X-Request-Id does (the colocated proxy: its header)."""
    for name in ("pd", "co"):
        body = {"messages": CHAT, "max_tokens": 2, "request_id": f"job-{name}"}
        req = urllib.request.Request(urls[name] + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            answer, header = json.loads(r.read()), r.headers["X-Request-Id"]
        assert header == f"job-{name}"
        if name == "pd":  # (the colocated proxy passes its worker's answer on, named by the worker)
            assert answer["id"] == f"chatcmpl-job-{name}"
    err = _call(urls["pd"], "/v1/chat/completions", {"messages": CHAT, "request_id": "bad id\n"}, status=400)
    assert err["error"]["param"] == "request_id"
