"""What the families' cluster tests (tests/e2e/test_families_pd*.py) run for each model family (tests/families.py:
tiny random models with the SmolLM2 tokenizer; Gemma's with sliding windows shorter than the prompts) served by
real processes, float32: a 1P1D cluster behind its proxy, and a colocated worker behind its own. Prompts are
computed in chunks of 16 on prefill; the second prompt shares the first one's leading blocks, so it is answered
from the prefix cache (``cached_tokens``). Every answer is transformers ``generate``'s text, and the decode worker
received whole blocks of the family's KV bytes per token (DeepSeek's: one latent per token and layer)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.cluster import Cluster, free_port
from tests.families import float64_copy, save_tiny

MAX_MODEL_LEN = 256
NEW_TOKENS = 12
BLOCK = 16
DOC = ("The river town kept its records in a stone tower by the bridge. Every spring the clerks climbed the "
       "stairs with new ledgers, and every autumn they carried the old ones down to the cellar. ")
PROMPTS = [DOC + "Question: who kept the records?", DOC + "Question: what happened every spring?"]


def serve(family: str, tmp_path_factory, smollm_dir: Path) -> Iterator[tuple]:
    """(family, model folder, {"pd": proxy URL, "colocated": proxy URL}, decode worker URL) with every process
    started (the module fixture of each test file yields from this)."""
    import torch
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp(f"{family}-model")
    tokenizer = AutoTokenizer.from_pretrained(str(smollm_dir))
    torch.manual_seed(0)
    save_tiny(family, folder, len(tokenizer), max_positions=MAX_MODEL_LEN, tokenizer=tokenizer)
    c = Cluster(tmp_path_factory.mktemp(family))
    common = ["--model", str(folder), "--dtype", "float32", "--threads", "1", "--batch-size", "2",
              "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK)]
    pp, ps, dp, dk, cp, xp, yp = (free_port() for _ in range(7))
    url = lambda port: f"http://127.0.0.1:{port}"
    try:
        c.start("prefill", ["prefill", *common, "--prefill-chunk", "16", "--port", str(pp), "--signal-port", str(ps)],
                url(pp))
        c.start("decode", ["decode", *common, "--port", str(dp), "--kv-port", str(dk)], url(dp))
        c.start("colocated", ["colocated", *common, "--port", str(cp)], url(cp))
        # (the proxies start with the workers: each serves, and answers /health, only once its workers answered
        # their /xpyd/info)
        c.start("proxy", ["proxy", "--port", str(xp), "--prefill", url(pp), "--decode", url(dp)], url(xp))
        c.start("colocated-proxy", ["proxy", "--port", str(yp), "--colocated", url(cp)], url(yp))
        c.wait_healthy()
    except BaseException:
        c.stop()
        raise
    yield family, folder, {"pd": url(xp), "colocated": url(yp)}, url(dp)
    c.stop()


def _reference(folder: Path, prompt: str) -> tuple[int, str]:
    """(prompt tokens, transformers' greedy text), every token decided beyond float32 error."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.numerics import decided_greedy
    from xpyd.model.tokenizer import encode_prompt

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = encode_prompt(tok, prompt)
    return len(ids), tok.decode(decided_greedy(model, float64_copy(model), ids, NEW_TOKENS), skip_special_tokens=True)


def _complete(url: str, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{url}: {e.code} {e.read()[:500]!r}") from None


def _kv_bytes_received(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "xpyd_kv_transfer_bytes_total" and s.labels.get("direction") == "recv")


def check_answers(served) -> None:
    """Every answer is generate's, the second from the prefix cache; the decode worker got whole blocks."""
    import torch

    from xpyd.model.runner import kv_token_bytes

    family, folder, urls, decode_url = served
    expected = [_reference(folder, p) for p in PROMPTS]
    for kind, url in urls.items():
        for i, (prompt, (length, text)) in enumerate(zip(PROMPTS, expected)):
            answer = _complete(url, prompt)
            assert answer["choices"][0]["text"] == text, f"{family}, {kind}, prompt {i}"
            assert answer["usage"]["prompt_tokens"] == length
            cached = answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
            if i == 1:  # the shared leading blocks came from the cache
                assert cached >= 2 * BLOCK, f"{family}, {kind}: {answer['usage']}"
    # whole blocks of the family's KV moved to the decode worker: all of the first prompt's, at most the second's
    block_bytes = BLOCK * kv_token_bytes(folder, torch.float32)
    blocks = [-(-length // BLOCK) for length, _ in expected]
    received = _kv_bytes_received(decode_url)
    assert received % block_bytes == 0 and blocks[0] <= received / block_bytes <= sum(blocks), (family, received)
