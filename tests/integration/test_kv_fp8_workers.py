"""Quantized KV (`--kv-cache-dtype fp8_e4m3 | int8`) through real worker processes: a prefill worker's quantized
KV moved to a decode worker gives the tokens of a colocated worker with the same KV dtype (the same codes both
ways, so the same numbers), and a decode worker of another KV dtype is refused at the handshake, saying why."""

from __future__ import annotations

import json
import urllib.error

import pytest
import urllib.request
from pathlib import Path

from tests.cluster import Cluster, free_port, start_1p1d, wait_until

PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog and then", "one two three four five six",
           # (~70 tokens: the P/D prefill worker computes it in chunks of 8, the colocated worker whole)
           " ".join(f"step {i} of the plan is to count the {w}s" for i, w in enumerate(["apple", "cloud", "river",
                                                                                       "stone", "bird", "lamp"]))]
FP8 = ["--kv-cache-dtype", "fp8_e4m3"]


def _complete(url: str, prompt: str, n: int) -> tuple[int, dict]:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _colocated(workdir: Path, model: Path, extra: list[str], wait: bool = True) -> tuple[Cluster, str]:
    """A colocated worker and its proxy (``wait``: until both are healthy; else the caller waits)."""
    c = Cluster(workdir)
    wp, xp = free_port(), free_port()
    worker, proxy = f"http://127.0.0.1:{wp}", f"http://127.0.0.1:{xp}"
    c.start("colocated", ["colocated", "--model", str(model), "--dtype", "bfloat16", "--threads", "1",
                          "--max-model-len", "256", "--batch-size", "4", "--port", str(wp), *extra], worker)
    try:
        # (the proxy serves, and answers /health, once the worker answered its /xpyd/info)
        c.start("proxy", ["proxy", "--port", str(xp), "--colocated", worker], proxy)
        if wait:
            c.wait_healthy()
    except BaseException:
        c.stop()
        raise
    return c, proxy


def _texts(proxy: str, n: int, prompt_tokens: list[int] | None = None) -> list[str]:
    out = []
    for prompt in PROMPTS:  # one at a time: the same batch shapes on both sides
        status, body = _complete(proxy, prompt, n)
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == n
        out.append(body["choices"][0]["text"])
        if prompt_tokens is not None:
            prompt_tokens.append(body["usage"]["prompt_tokens"])
    return out


def _received_bytes(decode: str) -> float:
    text = urllib.request.urlopen(decode + "/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("xpyd_kv_transfer_bytes_total") and 'direction="recv"' in line)


@pytest.mark.parametrize("kv,row_bytes", [("fp8_e4m3", 16), ("int8", 16 + 2)])
def test_quantized_prefill_to_decode_gives_the_colocated_tokens(tmp_path: Path, tiny_model_dir: Path, kv: str,
                                                                 row_bytes: int):
    (tmp_path / "pd").mkdir()
    (tmp_path / "co").mkdir()
    # the prompts' KV moved as codes, 1 byte per value (int8: and each row's 2-byte scale; the tiny model:
    # 2 layers x K/V x 2 heads of 16 values)
    _pd_against_colocated(tmp_path, tiny_model_dir, ["--kv-cache-dtype", kv], 2 * 2 * 2 * row_bytes)


def _pd_against_colocated(tmp_path: Path, model: Path, flags: list[str], token_bytes: int,
                          prefill_chunk: int | None = 8) -> None:
    """1P1D with ``flags`` answers the prompts as a colocated worker with them does, and the decode worker received
    ``token_bytes`` a token of the prompts' blocks. With ``prefill_chunk`` the prefill worker computes prompts in
    chunks of that many tokens and the colocated worker whole: the lean forward in bfloat16 gives the same bits
    either way (the prefill attention's arithmetic does not depend on where a chunk starts). (The colocated worker
    starts with the 1P1D cluster; the prompts go to one, then the other.)"""
    colocated, proxy = _colocated(tmp_path / "co", model, flags, wait=False)
    try:
        cluster, urls = start_1p1d(tmp_path / "pd", str(model), dtype="bfloat16", max_model_len=256, extra=flags,
                                   prefill_extra=[] if prefill_chunk is None else ["--prefill-chunk", str(prefill_chunk)])
        try:
            prompt_tokens: list[int] = []
            pd = _texts(urls["proxy"], 12, prompt_tokens)
            blocks = sum(-(-n // 16) for n in prompt_tokens)
            assert _received_bytes(urls["decode"]) == blocks * 16 * token_bytes
        finally:
            cluster.stop()
        colocated.wait_healthy()
        co = _texts(proxy, 12)
    finally:
        colocated.stop()
    assert pd == co
    assert any(pd)


def test_a_decode_worker_of_another_kv_dtype_is_refused(tmp_path: Path, tiny_model_dir: Path):
    cluster, urls = start_1p1d(tmp_path, str(tiny_model_dir), dtype="bfloat16", max_model_len=256,
                               prefill_extra=FP8)
    try:
        _complete(urls["proxy"], PROMPTS[0], 4)  # (the proxy moves it on from the failed pair: its answer aside)
        decode, proxy = (next(p for p in cluster.procs if p.name == name) for name in ("decode", "proxy"))
        wait_until(lambda: "KV cache dtype mismatch" in decode.log.read_text(errors="replace"), 30,
                   "the decode worker logs the refusal")
        line = next(l for l in decode.log.read_text(errors="replace").splitlines() if "KV cache dtype mismatch" in l)
        assert "prefill fp8_e4m3 with scales pow2:" in line and "decode bfloat16" in line, line
        assert "avoiding the pair" in proxy.log.read_text(errors="replace")  # no KV of the other dtype moved
    finally:
        cluster.stop()


@pytest.mark.parametrize("kv,token_bytes", [("fp8_e4m3", 11_520), ("int8", 11_520 + 30 * 2 * 3 * 2)])
def test_a_sim_worker_under_a_quantized_kv_moves_one_byte_per_value(tmp_path: Path, smollm_dir: Path, kv: str,
                                                                   token_bytes: int):
    """`--engine sim` has no KV values to quantize, but sizes its pool (and so its transfers) at the quantized
    bytes per token: the model's real 16-bit size, halved (int8: plus a 2-byte scale per row, 30 layers x K/V x
    3 KV heads)."""
    c = Cluster(tmp_path)
    port = free_port()
    c.start("colocated", ["colocated", "--model", str(smollm_dir), "--engine", "sim", "--sim-speedup", "inf",
                          "--threads", "1", "--max-model-len", "256", "--port", str(port), "--kv-cache-dtype", kv],
            f"http://127.0.0.1:{port}")
    try:
        c.wait_healthy()
        log = c.procs[0].log.read_text(errors="replace")
        assert f"x 16 tokens x {token_bytes} bytes" in log, log  # SmolLM2-135M: 23,040 bytes per token at 16 bits
    finally:
        c.stop()
