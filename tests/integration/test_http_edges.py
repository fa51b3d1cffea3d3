"""Fuzz the HTTP edges of a real 1P1D cluster (tiny random Llama): the proxy and both workers' APIs.

A seeded generator builds bad requests (broken JSON, wrong types and values,
unsupported fields, huge and chunked bodies, wrong content types, methods and
paths, and for the workers request ids that do not parse). Every one must get
an OpenAI-style JSON error with a 4xx status, and afterwards: no process died,
no traceback in any log, both workers hold no request and no KV, the proxy
still sees both workers UP, and a good request works. Also: every listening
socket of every process is bound to 127.0.0.1 (the default).
"""

from __future__ import annotations

import json
import os
import random
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.cluster import Cluster, start_1p1d
from xpyd.signal.request_id import RequestId
from xpyd.worker.config import WorkerConfig

BLOCK = WorkerConfig(role="prefill").block_size  # the workers' default KV block size

SEED = 20261122
CASES = 150  # per edge
MAX_BODY = 4 * 1024 * 1024  # the default of the proxy and the workers


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir: Path) -> Iterator[tuple[Cluster, dict[str, str]]]:
    c, urls = start_1p1d(tmp_path_factory.mktemp("edges"), str(tiny_model_dir), batch_size=4, max_model_len=256)
    try:
        for role in ("prefill", "decode"):
            urls[role + "_signal"] = _get(urls[role] + "/xpyd/info")["signal_addr"]
        yield c, urls
    finally:
        c.stop()


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@dataclass
class Case:
    why: str
    method: str = "POST"
    path: str = "/v1/completions"
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "application/json"})
    chunked: bool = False


def send(base: str, case: Case) -> tuple[int, str, bytes]:
    """(status, content type, body); chunked bodies go without Content-Length."""
    data = case.body
    if case.chunked and data is not None:
        data = iter([data[i:i + 65536] for i in range(0, len(data), 65536)])
    req = urllib.request.Request(base + case.path, data=data, method=case.method, headers=case.headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()
    except (ConnectionError, urllib.error.URLError) as e:
        # A server may close the connection after answering 413 to a body it would not read.
        return -1, "", str(e).encode()


# ------------------------------------------------------------------ the generator

_WRONG = {  # field -> values that are wrong for it (type or range)
    "prompt": ["", [], [-1], [1.5], ["a", "b"], {}, 5, True, [[1], [2]], [2**40], [None]],
    "messages": [[], "hi", [{}], [5], [{"role": "tool", "content": "x"}], [{"role": "user", "content": 5}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                 [{"role": "user"}], [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                 [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]],
    "max_tokens": [0, -1, 1.5, "5", True, [], {}, 10**9, 2**70],
    "max_completion_tokens": [0, -3, "x", 2.5],
    "temperature": [-1, "hot", [], True, -1e-9, {}],
    "top_p": [0, 2, "x", -0.5, 1.0001, True],
    "top_k": [-2, 1.5, "x", True],
    "seed": [2**64, -(2**64), -1, 1.5, "x", True],
    "stop": ["", [""], [1], {}, ["a"] * 65, [None]],
    "stream": ["yes", 1, 0, [], {}],
    "ignore_eos": ["no", 1, []],
    "n": [0, "1", 129, -1, 1.5],
    "best_of": [3],
    "logprobs": [21, -1, "5", 1.5],
    "top_logprobs": [3, 21],
    "echo": ["yes", 1],
    "prompt_logprobs": [21, -2, "x"],
    "suffix": ["x"],
    "logit_bias": [{"x": 5}, {"1": "a"}, [1], {"-1": 1}],
    "presence_penalty": [2.5, "x", True],
    "frequency_penalty": [-2.01, [], "x"],
    "repetition_penalty": [0, -1, "x", 101],
    "tools": [[{"type": "function", "function": {"name": "bad name"}}], "x", [{"type": "function"}]],
    "tool_choice": ["sometimes", 5],
    "response_format": [{"type": "yaml"}, "x", {"type": "json_schema"}],
    "guided_json": ["[bad", 5],
    "guided_regex": ["(unclosed", ""],
    "stream_options": [{"include_usage": True}, "x", {"continuous_usage_stats": True}],
    "model": [5, [], {}, "no-such-model", ""],
    "kv_transfer_params": ["x", 5, [], {"max_tokens": 0}, {"max_tokens": "x"},
                           {"response": "x"}, {"response": {"id": "", "created": 1, "model": "m"}},
                           {"response": {"id": "x", "created": -1, "model": "m"}},
                           {"response": {"id": "x", "created": 1, "model": "m\n"}},
                           {"response": {"id": "x", "created": 1, "model": "m", "extra": 1}}],
}


def _good(kind: str, rng: random.Random) -> dict:
    body = {"max_tokens": rng.randint(1, 4), "temperature": 0}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "hello there"}]
    else:
        body["prompt"] = rng.choice(["hello world", [1, 2, 3]])
    return body


def _field_case(rng: random.Random, kind: str, edge: str) -> Case:
    body = _good(kind, rng)
    fields = [f for f in _WRONG if not (f == "messages" and kind != "chat") and not (f == "prompt" and kind == "chat")
              and not (f in ("max_completion_tokens", "top_logprobs", "tools", "tool_choice") and kind != "chat")]
    chosen = rng.sample(fields, rng.randint(1, 3))
    for name in chosen:
        value = rng.choice(_WRONG[name])
        if name == "stream_options" and value == {"include_usage": True}:
            body["stream"] = False  # stream_options without streaming is a 400
        if name == "kv_transfer_params" and edge == "proxy" and isinstance(value, dict):
            value = "x"  # the proxy replaces a well-typed one with its own
        body[name] = value
    if "stream" in body and body.get("stream_options") == {"include_usage": True} and body["stream"] is not False:
        body["stream"] = False
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    return Case(f"fields {chosen}", body=json.dumps(body).encode(), path=path)


def _syntax_case(rng: random.Random, kind: str) -> Case:
    good = json.dumps(_good(kind, rng)).encode()
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    choice = rng.randrange(12)
    if choice == 0:
        body, why = good[: rng.randrange(len(good))], "truncated JSON"
    elif choice == 1:
        body, why = bytes(rng.randrange(256) for _ in range(rng.randint(1, 200))), "random bytes"
    elif choice == 2:
        body, why = b'{"prompt": "\xff\xfe\x80"}', "invalid UTF-8"
    elif choice == 3:
        depth = rng.choice([100, 5000, 100000])
        body, why = b"[" * depth + b"]" * depth, f"nested {depth} deep"
    elif choice == 4:
        body, why = rng.choice([b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}',
                                b'{"prompt": "x", "temperature": -Infinity}']), "NaN/Infinity"
    elif choice == 5:
        body, why = rng.choice([b"[]", b'"prompt"', b"42", b"null", b"true", b"[{}]"]), "not an object"
    elif choice == 6:
        body, why = b"", "empty body"
    elif choice == 7:
        body, why = b'{"prompt": "a\\ud800b", "max_tokens": 2}', "lone surrogate"
    elif choice == 8:
        body, why = good.replace(b"{", b"{{", 1), "doubled brace"
    elif choice == 9:
        body, why = b'{"prompt": "x",}', "trailing comma"
    elif choice == 10:
        body, why = b"\xef\xbb\xbf" + good[:-1], "BOM + truncated"
    else:
        body, why = good + b"garbage", "trailing garbage"
    return Case(why, body=body, path=path)


def _transport_case(rng: random.Random, kind: str, edge: str) -> Case:
    good = json.dumps(_good(kind, rng)).encode()
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    choice = rng.randrange(6)
    if choice == 0:
        ctype = rng.choice(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=b",
                            "application/xml", "image/png", "json"])
        return Case(f"content type {ctype}", body=good, path=path, headers={"Content-Type": ctype})
    if choice == 1:
        return Case("GET on a POST route", method="GET", path=path, headers={})
    if choice == 2:
        method = rng.choice(["PUT", "DELETE", "PATCH"])
        return Case(f"{method}", method=method, path=path, body=good)
    if choice == 3:
        p = rng.choice(["/v1/nothing", "/v2/completions", "/v1/completions/x", "/%00", "/v1/embeddings", "/.."])
        return Case(f"path {p}", path=p, body=good)
    if choice == 4 or edge == "decode":  # (decode does not tokenize: prefill checks a text prompt's length)
        return Case("GET on a POST route with a body", method="GET", path=path, body=good)
    return Case("huge prompt (context length)", path=path,
                body=json.dumps({**_good(kind, rng), **({"prompt": "word " * 3000} if kind != "chat" else
                                                       {"messages": [{"role": "user", "content": "word " * 3000}]})
                                 }).encode())


def cases(edge: str, n: int, seed: int) -> list[Case]:
    rng = random.Random(f"{seed}-{edge}")
    out = []
    for _ in range(n):
        kind = rng.choice(["completion", "chat"])
        r = rng.random()
        if r < 0.5:
            out.append(_field_case(rng, kind, edge))
        elif r < 0.8:
            out.append(_syntax_case(rng, kind))
        else:
            out.append(_transport_case(rng, kind, edge))
    # Bodies over the limit, with and without Content-Length: a few are enough.
    huge = json.dumps({"prompt": "x" * (MAX_BODY + 10), "max_tokens": 1}).encode()
    out.append(Case("huge body", body=huge))
    out.append(Case("huge chunked body", body=huge, chunked=True))
    return out


# ------------------------------------------------------------------ checks


def assert_error(status: int, ctype: str, raw: bytes, case: Case) -> None:
    if status == -1 and case.body is not None and len(case.body) > MAX_BODY:
        return  # connection closed after (or instead of) the 413
    assert 400 <= status < 500, (case.why, status, raw[:300])
    assert ctype.startswith("application/json"), (case.why, status, ctype, raw[:300])
    data = json.loads(raw)
    assert set(data) == {"error"}, (case.why, data)
    assert {"message", "type", "param", "code"} <= set(data["error"]) and data["error"]["message"], (case.why, data)


def assert_idle(urls: dict[str, str]) -> None:
    import time

    deadline = time.monotonic() + 5
    while True:
        stats = {role: _get(urls[role] + "/xpyd/stats") for role in ("prefill", "decode")}
        idle = all(s["waiting"] == s["running"] == s["transferring"] == 0 and s["blocks_used"] == 0
                   and s["kv_used_bytes"] == 0 and s.get("requests_held", 0) == 0 for s in stats.values())
        if idle:
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def assert_healthy(c: Cluster, urls: dict[str, str]) -> None:
    for p in c.procs:
        assert p.popen.poll() is None, f"{p.name} died:\n{p.tail()}"
        assert "Traceback" not in p.log.read_text(errors="replace"), f"{p.name}:\n{p.tail(80)}"
    assert_idle(urls)
    workers = _get(urls["proxy"] + "/cluster")["workers"]
    assert [w["health"] for w in workers] == ["up", "up"], workers  # client mistakes mark no worker down
    good = json.dumps({"prompt": "hello world", "max_tokens": 4, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json", "X-Request-Id": "client-chosen"}  # names the response
    status, _, raw = send(urls["proxy"], Case("good", body=good, headers=headers))
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 4 and json.loads(raw)["id"] == "cmpl-client-chosen"
    assert_idle(urls)


def test_proxy_edge_fuzz(cluster):
    c, urls = cluster
    for case in cases("proxy", CASES, SEED):
        # A client's own X-Request-Id only names the response (even one that looks like the workers' ids).
        if len(case.why) % 3 == 0:
            case.headers = {**case.headers, "X-Request-Id": "client-chosen~p~1.2.3.4:5"}
        assert_error(*send(urls["proxy"], case), case)
    assert_healthy(c, urls)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_edge_fuzz(cluster, role):
    c, urls = cluster
    rng = random.Random(f"{SEED}-rid-{role}")
    good_rid = lambda: str(RequestId.new(urls["prefill_signal"], urls["decode_signal"]))  # noqa: E731
    bad_rids = [None, "", "nope", "xpyd-zz~p~a:1~d~b:2", "xpyd-" + "0" * 32, "xpyd-" + "a" * 32 + "~p~h:0~d~h:1",
                "xpyd-" + "a" * 32 + "~p~h:1~d~h:99999", "xpyd-" + "A" * 32 + "~p~h:1~d~h:2",
                "xpyd-" + "a" * 32 + "~p~" + "h" * 600 + ":1~d~h:2", "xpyd-" + "a" * 32 + "~p~h:1~d~h:2~x",
                "xpyd-" + "a" * 32 + "~p~ h:1~d~h:2", "xpyd-" + "a" * 32 + "~p~[zz]:1~d~h:2"]
    good = json.dumps({"prompt": "hello world", "max_tokens": 2, "temperature": 0}).encode()
    for case in cases(role, CASES, SEED):
        case.headers = {**case.headers, "X-Request-Id": good_rid()}
        assert_error(*send(urls[role], case), case)
        # The same request id problems with an otherwise good body.
        rid = rng.choice(bad_rids)
        headers = {"Content-Type": "application/json", **({} if rid is None else {"X-Request-Id": rid})}
        bad = Case(f"request id {rid!r}", body=good, headers=headers)
        status, ctype, raw = send(urls[role], bad)
        assert_error(status, ctype, raw, bad)
        assert status == 400 and "X-Request-Id" in json.loads(raw)["error"]["message"], raw
        if rid is not None:  # the proxy's abort call checks the id the same way
            status, ctype, raw = send(urls[role], Case("abort", path="/xpyd/abort", body=b"",
                                                       headers={"X-Request-Id": rid}))
            assert_error(status, ctype, raw, bad)
    rid = good_rid()  # aborting a request the worker does not know changes nothing
    status, _, raw = send(urls[role], Case("abort", path="/xpyd/abort", body=b"", headers={"X-Request-Id": rid}))
    assert status == 200 and json.loads(raw) == {"aborted": rid}
    assert_healthy(c, urls)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_refuses_a_bad_response_name(cluster, role):
    """What the proxy tells a worker to call its response (kv_transfer_params.response) is checked:
    a 400 OpenAI error naming the field, before the request goes anywhere."""
    c, urls = cluster
    good = {"id": "cmpl-abc", "created": 1_700_000_000, "model": "served"}
    bad = [("x", "response"), ({**good, "id": "a b"}, "response.id"), ({**good, "id": "i" * 257}, "response.id"),
           ({**good, "created": "now"}, "response.created"), ({**good, "created": 2**40}, "response.created"),
           ({**good, "created": False}, "response.created"), ({**good, "model": 7}, "response.model"),
           ({**good, "model": "m" * 1025}, "response.model"), ({"id": "x", "created": 1}, "response.model")]
    rid = str(RequestId.new(urls["prefill_signal"], urls["decode_signal"]))
    for stream in (False, True):
        for response, field_name in bad:
            body = {"prompt": "hello world", "max_tokens": 2, "stream": stream,
                    "kv_transfer_params": {"role": role, "response": response}}
            case = Case(f"response {response!r}", body=json.dumps(body).encode(),
                        headers={"Content-Type": "application/json", "X-Request-Id": rid})
            status, ctype, raw = send(urls[role], case)
            assert_error(status, ctype, raw, case)
            error = json.loads(raw)["error"]
            assert status == 400 and error["param"] == f"kv_transfer_params.{field_name}", (case.why, error)
    assert_healthy(c, urls)


def _stream_events(url: str, body: dict) -> list[dict | str]:
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        raw = r.read()
    assert raw.endswith(b"\n\n")
    events = []
    for event in raw[:-2].split(b"\n\n"):
        assert event.startswith(b"data: "), event
        events.append("[DONE]" if event == b"data: [DONE]" else json.loads(event[6:]))
    return events


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_stream_is_one_response_from_its_first_chunk_to_done(cluster, kind):
    """The proxy's own chunks (chat role, prefill's token) and decode's, relayed: one id, created and
    model; the role chunk first; usage only if asked; [DONE] last; the text is the JSON answer's."""
    _, urls = cluster
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True,
            **({"messages": [{"role": "user", "content": "hello there"}]} if kind == "chat" else
               {"prompt": "hello there"})}
    status, _, raw = send(urls["proxy"], Case("json", path=path, body=json.dumps(body).encode()))
    assert status == 200, raw
    answer = json.loads(raw)
    for include_usage in (True, False):
        events = _stream_events(urls["proxy"] + path, {**body, "stream_options": {"include_usage": include_usage}})
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert len({(c["id"], c["created"], c["model"], c["object"]) for c in chunks}) == 1, chunks
        assert chunks[0]["id"].startswith("chatcmpl-" if kind == "chat" else "cmpl-")
        assert chunks[0]["model"] == answer["model"]
        if include_usage:
            usage = chunks.pop()
            # the same prompt again: its full blocks come from the prefix cache (all but the last token's)
            cached = (answer["usage"]["prompt_tokens"] - 1) // BLOCK * BLOCK
            assert usage["choices"] == [] and usage["usage"] == {**answer["usage"],
                                                                 "prompt_tokens_details": {"cached_tokens": cached}}
        assert all("usage" not in c and len(c["choices"]) == 1 for c in chunks)
        if kind == "chat":
            assert chunks.pop(0)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert all("role" not in c["choices"][0]["delta"] for c in chunks)
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            assert text == answer["choices"][0]["message"]["content"]
        else:
            assert "".join(c["choices"][0]["text"] for c in chunks) == answer["choices"][0]["text"]
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_openai_client_stream_equals_the_json_answer(cluster):
    import openai

    _, urls = cluster
    client = openai.OpenAI(base_url=urls["proxy"] + "/v1", api_key="unused", timeout=60, max_retries=0)
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "Tell me about the sea."}]
    kw = {"model": model, "messages": msgs, "max_tokens": 16, "temperature": 0, "extra_body": {"ignore_eos": True}}
    answer = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
        answer.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-2].choices[0].finish_reason == "length"
    assert len({ch.id for ch in chunks}) == 1 and chunks[0].model == model


def test_the_client_sees_the_public_id_and_no_internal_address(cluster):
    """As a user of the official client reads an answer of real workers: X-Request-Id is the response's id
    (the client's own when it sent one, as vLLM does), and no worker address or workers' request id is in
    any header or body, nor in a worker's own error passed on."""
    import openai

    _, urls = cluster
    internal = [urls[k] for k in ("prefill", "decode", "prefill_signal", "decode_signal")]
    internal += [u.removeprefix("http://") for u in internal] + ["xpyd-", "~p~"]

    def leaks(raw, body: str) -> list[str]:
        seen = json.dumps(dict(raw.headers)) + body
        return [name for name in internal if name in seen]

    client = openai.OpenAI(base_url=urls["proxy"] + "/v1", api_key="unused", timeout=60, max_retries=0)
    model = client.models.list().data[0].id
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    answer = raw.parse()
    assert raw.headers["x-request-id"] == answer.id and answer.id.startswith("chatcmpl-")
    assert not leaks(raw, raw.http_response.text)
    raw = client.completions.with_raw_response.create(model=model, prompt="hello", max_tokens=4, stream=True,
                                                      extra_headers={"X-Request-Id": "edge-1"})
    chunks = list(raw.parse())
    assert raw.headers["x-request-id"] == "edge-1" and {ch.id for ch in chunks} == {"cmpl-edge-1"}
    assert len(chunks) == 4 and not leaks(raw, json.dumps([ch.model_dump() for ch in chunks]))
    with pytest.raises(openai.BadRequestError) as e:  # prefill's own 400: longer than the model's context
        client.completions.create(model=model, prompt="hello " * 300, max_tokens=4,
                                  extra_headers={"X-Request-Id": "edge-2"})
    response = e.value.response
    assert response.headers["x-request-id"] == "edge-2" and "maximum context length" in response.text
    assert not leaks(response, response.text)


def test_every_listening_socket_is_on_loopback(cluster):
    """Proxy, HTTP servers, the signal plane and the KV transfer listener: 127.0.0.1 unless told otherwise."""
    c, _ = cluster
    listening = _listening_sockets()
    for p in c.procs:
        pids = {p.popen.pid, *_children(p.popen.pid)}
        inodes = set()
        for pid in pids:
            try:
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
            except OSError:
                continue
        mine = [listening[i] for i in inodes if i in listening]
        expected = {"proxy": 1, "prefill": 2, "decode": 2}[p.name]  # HTTP + signal plane / KV transfer
        assert len(mine) >= expected, (p.name, mine)
        assert all(addr == "127.0.0.1" for addr, _ in mine), (p.name, mine)


def _listening_sockets() -> dict[str, tuple[str, int]]:
    """inode -> (address, port) of every TCP socket in LISTEN state (IPv4 and IPv6)."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            local, state, inode = parts[1], parts[3], parts[9]
            if state != "0A":
                continue
            addr_hex, port_hex = local.split(":")
            if len(addr_hex) == 8:
                addr = ".".join(str(b) for b in reversed(bytes.fromhex(addr_hex)))
            else:
                addr = "::" if set(addr_hex) == {"0"} else addr_hex
            out[inode] = (addr, int(port_hex, 16))
    return out


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
