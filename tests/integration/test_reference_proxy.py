"""scripts/reference_proxy.py (the reference design's proxy that xpyd proxy is measured against) serves through
real sim workers: the same tokens as xpyd proxy in front of the same 1P1D pair, streamed and as one JSON body,
completions and chat."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, Proc, free_port
from xpyd.child import die_with_parent

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is 2 + 2?"}]


def _post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        return r.read()


def _stream_text(raw: bytes, chat: bool) -> tuple[str, dict | None, bool]:
    """The streamed text, the last usage chunk and whether it ended with [DONE]."""
    text, usage, done = [], None, False
    for event in raw.split(b"\n\n"):
        data = event.removeprefix(b"data: ").strip()
        if not data:
            continue
        if data == b"[DONE]":
            done = True
            continue
        obj = json.loads(data)
        usage = obj.get("usage") or usage
        for c in obj["choices"]:
            text.append(((c.get("delta") or {}).get("content") or "") if chat else c["text"])
    return "".join(text), usage, done


@pytest.fixture(scope="module")
def proxies(tmp_path_factory, smollm_dir: Path):
    """A 1P1D sim pair (no cluster token) with xpyd proxy and the reference proxy in front of it."""
    work = tmp_path_factory.mktemp("reference-proxy")
    c = Cluster(work)
    options = ["--model", str(smollm_dir), "--engine", "sim", "--sim-speedup", "inf", "--served-model-name", "m",
               "--threads", "1", "--batch-size", "4", "--max-model-len", "256"]
    pp, ps, dp, dk, xp, rp = (free_port() for _ in range(6))
    urls = {"prefill": f"http://127.0.0.1:{pp}", "decode": f"http://127.0.0.1:{dp}",
            "xpyd": f"http://127.0.0.1:{xp}", "reference": f"http://127.0.0.1:{rp}"}
    try:
        c.start("prefill", ["prefill", *options, "--port", str(pp), "--signal-port", str(ps)], urls["prefill"])
        c.start("decode", ["decode", *options, "--port", str(dp), "--kv-port", str(dk)], urls["decode"])
        # (both proxies start with the workers: each serves, and answers /health, once the workers answered
        # their /xpyd/info)
        c.start("xpyd", ["proxy", "--port", str(xp), "--prefill", urls["prefill"], "--decode", urls["decode"]],
                urls["xpyd"])
        log = work / "reference.log"
        popen = subprocess.Popen(
            [sys.executable, str(ROOT / "scripts/reference_proxy.py"), "--port", str(rp),
             "--prefill", urls["prefill"], "--decode", urls["decode"]],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True, preexec_fn=die_with_parent)
        c.procs.append(Proc("reference", popen, log, urls["reference"]))
        c.wait_healthy()
    except BaseException:
        c.stop()
        raise
    yield urls
    c.stop()


def test_reference_proxy_streams_the_tokens_xpyd_proxy_does(proxies):
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    ref_text, ref_usage, ref_done = _stream_text(_post(proxies["reference"] + "/v1/completions", body), False)
    xpyd_text, xpyd_usage, xpyd_done = _stream_text(_post(proxies["xpyd"] + "/v1/completions", body), False)
    assert ref_done and xpyd_done
    assert ref_text == xpyd_text and ref_text != ""
    assert ref_usage["completion_tokens"] == xpyd_usage["completion_tokens"] == 12
    # and as one JSON body
    whole = json.loads(_post(proxies["reference"] + "/v1/completions", {**body, "stream": False}))
    assert whole["choices"][0]["text"] == xpyd_text
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 12


def test_reference_proxy_serves_chat_like_xpyd_proxy(proxies):
    body = {"model": "m", "messages": CHAT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    ref = json.loads(_post(proxies["reference"] + "/v1/chat/completions", body))
    mine = json.loads(_post(proxies["xpyd"] + "/v1/chat/completions", body))
    assert ref["choices"][0]["message"]["content"] == mine["choices"][0]["message"]["content"] != ""
    assert ref["usage"]["completion_tokens"] == 6
    streamed, _, done = _stream_text(_post(proxies["reference"] + "/v1/chat/completions", {**body, "stream": True}),
                                     True)
    assert done and streamed == mine["choices"][0]["message"]["content"]


def test_reference_proxy_ends_a_one_token_request_on_prefill(proxies):
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "ignore_eos": True, "stream": True}
    text, _, done = _stream_text(_post(proxies["reference"] + "/v1/completions", body), False)
    whole = json.loads(_post(proxies["xpyd"] + "/v1/completions", {**body, "stream": False}))
    assert done and text == whole["choices"][0]["text"] != ""
