#!/usr/bin/env python3
"""The same OpenAI requests to vLLM and to one or more xpyd deployments, compared field by field.

Each request (completions and chat; greedy, or seeded) is sent to every server in turn. Every server's
answer is compared with the first server's (vLLM when given): text, token ids (asked with
``return_tokens_as_token_ids``), finish_reason, stop_reason, usage, and logprobs (chosen, top alternatives,
prompt logprobs: |diff| <= --tol). Every server's logprobs are also checked against a float32 transformers
reference computed here (log_softmax over the whole sequence, the raw logprobs vLLM returns by default), and
a few properties a request asks for are checked on each answer on its own (``expect:``). A server that
answers 4xx is reported as ``unsupported: <its message>``.

Seeded sampling draws from each engine's own random stream, so seeded texts and token ids are only expected to
be the same between xpyd deployments: against vLLM they are reported as ``rng`` (not counted as a
difference), and what the request constrains (min_p) is checked against the reference instead.

    .venv/bin/python scripts/compare_vllm.py --model-dir DIR --served-model-name smollm2 \\
        --vllm http://127.0.0.1:18701 --xpyd colocated=http://127.0.0.1:18800 --xpyd 1p1d=http://127.0.0.1:18900 \\
        --json /tmp/compare.json

Exit status 0, or 1 with --fail-on-diff when some field differs (``rng`` and ``unsupported`` do not count).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import requests

TOL = 1e-3
SAME, DIFFERS, UNSUPPORTED, ERROR, RNG, ABSENT = "same", "differs", "unsupported", "error", "rng", "absent"


# ----------------------------------------------------------------------------------------------- servers
@dataclass(frozen=True)
class Server:
    name: str
    url: str
    engine: str  # "vllm" or "xpyd": seeded samples are compared within one engine only


def parse_servers(vllm: list[str], xpyd: list[str]) -> list[Server]:
    out = []
    for engine, specs in (("vllm", vllm), ("xpyd", xpyd)):
        for i, spec in enumerate(specs):
            name, _, url = spec.partition("=") if "=" in spec.split("://", 1)[0] else ("", "", spec)
            name = name or (engine if i == 0 else f"{engine}{i + 1}")
            out.append(Server(name, url.rstrip("/"), engine))
    if len({s.name for s in out}) != len(out):
        raise SystemExit("server names must be distinct (use NAME=URL)")
    return out


# ----------------------------------------------------------------------------------------------- cases
@dataclass
class Case:
    name: str
    endpoint: str  # "completions" or "chat"
    body: dict
    seeded: bool = False  # sampled with a seed: tokens compared within one engine only
    expect: list[tuple[str, Callable[["Answer", "Case"], str | None]]] = field(default_factory=list)
    # reference tokenization: how the prompt(s) are turned into ids, as the server should
    prompts: list[list[int]] | None = None  # filled in by build_prompt_ids


def build_cases(tok, model: str) -> list[Case]:
    def one(text: str) -> int:
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise SystemExit(f"{text!r} is not one token in this tokenizer: {ids}")
        return ids[0]

    paris, dot, the = one(" Paris"), one("."), one(" the")
    q_france = [{"role": "user", "content": "What is the capital of France?"}]
    fruits = "Here is a list of fruits: apple, banana, cherry,"
    story = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
    chatml = "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"
    long_prompt = ("The history of the city goes back many centuries. " * 6) + "In summary, the city"
    ids_on = {"return_tokens_as_token_ids": True}
    city_schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                   "required": ["city", "country"], "additionalProperties": False}
    weather_tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                       "additionalProperties": False}}}

    def comp(**kw) -> dict:
        return {"model": model, "temperature": 0, **kw}

    def chat(messages, **kw) -> dict:
        return {"model": model, "messages": messages, "temperature": 0, **kw}

    def all_ids_are(token: int):
        def check(a: Answer, c: Case) -> str | None:
            bad = [t for ch in a.choices for t in (ch.ids or [None]) if t != token]
            return None if not bad else f"token ids other than {token}: {bad[:5]}"
        return check

    def at_least_tokens(n: int):
        def check(a: Answer, c: Case) -> str | None:
            got = (a.usage or {}).get("completion_tokens")
            return None if got is not None and got >= n else f"completion_tokens {got} < min_tokens {n}"
        return check

    def stopped_by(reason):
        def check(a: Answer, c: Case) -> str | None:
            ch = a.choices[0]
            if ch.finish_reason == "stop" and ch.stop_reason == reason:
                return None
            return f"finish_reason {ch.finish_reason!r}, stop_reason {ch.stop_reason!r} (want 'stop', {reason!r})"
        return check

    def text_ends_with(s: str):
        def check(a: Answer, c: Case) -> str | None:
            t = a.choices[0].text or ""
            return None if t.endswith(s) else f"text does not end with {s!r}: ...{t[-30:]!r}"
        return check

    def n_choices(n: int):
        def check(a: Answer, c: Case) -> str | None:
            idx = sorted(ch.index for ch in a.choices)
            return None if idx == list(range(n)) else f"choice indexes {idx}, want 0..{n - 1}"
        return check

    def prompt_tokens(n: int):
        def check(a: Answer, c: Case) -> str | None:
            got = (a.usage or {}).get("prompt_tokens")
            return None if got == n else f"prompt_tokens {got}, want {n}"
        return check

    def valid_json(a: Answer, c: Case) -> str | None:
        try:
            json.loads(a.choices[0].text or "")
        except ValueError as e:
            return f"not JSON ({e}): {(a.choices[0].text or '')[:60]!r}"
        return None

    def tool_call_matches(name: str, required: list[str]):
        def check(a: Answer, c: Case) -> str | None:
            calls = a.choices[0].tool_calls
            if not calls or calls[0][0] != name:
                return f"no tool call to {name}: tool_calls {calls}, content {(a.choices[0].text or '')[:60]!r}"
            try:
                args = json.loads(calls[0][1])
            except (TypeError, ValueError) as e:
                return f"arguments are not JSON ({e}): {calls[0][1]!r}"
            if not isinstance(args, dict) or any(k not in args for k in required):
                return f"arguments do not match the function's parameters: {calls[0][1]!r}"
            return None
        return check

    def no_output(a: Answer, c: Case) -> str | None:
        got = (a.usage or {}).get("completion_tokens")
        return None if got == 0 else f"completion_tokens {got}, want 0"

    return [
        Case("greedy_logprobs5", "completions",
             comp(prompt="The capital of France is", max_tokens=16, logprobs=5, **ids_on)),
        Case("presence_frequency_penalty", "completions",
             comp(prompt=fruits, max_tokens=32, presence_penalty=1.0, frequency_penalty=0.8, logprobs=1, **ids_on)),
        Case("repetition_penalty", "completions",
             comp(prompt=fruits, max_tokens=32, repetition_penalty=1.3, logprobs=1, **ids_on)),
        Case("chat_penalties", "chat",
             chat([{"role": "user", "content": "Name five animals."}], max_tokens=32, presence_penalty=0.5,
                  frequency_penalty=0.5, repetition_penalty=1.1, logprobs=True, top_logprobs=1, **ids_on)),
        Case("logit_bias_force", "completions",
             comp(prompt=story, max_tokens=6, logit_bias={str(the): 100}, logprobs=1, **ids_on),
             expect=[("forced token", all_ids_are(the))]),
        Case("logit_bias_ban", "chat",
             chat(q_france, max_tokens=16, logit_bias={str(paris): -100}, logprobs=True, **ids_on)),
        Case("min_tokens_stop_token_ids", "chat",
             chat(q_france, max_tokens=40, min_tokens=12, stop_token_ids=[dot], ignore_eos=False, logprobs=True,
                  **ids_on),
             expect=[("min_tokens", at_least_tokens(12))]),
        Case("stop_token_ids", "chat",
             chat(q_france, max_tokens=32, stop_token_ids=[dot], logprobs=True, **ids_on),
             expect=[("stopped", stopped_by(dot))]),
        Case("stop_str_included", "completions",
             comp(prompt="The capital of France is", max_tokens=16, stop=[" Paris"], include_stop_str_in_output=True,
                  logprobs=1, **ids_on),
             expect=[("stopped", stopped_by(" Paris")), ("text", text_ends_with(" Paris"))]),
        Case("stop_str_excluded", "chat",
             chat(q_france, max_tokens=16, stop=["Paris"], logprobs=True, **ids_on),
             expect=[("stopped", stopped_by("Paris"))]),
        Case("n3_greedy", "completions",
             comp(prompt=story, max_tokens=10, n=3, logprobs=1, **ids_on), expect=[("choices", n_choices(3))]),
        Case("n3_top_k1", "completions",  # n > 1 that vLLM accepts (not greedy) and that is still deterministic
             comp(prompt=story, max_tokens=10, n=3, temperature=0.8, top_k=1, seed=5, logprobs=1, **ids_on),
             expect=[("choices", n_choices(3))]),
        Case("n3_seeded", "completions",
             comp(prompt=story, max_tokens=10, n=3, temperature=0.8, seed=1234, logprobs=1, **ids_on),
             seeded=True, expect=[("choices", n_choices(3))]),
        Case("chat_logprobs_top5", "chat",
             chat(q_france, max_tokens=16, logprobs=True, top_logprobs=5, **ids_on)),
        Case("echo_max_tokens_0", "completions",
             comp(prompt="The quick brown fox jumps over the lazy dog", max_tokens=0, echo=True, logprobs=5, **ids_on),
             expect=[("no output", no_output)]),
        Case("echo_max_tokens_1", "completions",
             comp(prompt="The quick brown fox jumps over the lazy dog", max_tokens=1, echo=True, logprobs=5,
                  **ids_on)),
        Case("echo_token_ids_prompt", "completions",  # what lm-evaluation-harness sends (tokenized_requests)
             comp(prompt=[tok.encode("Question: What is 2 + 2?\nAnswer: 4", add_special_tokens=False)],
                  max_tokens=1, echo=True, logprobs=1, seed=1234)),
        Case("prompt_logprobs3", "completions",
             comp(prompt="The capital of France is", max_tokens=4, prompt_logprobs=3, logprobs=1, **ids_on)),
        Case("chat_prompt_logprobs2", "chat",
             chat(q_france, max_tokens=4, prompt_logprobs=2, logprobs=True, **ids_on)),
        Case("two_prompts", "completions",
             comp(prompt=["The capital of France is", "2 + 2 ="], max_tokens=8, logprobs=1, **ids_on),
             expect=[("choices", n_choices(2))]),
        Case("chat_no_generation_prompt", "chat",
             chat(q_france, max_tokens=16, add_generation_prompt=False, logprobs=True, **ids_on)),
        Case("chat_continue_final_message", "chat",
             chat(q_france + [{"role": "assistant", "content": "The capital of France is"}], max_tokens=8,
                  add_generation_prompt=False, continue_final_message=True, logprobs=True, **ids_on)),
        Case("chat_template_kwargs", "chat",  # the model's template reads no extra variable: output unchanged
             chat(q_france, max_tokens=16, chat_template_kwargs={"enable_thinking": False}, logprobs=True, **ids_on)),
        Case("chat_template_with_kwargs", "chat",  # a request-level template that reads a kwarg
             chat(q_france, max_tokens=16, logprobs=True, **ids_on, chat_template_kwargs={"persona": "a pirate"},
                  chat_template=("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                                 "{% endfor %}{% if persona %}<|im_start|>system\nAnswer as {{ persona }}.<|im_end|>\n"
                                 "{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))),
        Case("response_format_json_schema", "chat",
             chat([{"role": "user", "content": "Give the capital of France as JSON."}], max_tokens=40,
                  response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": city_schema}},
                  logprobs=True, **ids_on),
             expect=[("json", valid_json)]),
        Case("response_format_json_object", "chat",
             chat([{"role": "user", "content": "Describe Paris as a JSON object."}], max_tokens=40,
                  response_format={"type": "json_object"}, logprobs=True, **ids_on)),
        Case("structured_outputs_choice", "completions",
             comp(prompt="The capital of France is", max_tokens=8,
                  structured_outputs={"choice": ["London", "Paris", "Berlin"]}, logprobs=1, **ids_on)),
        Case("structured_outputs_regex", "completions",
             comp(prompt="The year the Eiffel Tower was built:", max_tokens=8,
                  structured_outputs={"regex": "[0-9]{4}"}, logprobs=1, **ids_on)),
        Case("tool_choice_named", "chat",
             chat([{"role": "user", "content": "What is the weather in Paris?"}], max_tokens=64, tools=[weather_tool],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}),
             expect=[("tool call", tool_call_matches("get_weather", ["city"]))]),
        Case("skip_special_tokens_false", "completions",
             comp(prompt=chatml, max_tokens=24, ignore_eos=True, skip_special_tokens=False, logprobs=1, **ids_on)),
        Case("special_tokens_no_spaces", "completions",
             comp(prompt=chatml, max_tokens=24, ignore_eos=True, skip_special_tokens=False,
                  spaces_between_special_tokens=False, logprobs=1, **ids_on)),
        Case("skip_special_tokens_true_ignore_eos", "completions",
             comp(prompt=chatml, max_tokens=24, ignore_eos=True, logprobs=1, **ids_on)),
        Case("truncate_prompt_tokens", "completions",
             comp(prompt=long_prompt, max_tokens=8, truncate_prompt_tokens=8, logprobs=1, **ids_on),
             expect=[("prompt_tokens", prompt_tokens(8))]),
        Case("min_p_seeded", "completions",
             comp(prompt=story, max_tokens=16, temperature=1.0, min_p=0.1, seed=7, logprobs=1, **ids_on),
             seeded=True),
        Case("chat_min_p_seeded", "chat",
             chat([{"role": "user", "content": "Tell me a short story."}], max_tokens=16, temperature=0.9,
                  min_p=0.2, seed=11, logprobs=True, **ids_on), seeded=True),
    ]


# ----------------------------------------------------------------------------------------------- answers
@dataclass
class Choice:
    index: int
    text: str | None
    ids: list[int] | None  # the output's token ids (or, echoed, prompt + output), from the logprobs' tokens
    lps: list[float | None] | None  # logprob of each of those tokens
    tops: list[dict[str, float] | None] | None  # top alternatives per token, keyed "token_id:N" (or text)
    finish_reason: str | None
    stop_reason: Any
    prompt_lps: list[dict[str, float] | None] | None  # prompt_logprobs: per prompt position {id: logprob}
    echoed: bool = False  # ids/lps start at the prompt's first token
    tool_calls: list | None = None  # chat: [(function name, arguments)] (ids and types left out)


@dataclass
class Answer:
    status: int
    message: str  # the error message when status != 200
    raw: Any
    choices: list[Choice] = field(default_factory=list)
    usage: dict | None = None


def _token_id(token: Any) -> int | str:
    if isinstance(token, str) and token.startswith("token_id:"):
        try:
            return int(token[len("token_id:"):])
        except ValueError:
            pass
    return token


def _prompt_lps(raw: list | None) -> list[dict[str, float] | None] | None:
    if raw is None:
        return None
    return [None if pos is None else {str(k): float(v["logprob"]) for k, v in pos.items()} for pos in raw]


def parse_answer(endpoint: str, status: int, body: Any, echo: bool) -> Answer:
    if status != 200 or not isinstance(body, dict) or "choices" not in body:
        msg = body.get("error", {}).get("message") if isinstance(body, dict) and isinstance(body.get("error"), dict) \
            else (body.get("message") if isinstance(body, dict) else None)
        return Answer(status, str(msg or body)[:500], body)
    ans = Answer(status, "", body, usage=body.get("usage"))
    top_prompt = body.get("prompt_logprobs")  # chat: prompt_logprobs at the top level
    for ch in body["choices"]:
        lp = ch.get("logprobs")
        ids = lps = tops = calls = None
        if endpoint == "completions":
            text = ch.get("text")
            if lp:
                ids = [_token_id(t) for t in lp.get("tokens") or []]
                lps = lp.get("token_logprobs")
                tops = lp.get("top_logprobs")
        else:
            text = (ch.get("message") or {}).get("content")
            calls = (ch.get("message") or {}).get("tool_calls") or None
            calls = None if calls is None else [((c.get("function") or {}).get("name"),
                                                 (c.get("function") or {}).get("arguments")) for c in calls]
            if lp and lp.get("content") is not None:
                content = lp["content"]
                ids = [_token_id(e.get("token")) for e in content]
                lps = [e.get("logprob") for e in content]
                tops = [{t["token"]: t["logprob"] for t in e.get("top_logprobs") or []} for e in content]
        if tops is not None:
            tops = [None if t is None else {str(k): float(v) for k, v in t.items()} for t in tops]
        ans.choices.append(Choice(
            index=ch.get("index", 0), text=text, ids=ids, lps=lps, tops=tops,
            finish_reason=ch.get("finish_reason"), stop_reason=ch.get("stop_reason"),
            prompt_lps=_prompt_lps(ch.get("prompt_logprobs", top_prompt)), echoed=echo and endpoint == "completions",
            tool_calls=calls,
        ))
    ans.choices.sort(key=lambda c: c.index)
    return ans


def send(session: requests.Session, server: Server, case: Case, timeout: float) -> tuple[Answer, float]:
    path = "/v1/completions" if case.endpoint == "completions" else "/v1/chat/completions"
    t0 = time.monotonic()
    try:
        r = session.post(server.url + path, json=case.body, timeout=timeout)
    except requests.RequestException as e:
        return Answer(0, f"{type(e).__name__}: {e}", None), time.monotonic() - t0
    try:
        body = r.json()
    except ValueError:
        body = r.text
    return parse_answer(case.endpoint, r.status_code, body, bool(case.body.get("echo"))), time.monotonic() - t0


# ----------------------------------------------------------------------------------------------- comparing
def first_diff_text(a: str | None, b: str | None) -> str | None:
    if a == b:
        return None
    if a is None or b is None:
        return f"{a!r} vs {b!r}"
    i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    return f"at char {i}: {a[max(0, i - 12):i + 24]!r} vs {b[max(0, i - 12):i + 24]!r}"


def first_diff_list(a: list | None, b: list | None) -> str | None:
    if a == b:
        return None
    if a is None or b is None:
        return f"{'none' if a is None else len(a)} vs {'none' if b is None else len(b)} items"
    i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    if i == min(len(a), len(b)):
        return f"lengths {len(a)} vs {len(b)} (same first {i})"
    return f"at {i}: {a[i]!r} vs {b[i]!r} (lengths {len(a)} vs {len(b)})"


def diff_floats(a: list | None, b: list | None, tol: float) -> tuple[str | None, float]:
    """(first difference beyond tol or None, max |diff|) of two lists of optional floats."""
    if a is None or b is None:
        return (None if a is b else f"{'none' if a is None else len(a)} vs {'none' if b is None else len(b)}"), 0.0
    worst, first = 0.0, None
    for i, (x, y) in enumerate(zip(a, b)):
        if (x is None) != (y is None):
            first = first or f"at {i}: {x!r} vs {y!r}"
            continue
        if x is None:
            continue
        d = abs(float(x) - float(y))
        worst = max(worst, d)
        if d > tol and first is None:
            first = f"at {i}: {x:.6f} vs {y:.6f} (|diff| {d:.2e})"
    if len(a) != len(b):
        first = first or f"lengths {len(a)} vs {len(b)}"
    return first, worst


def diff_tops(a: list | None, b: list | None, tol: float) -> tuple[str | None, float]:
    if a is None or b is None:
        return (None if a is b else f"{'none' if a is None else len(a)} vs {'none' if b is None else len(b)}"), 0.0
    worst, first = 0.0, None
    for i, (x, y) in enumerate(zip(a, b)):
        if (x is None) != (y is None):
            first = first or f"at {i}: {x!r} vs {y!r}"
            continue
        if x is None:
            continue
        if set(x) != set(y):
            only_a, only_b = sorted(set(x) - set(y)), sorted(set(y) - set(x))
            first = first or f"at {i}: alternatives differ: {only_a} ({[x[k] for k in only_a]}) vs {only_b} " \
                             f"({[y[k] for k in only_b]})"
        for k in set(x) & set(y):
            d = abs(x[k] - y[k])
            worst = max(worst, d)
            if d > tol and first is None:
                first = f"at {i} {k}: {x[k]:.6f} vs {y[k]:.6f}"
    if len(a) != len(b):
        first = first or f"lengths {len(a)} vs {len(b)}"
    return first, worst


def usage_view(u: dict | None) -> dict | None:
    return None if u is None else {k: u.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def compare(a: Answer, b: Answer, tol: float, rng: bool) -> list[tuple[str, str, str]]:
    """[(field, result, detail)] of answer b against answer a (both 200)."""
    rows = []

    def add(name: str, diff: str | None, detail: str = "", sampled: bool = False) -> None:
        if diff is None:
            rows.append((name, SAME, detail))
        else:
            rows.append((name, RNG if (rng and sampled) else DIFFERS, diff))

    add("n_choices", None if len(a.choices) == len(b.choices) else f"{len(a.choices)} vs {len(b.choices)}")
    add("usage", None if usage_view(a.usage) == usage_view(b.usage) else
        f"{usage_view(a.usage)} vs {usage_view(b.usage)}", sampled=True)
    for ca, cb in zip(a.choices, b.choices):
        p = f"[{ca.index}]" if len(a.choices) > 1 else ""
        add(f"text{p}", first_diff_text(ca.text, cb.text), sampled=True)
        add(f"token_ids{p}", first_diff_list(ca.ids, cb.ids), sampled=True)
        if ca.tool_calls is not None or cb.tool_calls is not None:
            add(f"tool_calls{p}", None if ca.tool_calls == cb.tool_calls else f"{ca.tool_calls} vs {cb.tool_calls}",
                sampled=True)
        add(f"finish_reason{p}", None if ca.finish_reason == cb.finish_reason else
            f"{ca.finish_reason!r} vs {cb.finish_reason!r}", sampled=True)
        add(f"stop_reason{p}", None if ca.stop_reason == cb.stop_reason else
            f"{ca.stop_reason!r} vs {cb.stop_reason!r}", sampled=True)
        if ca.lps is not None or cb.lps is not None:
            if ca.ids == cb.ids:
                d, worst = diff_floats(ca.lps, cb.lps, tol)
                add(f"logprobs{p}", d, f"max |diff| {worst:.2e}")
                d, worst = diff_tops(ca.tops, cb.tops, tol)
                add(f"top_logprobs{p}", d, f"max |diff| {worst:.2e}")
            else:  # different tokens: compare the common prefix only
                n = next((k for k in range(min(len(ca.ids or []), len(cb.ids or [])))
                          if ca.ids[k] != cb.ids[k]), min(len(ca.ids or []), len(cb.ids or [])))
                d, worst = diff_floats((ca.lps or [])[:n], (cb.lps or [])[:n], tol)
                add(f"logprobs{p}", d, f"first {n} tokens (where the ids agree): max |diff| {worst:.2e}")
        if ca.prompt_lps is not None or cb.prompt_lps is not None:
            d, worst = diff_tops(ca.prompt_lps, cb.prompt_lps, tol)
            add(f"prompt_logprobs{p}", d, f"max |diff| {worst:.2e}")
    return rows


# ----------------------------------------------------------------------------------------------- reference
class Reference:
    """Float32 transformers logprobs of whole sequences (log_softmax of every position's logits)."""

    def __init__(self, model_dir: str, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self._cache: dict[tuple[int, ...], Any] = {}

    def logprobs(self, ids: list[int]):
        """[len(ids), vocab]: row j is the distribution of token j+1 given ids[:j+1]."""
        key = tuple(ids)
        if key not in self._cache:
            with self.torch.inference_mode():
                logits = self.model(self.torch.tensor([ids])).logits[0].float()
            self._cache[key] = self.torch.log_softmax(logits, dim=-1)
            if len(self._cache) > 64:
                self._cache.pop(next(iter(self._cache)))
        return self._cache[key]


def reference_prompt_ids(tok, case: Case) -> list[list[int]]:
    """Each prompt's token ids as the server should make them (one list per prompt)."""
    b = case.body
    if case.endpoint == "chat":
        kwargs = dict(b.get("chat_template_kwargs") or {})
        kwargs.update(add_generation_prompt=b.get("add_generation_prompt", True),
                      continue_final_message=b.get("continue_final_message", False))
        if b.get("chat_template"):
            kwargs["chat_template"] = b["chat_template"]
        text = tok.apply_chat_template(b["messages"], tokenize=False, **kwargs)
        prompts = [tok.encode(text, add_special_tokens=bool(b.get("add_special_tokens", False)))]
    else:
        ps = b["prompt"]
        if isinstance(ps, str) or (isinstance(ps, list) and ps and isinstance(ps[0], int)):
            ps = [ps]
        prompts = [p if isinstance(p, list) else tok.encode(p, add_special_tokens=b.get("add_special_tokens", True))
                   for p in ps]
    k = b.get("truncate_prompt_tokens")
    if k is not None and k > 0:
        prompts = [p[-k:] for p in prompts]
    return prompts


def reference_rows(ref: Reference, tok, case: Case, ans: Answer, tol: float) -> list[tuple[str, str, str]]:
    """This answer's logprobs against the float32 reference (and, for min_p, every sampled token's
    probability relative to the most likely one, at the request's temperature)."""
    rows = []
    prompts = case.prompts
    n = case.body.get("n", 1) or 1
    usage_prompt = (ans.usage or {}).get("prompt_tokens")
    total = sum(len(p) for p in prompts) if len(prompts) > 1 else len(prompts[0])
    if usage_prompt is not None:
        rows.append(("ref:prompt_tokens", SAME if usage_prompt == total else DIFFERS,
                     f"server {usage_prompt}, reference tokenization {total}"))
    k_top = case.body.get("top_logprobs") if case.endpoint == "chat" else case.body.get("logprobs")
    k_top = k_top if isinstance(k_top, int) and not isinstance(k_top, bool) else 0
    for ch in ans.choices:
        p = f"[{ch.index}]" if len(ans.choices) > 1 else ""
        prompt = prompts[min(ch.index // n, len(prompts) - 1)]
        if ch.ids is not None and any(not isinstance(t, int) for t in ch.ids):
            if case.body.get("return_tokens_as_token_ids"):
                rows.append((f"ref:logprobs{p}", DIFFERS, "tokens are not 'token_id:N' (return_tokens_as_token_ids)"))
                continue
            if not ch.echoed:
                continue
            # no ids asked (as lm-evaluation-harness asks): the echoed prompt's part is checked, by the prompt's ids
            ch = Choice(ch.index, ch.text, list(prompt), (ch.lps or [])[:len(prompt)], None, ch.finish_reason,
                        ch.stop_reason, ch.prompt_lps, echoed=True)
        if ch.echoed and ch.ids is not None:
            seq, start = list(ch.ids), 0
            if seq[:len(prompt)] != prompt:
                rows.append((f"ref:echo_ids{p}", DIFFERS, first_diff_list(prompt, seq[:len(prompt)])))
        else:
            seq, start = prompt + list(ch.ids or []), len(prompt)
        if not seq:
            continue
        lp = ref.logprobs(seq)
        worst, first, count = 0.0, None, 0
        for j, (tid, got, top) in enumerate(zip(ch.ids or [], ch.lps or [], ch.tops or [None] * len(ch.ids or []))):
            pos = start + j
            if pos == 0:
                if got is not None:
                    first = first or f"first prompt token has logprob {got}, want null"
                continue
            pairs = [(tid, got)] + [(_token_id(k), v) for k, v in (top or {}).items()]
            for t, v in pairs:
                if not isinstance(t, int) or v is None:
                    continue
                want = float(lp[pos - 1, t])
                d = abs(float(v) - want)
                count += 1
                worst = max(worst, d)
                if d > tol and first is None:
                    first = f"token {j} (id {t}): {v:.6f} vs reference {want:.6f}"
            if top and k_top:
                # the alternatives are the reference's k best (ids may swap on exact ties), and the chosen token
                # when it is not among them: added to a completion's k, first of a chat's k (as vLLM lists them)
                best = lp[pos - 1].topk(k_top)
                want_top = best.values.tolist()
                if isinstance(tid, int) and tid not in best.indices.tolist():
                    chosen = float(lp[pos - 1, tid])
                    want_top = want_top + [chosen] if case.endpoint == "completions" else [chosen] + want_top[:-1]
                want_top = sorted(want_top, reverse=True)
                got_top = sorted(top.values(), reverse=True)
                if first is None and (len(got_top) != len(want_top) or
                                      any(abs(g - w) > tol for g, w in zip(got_top, want_top))):
                    first = f"token {j}: top {k_top} {[round(g, 5) for g in got_top]} vs reference " \
                            f"{[round(w, 5) for w in want_top]}"
        if count:
            rows.append((f"ref:logprobs{p}", SAME if first is None else DIFFERS,
                         first or f"{count} values, max |diff| {worst:.2e}"))
        if ch.prompt_lps is not None:
            worst, first, count = 0.0, None, 0
            for j, pos_lps in enumerate(ch.prompt_lps[:len(prompt)]):
                if j == 0 or pos_lps is None:
                    continue
                if str(prompt[j]) not in pos_lps:
                    first = first or f"prompt position {j}: token {prompt[j]} missing from {list(pos_lps)}"
                for k, v in pos_lps.items():
                    want = float(lp[j - 1, int(k)])
                    d = abs(v - want)
                    count += 1
                    worst = max(worst, d)
                    if d > tol and first is None:
                        first = f"prompt position {j} id {k}: {v:.6f} vs reference {want:.6f}"
            rows.append((f"ref:prompt_logprobs{p}", SAME if first is None else DIFFERS,
                         first or f"{count} values, max |diff| {worst:.2e}"))
        min_p = case.body.get("min_p")
        if min_p and ch.ids:
            temp = float(case.body.get("temperature") or 1.0)
            bad = []
            for j, t in enumerate(ch.ids):
                row = lp[start + j - 1] / temp
                ratio = math.exp(float(row[t] - row.max()))
                if ratio < min_p * (1 - 1e-3):
                    bad.append((j, t, round(ratio, 4)))
            rows.append((f"ref:min_p{p}", SAME if not bad else DIFFERS,
                         f"every token has p >= {min_p} p_max" if not bad else f"below min_p: {bad[:3]}"))
    return rows


# ----------------------------------------------------------------------------------------------- main
def run(args) -> int:
    from transformers import AutoTokenizer

    servers = parse_servers(args.vllm or [], args.xpyd or [])
    if not servers:
        raise SystemExit("give at least one server: --vllm URL and/or --xpyd [NAME=]URL")
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    cases = build_cases(tok, args.served_model_name)
    if args.only:
        cases = [c for c in cases if any(s in c.name for s in args.only.split(","))]
    for c in cases:
        c.prompts = reference_prompt_ids(tok, c)
    ref = None if args.no_reference else Reference(args.model_dir, args.threads)
    base = servers[0]
    first_xpyd = next((s for s in servers if s.engine == "xpyd"), None)
    session = requests.Session()
    report = {"servers": [s.__dict__ for s in servers], "baseline": base.name, "tol": args.tol, "cases": []}
    table: list[tuple[str, str, str, str, str]] = []  # case, field, server, result, detail

    for case in cases:
        answers: dict[str, Answer] = {}
        entry = {"name": case.name, "endpoint": case.endpoint, "body": case.body, "answers": {}, "rows": []}
        for s in servers:
            ans, secs = send(session, s, case, args.timeout)
            answers[s.name] = ans
            entry["answers"][s.name] = {"status": ans.status, "seconds": round(secs, 3), "body": ans.raw}

        def put(field_name: str, server: str, against: str, result: str, detail: str) -> None:
            table.append((case.name, field_name, f"{server} vs {against}" if against else server, result, detail))
            entry["rows"].append({"field": field_name, "server": server, "against": against, "result": result,
                                  "detail": detail})

        for s in servers:  # each answer on its own: status, expectations, reference
            ans = answers[s.name]
            if ans.status != 200:
                kind = UNSUPPORTED if 400 <= ans.status < 500 else ERROR
                put("status", s.name, "", kind, f"{ans.status}: {ans.message}")
                continue
            for what, check in case.expect:
                problem = check(ans, case)
                put(f"expect:{what}", s.name, "", SAME if problem is None else DIFFERS, problem or "ok")
            if ref is not None:
                for f_name, result, detail in reference_rows(ref, tok, case, ans, args.tol):
                    put(f_name, s.name, "transformers", result, detail)
        for s in servers[1:]:  # each answer against the baseline's; seeded: also against the first xpyd's
            againsts = [base]
            if case.seeded and s.engine == "xpyd" and first_xpyd is not None and s is not first_xpyd \
                    and first_xpyd is not base:
                againsts.append(first_xpyd)
            for other in againsts:
                a, b = answers[other.name], answers[s.name]
                if a.status != 200 or b.status != 200:
                    if a.status != b.status:
                        put("status", s.name, other.name, DIFFERS, f"{a.status} vs {b.status}")
                    continue
                rng = case.seeded and other.engine != s.engine
                for f_name, result, detail in compare(a, b, args.tol, rng):
                    put(f_name, s.name, other.name, result, detail)
        report["cases"].append(entry)
        if args.progress:
            print(f"  {case.name}: " + ", ".join(f"{s.name} {answers[s.name].status}" for s in servers),
                  file=sys.stderr, flush=True)

    counts: dict[str, int] = {}
    for row in table:
        counts[row[3]] = counts.get(row[3], 0) + 1
    report["summary"] = counts
    shown = table if args.verbose else [r for r in table if r[3] != SAME]
    w = [max([len(h)] + [len(r[i]) for r in shown]) for i, h in enumerate(("case", "field", "server", "result"))]
    print(f"{'case':<{w[0]}}  {'field':<{w[1]}}  {'server':<{w[2]}}  {'result':<{w[3]}}  detail")
    for r in shown:
        detail = r[4] if len(r[4]) <= args.width else r[4][:args.width - 3] + "..."
        print(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]:<{w[3]}}  {detail}")
    same_cases = [e["name"] for e in report["cases"] if all(r["result"] == SAME for r in e["rows"])]
    print(f"\n{len(cases)} requests x {len(servers)} servers; rows: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if not args.verbose:
        print(f"all same ({len(same_cases)}): {', '.join(same_cases)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 1 if args.fail_on_diff and (counts.get(DIFFERS) or counts.get(ERROR)) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm", action="append", metavar="[NAME=]URL", help="a vLLM server (the baseline)")
    ap.add_argument("--xpyd", action="append", metavar="[NAME=]URL", help="an xpyd proxy (repeatable)")
    ap.add_argument("--model-dir", required=True, help="the HF model folder every server serves")
    ap.add_argument("--served-model-name", default=None, help="the 'model' of every request (default: none sent)")
    ap.add_argument("--json", help="write every request, answer and comparison here")
    ap.add_argument("--only", help="run only the requests whose names contain one of these (comma-separated)")
    ap.add_argument("--tol", type=float, default=TOL, help="logprob tolerance (default 1e-3)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("REF_THREADS", "1")),
                    help="torch threads of the transformers reference")
    ap.add_argument("--no-reference", action="store_true", help="skip the transformers reference")
    ap.add_argument("--verbose", action="store_true", help="print 'same' rows too")
    ap.add_argument("--progress", action="store_true", help="print each request's statuses as it goes")
    ap.add_argument("--width", type=int, default=140, help="detail column width")
    ap.add_argument("--fail-on-diff", action="store_true", help="exit 1 when a field differs")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
