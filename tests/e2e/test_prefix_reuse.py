"""KV reuse across requests on a real 1P1D cluster (SmolLM2-135M, float32): prompts that share a prefix
are answered from cached blocks on prefill (not computed again) and on decode (not moved again), with the
same tokens as a cold run and as transformers ``generate``, also while the small cache evicts; a
follow-up chat turn moves only the KV decode does not hold yet; requests with a ``cache_salt`` share
blocks only with the same salt. The cluster has a cluster token, so every block hash is keyed with it:
prefill, decode and the proxy must agree on the keyed names for any of this to hold."""

from __future__ import annotations

import concurrent.futures as cf
import copy
import json
import os
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import start_1p1d, wait_until
from xpyd.signal.request_id import ClusterKeys
from xpyd.worker.config import CLUSTER_TOKEN_ENV, WorkerConfig

MAX_MODEL_LEN = 512
CACHE_TOKENS = 1024  # 64 blocks of 16: a handful of these prompts fill it
BLOCK = WorkerConfig(role="prefill").block_size
NEW_TOKENS = 12
DOC = ("The river town kept its records in a stone tower by the bridge. Every spring the clerks climbed the "
       "stairs with new ledgers, and every autumn they carried the old ones down to the cellar, where the damp "
       "slowly turned the ink to a soft brown. Nobody remembered who had started the custom, but everyone "
       "agreed that it mattered, because the tower was the one place the floods had never reached. ") * 2


TOKEN = "prefix-reuse-cluster-token"
WORKER_AUTH = {"Authorization": f"Bearer {ClusterKeys(TOKEN).http_bearer}"}  # the workers' APIs require it


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smollm_dir: Path):
    saved = os.environ.get(CLUSTER_TOKEN_ENV)
    os.environ[CLUSTER_TOKEN_ENV] = TOKEN  # every process of the cluster takes it from its environment
    try:
        c, urls = start_1p1d(tmp_path_factory.mktemp("reuse"), str(smollm_dir), dtype="float32", batch_size=4,
                             max_model_len=MAX_MODEL_LEN, extra=["--kv-cache-tokens", str(CACHE_TOKENS)])
    finally:
        if saved is None:
            del os.environ[CLUSTER_TOKEN_ENV]
        else:
            os.environ[CLUSTER_TOKEN_ENV] = saved
    yield urls
    c.stop()


@pytest.fixture(scope="module")
def reference(smollm_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.numerics import decided_greedy
    from xpyd.model.tokenizer import encode_chat, encode_prompt

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(str(smollm_dir))
    model = AutoModelForCausalLM.from_pretrained(str(smollm_dir), dtype=torch.float32).eval()
    model64 = copy.deepcopy(model).double()  # every reference token is decided beyond float32 error

    def generate(prompt=None, messages=None, max_tokens=NEW_TOKENS) -> tuple[list[int], str]:
        ids = encode_chat(tok, messages) if messages is not None else encode_prompt(tok, prompt)
        new = decided_greedy(model, model64, ids, max_tokens)
        return ids, tok.decode(new, skip_special_tokens=True)

    return generate


@pytest.fixture(scope="module")
def background():
    """One thread of this process for the references: a test starts computing what it expects, then sends
    the same requests through the cluster while it runs (the workers run one thread each, and while decode
    steps run, the other core is free). Tests wait for a result before comparing with it."""
    with cf.ThreadPoolExecutor(1, thread_name_prefix="reference") as ex:
        yield ex


def post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        return json.loads(r.read())


def stats(url: str) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url + "/xpyd/stats", headers=WORKER_AUTH), timeout=5) as r:
        return json.loads(r.read())


def recv_bytes(url: str) -> float:
    with urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers=WORKER_AUTH), timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith('xpyd_kv_transfer_bytes_total{') and 'direction="recv"' in line:
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no recv byte counter")


def complete(urls, prompt: str) -> dict:
    return post(urls["proxy"], "/v1/completions", {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0})


def test_shared_prefixes_are_reused_on_both_roles_with_the_same_tokens(cluster, reference, background):
    a, b = DOC + "Question: who kept the records?", DOC + "Question: what happened every spring?"
    expected_a, expected_b = background.submit(reference, prompt=a), background.submit(reference, prompt=b)
    before = stats(cluster["decode"])

    first = complete(cluster, a)
    (ids_a, want_a), (ids_b, want_b) = expected_a.result(), expected_b.result()
    shared = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y)  # tokens the two prompts share
    assert shared >= 4 * BLOCK
    assert first["choices"][0]["text"] == want_a
    assert first["usage"]["prompt_tokens"] == len(ids_a)
    second = complete(cluster, b)  # its shared full blocks come from both caches
    assert second["choices"][0]["text"] == want_b
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == shared // BLOCK * BLOCK
    again = complete(cluster, a)  # all of it but the last token's block
    assert again["choices"][0]["text"] == want_a
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(ids_a) - 1) // BLOCK * BLOCK

    after = stats(cluster["decode"])
    reused = after["kv_reused_blocks"] - before["kv_reused_blocks"]
    assert reused == shared // BLOCK + len(ids_a) // BLOCK  # decode pulled none of the blocks it held
    for url in (cluster["prefill"], cluster["decode"]):
        wait_until(lambda: _freed(stats(url)), 10, f"{url}: every request's blocks freed")
        assert stats(url)["blocks_cached"] > 0


def test_cache_salt_shares_blocks_only_within_one_salt(cluster, reference, background):
    """The same prompt without a salt, then as "alice", as "bob", and as "alice" again: only the last finds
    blocks (all of its full ones, on prefill and on decode); the salted ones before it find none, though
    the unsalted prompt's blocks are cached on both roles. Every answer has the reference's tokens."""
    prompt = DOC + "Question: who may read the ledgers?"
    expected = background.submit(reference, prompt=prompt)

    def send(salt: str | None) -> tuple[dict, int]:
        """The answer, and how many prompt blocks decode found in its cache instead of pulling them."""
        before = stats(cluster["decode"])["kv_reused_blocks"]
        body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
        answer = post(cluster["proxy"], "/v1/completions", body if salt is None else {**body, "cache_salt": salt})
        wait_until(lambda: _freed(stats(cluster["decode"])), 10, "decode freed the request's blocks")
        return answer, stats(cluster["decode"])["kv_reused_blocks"] - before

    plain, _ = send(None)
    first_alice, alice_reused = send("alice")
    bob, bob_reused = send("bob")
    again_alice, again_reused = send("alice")
    ids, want = expected.result()
    assert [r["choices"][0]["text"] for r in (plain, first_alice, bob, again_alice)] == [want] * 4
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first_alice, bob, again_alice)]
    assert cached == [0, 0, (len(ids) - 1) // BLOCK * BLOCK]
    assert (alice_reused, bob_reused, again_reused) == (0, 0, len(ids) // BLOCK)


def _freed(s: dict) -> bool:
    return s["blocks_used"] == 0


def test_a_cache_over_capacity_evicts_and_answers_stay_exact(cluster, reference, background):
    prompts = [f"Story {i}: " + DOC[i * 7:] + f" Chapter {i} begins" for i in range(6)]  # ~6 x 180 tokens
    wants = [background.submit(reference, prompt=p) for p in prompts]
    # the second round finds some of the first's blocks and recomputes the evicted ones (the answers are
    # compared once all are in: the cluster serves them one after another while the references compute)
    answers = [complete(cluster, prompt)["choices"][0]["text"] for _ in range(2) for prompt in prompts]
    assert answers == [want.result()[1] for want in wants] * 2
    for url in (cluster["prefill"], cluster["decode"]):
        # (the client has its answer a moment before each worker frees the request's blocks: wait for it)
        wait_until(lambda: _freed(stats(url)), 10, f"{url}: every request's blocks freed")
        s = stats(url)
        assert s["blocks_cached"] <= s["blocks_total"] == CACHE_TOKENS // BLOCK
    p = stats(cluster["prefill"])
    assert 0 < p["prefix_hit_tokens"] < p["prefix_query_tokens"]


def test_a_follow_up_turn_moves_only_the_kv_decode_does_not_hold(cluster, reference, background, smollm_dir):
    from xpyd.model.runner import kv_token_bytes

    import torch

    token_bytes = kv_token_bytes(smollm_dir, torch.float32)
    turn1 = [{"role": "user", "content": DOC + "Summarise this in one sentence."}]
    expected1 = background.submit(reference, messages=turn1, max_tokens=24)
    body = {"messages": turn1, "max_tokens": 24, "temperature": 0}
    r1 = post(cluster["proxy"], "/v1/chat/completions", body)
    answer = r1["choices"][0]["message"]["content"]
    ids1, want1 = expected1.result()
    assert answer == want1
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why the tower?"}]
    expected2 = background.submit(reference, messages=turn2)
    held = len(ids1) + r1["usage"]["completion_tokens"] - 1  # decode wrote the KV of all but its last token
    before = recv_bytes(cluster["decode"])
    r2 = post(cluster["proxy"], "/v1/chat/completions", {"messages": turn2, "max_tokens": NEW_TOKENS, "temperature": 0})
    ids2, want2 = expected2.result()
    assert ids2[: len(ids1)] == ids1
    assert r2["choices"][0]["message"]["content"] == want2
    moved = recv_bytes(cluster["decode"]) - before
    new_tokens = len(ids2) - held
    # whole blocks move: the new tokens, the partly held block before them and the last block's padding
    assert 0 < moved <= (new_tokens + 2 * BLOCK - 2) * token_bytes, (moved / token_bytes, new_tokens)
    assert moved < len(ids2) * token_bytes / 2  # far less than the whole prompt
