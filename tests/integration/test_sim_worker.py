"""`--engine sim` workers started for real: light processes (no torch, no transformers, a bounded PSS), the same
tokens through a 1P1D cluster as from a colocated sim worker, and a tokenizer the proxy routes by.

Every worker runs with ``--sim-speedup inf`` (no simulated time) and a small profile written here; KV moves over
tcp (the prefill's pool in process memory) or shm (in a shared segment: `shared_pool_memory`).
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port

PSS_LIMIT_KB = 100 * 1024  # the bound on a simulated worker's proportional set size
PROFILE = {
    "format": "xpyd-sim-profile/1", "model": "test", "machine": "test", "dtype": "float32", "threads": 1,
    "created": "2026-01-01T00:00:00Z",
    "prefill": {"new_tokens": [1, 1024], "cached_tokens": [0, 1024], "seconds": [[0.001, 0.001], [0.01, 0.01]]},
    "decode": {"batch": [1, 8], "context_tokens": [1, 4096], "seconds": [[0.001, 0.002], [0.002, 0.003]]},
}
PROMPTS = ["hello world", "The capital of France is", "Héllo wörld 🙂 " * 9, "a b c d e f g h i j k l m n o p " * 4]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
IMPORTED = re.compile(r"^import time:.*\|\s+(torch|transformers)(\.|$)", re.M)  # PYTHONPROFILEIMPORTTIME lines


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{url}: {e.code} {e.read()[:500]!r}") from None


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def sim_options(tmp_path_factory, smollm_dir: Path) -> list[str]:
    profile = tmp_path_factory.mktemp("sim-profile") / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    return ["--model", str(smollm_dir), "--engine", "sim", "--sim-profile", str(profile), "--sim-speedup", "inf",
            "--threads", "1", "--batch-size", "4", "--max-model-len", "512", "--block-size", "16"]


def _start_pd(c: Cluster, options: list[str], backend: str, prefills: int = 1) -> dict[str, str]:
    """``prefills`` prefill workers, one decode worker (imports logged: PYTHONPROFILEIMPORTTIME) and a static
    proxy in front of them; their URLs."""
    urls = {}
    env = {"PYTHONPROFILEIMPORTTIME": "1"}
    for i in range(prefills):
        port, signal = free_port(), free_port()
        urls[f"prefill{i}"] = f"http://127.0.0.1:{port}"
        c.start(f"prefill{i}", ["prefill", *options, "--kv-backend", backend, "--port", str(port),
                                "--signal-port", str(signal)], urls[f"prefill{i}"], env=env)
    dp, dk, xp = free_port(), free_port(), free_port()
    urls["decode"] = f"http://127.0.0.1:{dp}"
    c.start("decode", ["decode", *options, "--kv-backend", backend, "--port", str(dp), "--kv-port", str(dk)],
            urls["decode"], env=env)
    c.wait_healthy()
    urls["proxy"] = f"http://127.0.0.1:{xp}"
    prefill_urls = [a for i in range(prefills) for a in ("--prefill", urls[f"prefill{i}"])]
    c.start("proxy", ["proxy", "--port", str(xp), *prefill_urls, "--decode", urls["decode"]], urls["proxy"])
    c.wait_healthy()
    return urls


@pytest.fixture(scope="module")
def clusters(tmp_path_factory, sim_options):
    """A 1P1D sim cluster (tcp KV) and a colocated sim worker, each behind its proxy."""
    c = Cluster(tmp_path_factory.mktemp("sim"))
    try:
        urls = _start_pd(c, sim_options, "tcp")
        wp, xp = free_port(), free_port()
        urls["colocated"] = f"http://127.0.0.1:{wp}"
        c.start("colocated", ["colocated", *sim_options, "--port", str(wp)], urls["colocated"],
                env={"PYTHONPROFILEIMPORTTIME": "1"})
        c.wait_healthy()
        urls["colocated_proxy"] = f"http://127.0.0.1:{xp}"
        c.start("colocated_proxy", ["proxy", "--port", str(xp), "--colocated", urls["colocated"]],
                urls["colocated_proxy"])
        c.wait_healthy()
    except BaseException:
        c.stop()
        raise
    yield c, urls
    c.stop()


def _proc(c: Cluster, name: str):
    return next(p for p in c.procs if p.name == name)


def _pss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    raise AssertionError("no Pss line")


@pytest.mark.parametrize("role", ["decode", "colocated", "prefill0"])
def test_a_sim_worker_loads_no_torch_and_stays_light(clusters, role):
    c, urls = clusters
    proxy = urls["colocated_proxy"] if role == "colocated" else urls["proxy"]
    body = _post(proxy + "/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 24, "temperature": 0})
    assert body["usage"]["completion_tokens"] == 24  # (it served a request: its pool and tokenizer were used)
    proc = _proc(c, role)
    maps = Path(f"/proc/{proc.popen.pid}/maps").read_text()
    assert "libtorch" not in maps and "/torch/" not in maps
    assert IMPORTED.findall(proc.log.read_text()) == []  # neither torch nor transformers, not even in part
    assert "import time:" in proc.log.read_text()  # (the import log is there to be read)
    pss = _pss_kb(proc.popen.pid)
    assert pss <= PSS_LIMIT_KB, f"{role}: {pss / 1024:.1f} MB PSS"


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 1234},
                                      {"temperature": 1.5, "top_p": 0.9, "seed": 7}], ids=["greedy", "seeded", "top-p"])
def test_pd_gives_the_colocated_tokens(clusters, sampling):
    """The same tokens whether prefill and decode ran apart (KV moved over tcp) or in one worker; and again
    once the prompts are cached (the second round reuses the prefill worker's blocks)."""
    _, urls = clusters
    for rounds in range(2):
        for i, prompt in enumerate(PROMPTS):
            body = {"prompt": prompt, "max_tokens": 12 + 5 * i, **sampling}
            pd, colocated = _post(urls["proxy"] + "/v1/completions", body), \
                _post(urls["colocated_proxy"] + "/v1/completions", body)
            assert pd["choices"][0]["text"] == colocated["choices"][0]["text"] != ""
            assert pd["usage"]["completion_tokens"] == colocated["usage"]["completion_tokens"] == body["max_tokens"]
            assert pd["usage"]["prompt_tokens"] == colocated["usage"]["prompt_tokens"]
        body = {"messages": CHAT, "max_tokens": 16, **sampling}
        pd, colocated = _post(urls["proxy"] + "/v1/chat/completions", body), \
            _post(urls["colocated_proxy"] + "/v1/chat/completions", body)
        assert pd["choices"][0]["message"] == colocated["choices"][0]["message"]
    if "seed" in sampling:  # another seed, other tokens: the seed reaches the sampler on both sides
        other = {"prompt": PROMPTS[1], "max_tokens": 12, **sampling, "seed": sampling["seed"] + 1}
        first = {"prompt": PROMPTS[1], "max_tokens": 12, **sampling}
        assert _post(urls["proxy"] + "/v1/completions", other)["choices"][0]["text"] != \
            _post(urls["proxy"] + "/v1/completions", first)["choices"][0]["text"]


def test_the_sim_tokenizer_is_the_models(clusters, smollm_dir: Path):
    """GET /xpyd/tokenizer of a sim worker serves what a real worker serves (transformers' description), and
    its blocks are named after the simulated engine's identity ("sim:", the weights' fingerprint, the KV bytes
    per token), not after the served name: simulated and real KV, or two models' simulated KV, never mix."""
    from xpyd.model.fingerprint import weights_fingerprint
    from xpyd.model.kv_layout import LAYOUT_NAME
    from xpyd.model.sim.runner import ModelFacts
    from xpyd.model.tokenizer import describe_tokenizer, load_tokenizer
    from xpyd.prefix_hash import hash_seed

    _, urls = clusters
    served = _get(urls["decode"] + "/xpyd/tokenizer")
    assert {k: served[k] for k in ("tokenizer", "chat_template", "special_tokens")} == \
        describe_tokenizer(load_tokenizer(smollm_dir))
    token_bytes = ModelFacts.read(smollm_dir).kv_token_bytes
    layout = {"layout": LAYOUT_NAME, "num_layers": 1, "num_kv_heads": 1, "head_dim": token_bytes // 4,
              "dtype": "float16", "block_size": 16}
    identity = f"sim:{weights_fingerprint(smollm_dir)}:{token_bytes}"
    assert served["hash_seed"] == hash_seed(identity, json.dumps(layout, sort_keys=True))
    assert _get(urls["prefill0"] + "/xpyd/tokenizer")["hash_seed"] == served["hash_seed"]


@pytest.mark.parametrize("flags, error", [
    (["--sim-speedup", "0"], "--sim-speedup must be a number > 0"),
    (["--sim-speedup", "nan"], "--sim-speedup must be a number > 0"),
    (["--sim-kv-token-bytes", "30"], "--sim-kv-token-bytes must be a multiple of 4"),
    (["--sim-profile", "/nonexistent/profile.json"], "simulation profile /nonexistent/profile.json"),
    (["--engine", "torch", "--sim-speedup", "2"], "--sim-speedup: options of --engine sim"),
])
def test_sim_options_are_checked_at_start(tmp_path, flags, error):
    """A wrong --sim-* option stops the worker before anything loads, saying which (exit 2), and `xpyd up`
    refuses it before it starts a child."""
    import subprocess
    import sys

    port = free_port()
    for argv in (["decode", "--engine", "sim", *flags, "--port", str(port)],
                 ["up", "--engine", "sim", *flags, "--port", str(port)]):
        out = subprocess.run([sys.executable, "-m", "xpyd", *argv], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr[-2000:]
        assert error in out.stderr


def test_up_passes_the_engine_to_every_worker():
    from xpyd.cli import build_parser
    from xpyd.launcher.up import worker_options

    args = build_parser().parse_args(["up", "--engine", "sim", "--sim-profile", "p.json", "--sim-speedup", "inf",
                                      "--sim-kv-token-bytes", "64"])
    for role in ("prefill", "decode", "colocated"):
        assert worker_options(args, role) == ["--engine", "sim", "--sim-profile", "p.json", "--sim-speedup", "inf",
                                              "--sim-kv-token-bytes", "64"]
    assert worker_options(build_parser().parse_args(["up"]), "decode") == []  # defaults: nothing passed


def test_the_proxy_routes_sim_workers_by_cache(tmp_path, sim_options):
    """Two prefill sim workers over shm (the prefill pools in shared segments): the proxy builds its tokenizer
    from theirs, indexes the blocks they report, and sends prompts sharing a cached prefix where it is cached."""
    c = Cluster(tmp_path)
    try:
        urls = _start_pd(c, sim_options, "shm", prefills=2)
        prefix = "Shared context, long enough for several KV blocks of sixteen tokens each. " * 6
        first = _post(urls["proxy"] + "/v1/completions", {"prompt": prefix + "first", "max_tokens": 2})
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        def holder() -> str | None:
            cluster = _get(urls["proxy"] + "/cluster")
            assert cluster["tokenizer"] is None or cluster["tokenizer"]["block_size"] == 16
            held = [w["http_url"] for w in cluster["workers"] if w["role"] == "prefill"
                    and (w["cache"]["indexed_blocks"] or 0) >= 4]
            return held[0] if cluster["tokenizer"] is not None and len(held) == 1 else None

        from tests.waiting import wait_until

        cached_at = wait_until(holder, "the proxy to index the prefix's blocks at one prefill worker", timeout=30)
        before = {u: _get(u + "/xpyd/stats")["prefix_hit_tokens"] for u in (urls["prefill0"], urls["prefill1"])}
        for i in range(4):
            body = _post(urls["proxy"] + "/v1/completions", {"prompt": prefix + f"turn {i}", "max_tokens": 2})
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 4 * 16
        after = {u: _get(u + "/xpyd/stats")["prefix_hit_tokens"] for u in before}
        assert after[cached_at] - before[cached_at] >= 4 * 4 * 16  # every one went where the prefix was
        other = next(u for u in before if u != cached_at)
        assert after[other] == before[other]
    finally:
        c.stop()
