"""`--no-prefix-cache` on both workers (tiny model, float32): every prompt is computed and moved whole, and
answers are the same as with the cache."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from tests.cluster import start_1p1d
from tests.waiting import wait_until

PROMPT = " ".join(f"token{i}" for i in range(40))  # several full blocks


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        return json.loads(r.read())


def stats(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/xpyd/stats", timeout=5).read())


def idle_stats(url: str) -> dict | None:
    """The worker's stats once it runs and moves nothing (None before)."""
    s = stats(url)
    return s if s["waiting"] == s["running"] == s["transferring"] == 0 else None


def test_without_prefix_cache_nothing_is_reused_and_answers_do_not_change(tmp_path: Path, tiny_model_dir: Path):
    c, urls = start_1p1d(tmp_path, str(tiny_model_dir), extra=["--no-prefix-cache"])
    try:
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        answers = [post(urls["proxy"], body) for _ in range(3)]
        assert len({a["choices"][0]["text"] for a in answers}) == 1
        assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers] == [0, 0, 0]
        for role in ("prefill", "decode"):
            # (prefill frees a request's blocks when decode's release reaches it, just after the answer)
            s = wait_until(lambda: idle_stats(urls[role]), f"{role} done with every request")
            assert s["blocks_cached"] == 0 and s["prefix_hit_tokens"] == 0 and s["blocks_used"] == 0, s
        assert stats(urls["decode"])["kv_reused_blocks"] == 0
    finally:
        c.stop()
