"""--kv-backend end to end: one prefill worker (auto) serving a tcp decode worker and an auto (shm) one.

Real worker processes with the tiny random Llama in float32: both decode workers must produce exactly
the tokens of each other (so shm moved the same KV bytes as tcp), the auto pair must have used shared
memory (the prefill pool in a segment, the decode pool in ordinary memory), and the segment must be
gone after a clean stop.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port
from xpyd.signal.request_id import RequestId


def _post(url: str, body: dict, rid: str) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "X-Request-Id": rid})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _info(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/xpyd/info", timeout=5).read())


def _stats(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/xpyd/stats", timeout=5).read())


def _segments(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"xpyd-kv-{pid}-")]


def _generate(prefill: str, signal: str, decode: str, prompt: str, n: int) -> list[int]:
    rid = str(RequestId.new(signal, _info(decode)["signal_addr"]))
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("d", _post(decode, {**body, "kv_transfer_params":
                                                                          {"role": "decode"}}, rid)))
    t.start()
    out["p"] = _post(prefill, {**body, "max_tokens": 1, "kv_transfer_params": {"role": "prefill",
                                                                               "max_tokens": n}}, rid)
    t.join(60)
    d = out["d"]
    assert d["usage"]["completion_tokens"] == n, d
    return [out["p"]["choices"][0]["text"], d["choices"][0]["text"]]


def test_shm_and_tcp_decode_give_the_same_tokens(tmp_path: Path, tiny_model_dir: Path):
    c = Cluster(tmp_path)
    common = ["--model", str(tiny_model_dir), "--dtype", "float32", "--threads", "1", "--max-model-len", "256",
              "--batch-size", "2"]
    pp, ps = free_port(), free_port()
    prefill, signal = f"http://127.0.0.1:{pp}", f"127.0.0.1:{ps}"
    pproc = c.start("prefill", ["prefill", *common, "--port", str(pp), "--signal-port", str(ps),
                                "--kv-backend", "auto"], prefill)
    decodes = {}
    for kind in ("tcp", "auto"):
        port = free_port()
        decodes[kind] = (f"http://127.0.0.1:{port}",
                         c.start(f"decode-{kind}", ["decode", *common, "--port", str(port), "--kv-port",
                                                    str(free_port()), "--kv-backend", kind],
                                 f"http://127.0.0.1:{port}"))
    try:
        c.wait_healthy()
        assert _segments(pproc.popen.pid)  # the sender's pool lives in shared memory
        for _, proc in decodes.values():  # receivers copy into ordinary memory
            assert _segments(proc.popen.pid) == []
        prompt = "The quick brown fox jumps over the lazy dog, and then it"
        via_tcp = _generate(prefill, signal, decodes["tcp"][0], prompt, 12)
        via_shm = _generate(prefill, signal, decodes["auto"][0], prompt, 12)
        assert via_shm == via_tcp and via_tcp[1]
        log = pproc.log.read_text(errors="replace")
        assert log.count("shm transfer: connected to") == 1  # the auto decode worker, and only it
        # /xpyd/stats says which part of auto carried each transfer
        # (and how many frames that tried to open a transfer their listeners refused, how many connections
        # they closed before any opened one: none here)
        assert _stats(prefill)["kv_backend"] == {"name": "auto", "sent": {"tcp": 1, "shm": 1}, "received": {},
                                                 "refused": 0, "unproven": 0}
        assert _stats(decodes["auto"][0])["kv_backend"] == {"name": "auto", "sent": {}, "received": {"shm": 1},
                                                           "refused": 0, "unproven": 0}
        assert _stats(decodes["tcp"][0])["kv_backend"] == {"name": "tcp", "refused": 0, "unproven": 0}
    finally:
        c.stop()
    pids = [pproc.popen.pid] + [p.popen.pid for _, p in decodes.values()]
    assert [s for pid in pids for s in _segments(pid)] == []  # unlinked on a clean exit


def _pair_tokens(tmp_path: Path, model: Path, kind: str, prompt: str, n: int) -> tuple[list[str], str]:
    """Start a prefill and a decode worker with ``--kv-backend kind``, generate once, stop; (tokens, prefill log).
    The prefill worker computes 8 tokens a chunk: a longer prompt's KV streams in parts over ``kind``."""
    (tmp_path / kind).mkdir()
    c = Cluster(tmp_path / kind)
    common = ["--model", str(model), "--dtype", "float32", "--threads", "1", "--max-model-len", "256",
              "--batch-size", "2", "--kv-backend", kind]
    pp, ps, dp = free_port(), free_port(), free_port()
    prefill, signal, decode = f"http://127.0.0.1:{pp}", f"127.0.0.1:{ps}", f"http://127.0.0.1:{dp}"
    pproc = c.start("prefill", ["prefill", *common, "--prefill-chunk", "8", "--port", str(pp), "--signal-port", str(ps)],
                    prefill)
    c.start("decode", ["decode", *common, "--port", str(dp), "--kv-port", str(free_port())], decode)
    try:
        c.wait_healthy()
        return _generate(prefill, signal, decode, prompt, n), pproc.log.read_text(errors="replace")
    finally:
        c.stop()


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None,
                    reason="NIXL is not installed (pip install --no-deps nixl nixl-cu13)")
def test_nixl_pair_gives_the_tokens_of_a_tcp_pair(tmp_path: Path, tiny_model_dir: Path):
    prompt = "The quick brown fox jumps over the lazy dog, and then it"
    via_nixl, log = _pair_tokens(tmp_path, tiny_model_dir, "nixl", prompt, 12)
    assert log.count("nixl transfer: connected to") == 1  # the KV really moved by NIXL READ
    via_tcp, _ = _pair_tokens(tmp_path, tiny_model_dir, "tcp", prompt, 12)
    assert via_nixl == via_tcp and via_tcp[1]
