"""xpyd bench against a fake OpenAI streaming server with known timings (real sockets, in-process run)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import socket
import subprocess
import sys
import threading
import types
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from xpyd.bench import main as bench_main

MODEL = "fake-model"
LONG_WORDS = 300  # prompts with more words than this are "long" to the fake server
CACHE_BLOCK = 16  # the fake prefix cache's block, in words


@dataclass
class FakeTimings:
    ttft_s: float = 0.10
    itl_s: float = 0.03
    tokens_per_chunk: int = 1
    fail_every: int = 0  # every n-th request answers 503
    long_ttft_s: float = 0.25  # for long prompts; short streams stall while one is "prefilled"
    models: bool = True  # False: GET /v1/models answers 404
    prefix_cache: bool = False  # report usage.prompt_tokens_details.cached_tokens (see FakeOpenAI)
    cached_ttft_s: float = 0.02  # the TTFT of a request with cached tokens
    bodies: list[dict] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)  # the text streamed for bodies[i]


class FakeOpenAI:
    """/v1/models and streaming /v1/completions + /v1/chat/completions, in a thread of its own.

    A prompt is its words (chat: every message's, in order), one token each. Each answer is unique
    (" r<request>t<i>" per token). With ``prefix_cache`` the fake has a prefix cache of CACHE_BLOCK-word
    blocks: cached_tokens = the longest word prefix shared with any earlier prompt, rounded down to
    whole blocks (decided on arrival, so a run's total is exact whatever the interleaving)."""

    def __init__(self, timings: FakeTimings) -> None:
        self.t = timings
        self.stall_until = 0.0
        self.seen: list[list[str]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.url = ""

    def start(self) -> None:
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> str:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _models(self, _: web.Request) -> web.Response:
        if not self.t.models:
            raise web.HTTPNotFound()
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _send(self, resp: web.StreamResponse, obj: dict | str) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj)
        await resp.write(f"data: {data}\n\n".encode())

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.t.bodies.append(body)
        rid = len(self.t.bodies)
        self.t.answers.append("")
        if self.t.fail_every and rid % self.t.fail_every == 0:
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        chat = "messages" in body
        prompt = " ".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
        cached = self._cached(prompt.split())
        n = body["max_tokens"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if chat:  # the opening role-only chunk must not count as the first token
            await self._send(resp, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        loop = asyncio.get_running_loop()
        long_prompt = len(prompt.split()) > LONG_WORDS
        if long_prompt:
            self.stall_until = max(self.stall_until, loop.time() + self.t.long_ttft_s)
            await asyncio.sleep(self.t.long_ttft_s)
        else:
            await asyncio.sleep(self.t.cached_ttft_s if cached else self.t.ttft_s)
        sent = 0
        while sent < n:
            if not long_prompt and loop.time() < self.stall_until:  # a long prefill holds short streams
                await asyncio.sleep(self.stall_until - loop.time())
            k = min(self.t.tokens_per_chunk, n - sent)
            text = "".join(f" r{rid}t{sent + i}" for i in range(k))
            self.t.answers[rid - 1] += text
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            await self._send(resp, {"choices": [choice]})
            sent += k
            if sent < n:
                await asyncio.sleep(self.t.itl_s)
        last = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
        await self._send(resp, {"choices": [last | {"finish_reason": "length"}]})
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n,
                 "prompt_tokens_details": {"cached_tokens": cached} if self.t.prefix_cache else None}
        await self._send(resp, {"choices": [], "usage": usage})
        await self._send(resp, "[DONE]")
        await resp.write_eof()
        return resp


    def _cached(self, words: list[str]) -> int:
        best = 0
        for old in self.seen:
            common = next((i for i, (a, b) in enumerate(zip(old, words)) if a != b), min(len(old), len(words)))
            best = max(best, common)
        self.seen.append(words)
        return best // CACHE_BLOCK * CACHE_BLOCK


@pytest.fixture
def fake():
    servers = []

    def start(**kw) -> FakeOpenAI:
        s = FakeOpenAI(FakeTimings(**kw))
        s.start()
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="xpyd bench")
    bench_main.add_arguments(parser)
    return bench_main.run(parser.parse_args(argv + ["--no-progress"]))


def test_fixed_concurrency_matches_known_timings(fake, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    s = fake(ttft_s=0.10, itl_s=0.03)
    out = tmp_path / "r.json"
    rc = bench(["--url", s.url, "--num-requests", "8", "--concurrency", "4", "--input-len", "16",
                "--output-len", "6", "--slo", "ttft=500ms,itl=200ms", "--json", str(out),
                "--plot", str(tmp_path / "plots")])
    assert rc == 0
    r = json.loads(out.read_text())
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(r[key]) >= {"mean", "p50", "p90", "p99"}
    assert (r["completed"], r["failed"]) == (8, 0)
    assert r["ttft_ms"]["p50"] == pytest.approx(100, abs=25)
    assert r["itl_ms"]["p50"] == pytest.approx(30, abs=10)
    assert r["tpot_ms"]["mean"] == pytest.approx(30, abs=10)
    assert r["e2e_ms"]["mean"] == pytest.approx(100 + 5 * 30, abs=50)
    assert r["total_output_tokens"] == 48 and r["mean_prompt_tokens"] == 16
    # 2 rounds of 4 concurrent ~250 ms requests
    assert r["duration_s"] == pytest.approx(0.5, abs=0.25)
    assert r["requests_per_s"] == pytest.approx(8 / r["duration_s"])
    assert r["output_tokens_per_s"] == pytest.approx(48 / r["duration_s"])
    assert r["goodput_requests_per_s"] == pytest.approx(r["requests_per_s"])
    assert r["model"] == MODEL and r["config"]["concurrency"] == 4
    body = s.t.bodies[0]
    assert body["model"] == MODEL and body["max_tokens"] == 6 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert len(body["prompt"].split()) == 16
    for name in ("latency_cdf.png", "itl_over_time.png"):
        png = tmp_path / "plots" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "goodput" in printed


def test_chat_multi_token_chunks_and_missed_slo(fake, tmp_path):
    s = fake(ttft_s=0.08, itl_s=0.04, tokens_per_chunk=2)
    out = tmp_path / "r.json"
    rc = bench(["--url", s.url + "/v1", "--endpoint", "chat", "--num-requests", "3", "--concurrency", "3",
                "--input-len", "8", "--output-len", "6", "--slo", "ttft=20ms", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 3 and r["total_output_tokens"] == 18  # from usage, not the 3 chunks each
    assert r["ttft_ms"]["mean"] == pytest.approx(80, abs=25)  # the role chunk is not the first token
    assert r["itl_ms"]["count"] == 6 and r["itl_ms"]["p50"] == pytest.approx(40, abs=12)  # per chunk
    assert r["tpot_ms"]["mean"] == pytest.approx(2 * 40 / 5, abs=8)  # per token
    assert r["goodput_requests_per_s"] == 0 and r["slo_missed"] == {"ttft": 3}
    assert s.t.bodies[0]["messages"][0]["role"] == "user"


def test_rate_mode_counts_failures(fake, tmp_path):
    s = fake(ttft_s=0.02, itl_s=0.01, fail_every=3)
    out = tmp_path / "r.json"
    rc = bench(["--url", s.url, "--num-requests", "9", "--rate", "40", "--seed", "1", "--input-len", "4",
                "--output-len", "3", "--json", str(out)])
    assert rc == 0  # failed requests are reported, not fatal
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"]) == (6, 3)
    assert r["errors"] == {"http_503": 3} and "overloaded" in r["error_samples"][0]
    assert r["ttft_ms"]["count"] == 6 and r["total_output_tokens"] == 18
    assert r["config"]["rate"] == 40


def test_warmup_and_duration(fake, tmp_path):
    s = fake(ttft_s=0.05, itl_s=0.05)  # ~150 ms a request
    out = tmp_path / "r.json"
    rc = bench(["--url", s.url, "--num-requests", "100", "--concurrency", "2", "--duration", "0.4",
                "--warmup", "2", "--input-len", "4", "--output-len", "3", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert 4 <= r["completed"] <= 8 and r["failed"] == 0  # issuing stopped after 0.4 s
    assert len(s.t.bodies) == r["completed"] + 2  # warmup requests were sent, not counted


def test_prefill_stall_reports_classes(fake, tmp_path):
    pytest.importorskip("matplotlib")
    s = fake(ttft_s=0.03, itl_s=0.02, long_ttft_s=0.2)
    out = tmp_path / "r.json"
    rc = bench(["--url", s.url, "--workload", "prefill-stall", "--num-requests", "12",
                "--stall-short-concurrency", "2", "--input-len", "8", "--output-len", "10",
                "--stall-long-input", str(LONG_WORDS + 50), "--stall-long-rate", "3", "--seed", "0",
                "--json", str(out), "--plot", str(tmp_path / "plots"), "--include-requests"])
    assert rc == 0
    r = json.loads(out.read_text())
    short, long_ = r["classes"]["short"], r["classes"]["long"]
    assert short["completed"] == 12 and long_["completed"] >= 1
    assert r["completed"] == short["completed"] + long_["completed"]
    assert long_["ttft_ms"]["p50"] == pytest.approx(200, abs=60)
    assert long_["total_output_tokens"] == 16 * long_["completed"]
    assert short["itl_ms"]["max"] > 100  # a short stream stalled behind a long prefill
    assert short["itl_ms"]["p50"] == pytest.approx(20, abs=10)
    assert {q["class"] for q in r["requests"]} == {"short", "long"}
    assert r["config"]["stall"]["long_rate"] == 3
    assert (tmp_path / "plots" / "itl_over_time.png").exists()


def test_jsonl_prompts(fake, tmp_path):
    s = fake(ttft_s=0.01, itl_s=0.01)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "one two three", "max_tokens": 2}\n{"prompt": "four"}\n')
    out = tmp_path / "r.json"
    assert bench(["--url", s.url, "--workload", "jsonl", "--prompts", str(prompts), "--num-requests", "3",
                  "--output-len", "4", "--json", str(out)]) == 0
    assert [b["prompt"] for b in s.t.bodies] == ["one two three", "four", "one two three"]
    assert json.loads(out.read_text())["total_output_tokens"] == 2 + 4 + 2


def test_shared_prefix_hit_rate_is_exact(fake, tmp_path, capsys):
    s = fake(ttft_s=0.06, itl_s=0.01, prefix_cache=True, cached_ttft_s=0.02)
    out = tmp_path / "r.json"
    before = time.perf_counter()
    rc = bench(["--url", s.url, "--workload", "shared-prefix", "--num-prefixes", "2", "--prefix-len", "32",
                "--input-len", "8", "--output-len", "3", "--num-requests", "8", "--concurrency", "4",
                "--warmup", "2", "--json", str(out), "--include-requests"])
    after = time.perf_counter()
    assert rc == 0
    r = json.loads(out.read_text())
    # the timelines' zero on this machine's monotonic clock: every request's end falls within the call
    assert before <= r["start_perf_counter"] <= after
    assert all(r["start_perf_counter"] < r["start_perf_counter"] + q["end_s"] <= after for q in r["requests"])
    # 40-word prompts; the first request of each prefix misses, the 6 others hit the 32 prefix words
    # (the warmup's prefixes are its own: they do not warm the measured ones)
    assert r["prefix_cache"] == {"hit_rate": 6 * 32 / (8 * 40), "cached_tokens": 192, "prompt_tokens": 320,
                                 "requests": 8}
    assert r["completed"] == 8 and r["total_output_tokens"] == 24
    assert sorted(q["cached_tokens"] for q in r["requests"]) == [0, 0] + [32] * 6
    assert r["config"]["shared_prefix"] == {"num_prefixes": 2, "prefix_len": 32, "suffix_len": 8,
                                            "assignment": "round-robin"}
    measured = [b["prompt"].split() for b in s.t.bodies[2:]]
    assert [w[:32] for w in measured[:2]] == [w[:32] for w in measured[2:4]]  # round-robin
    assert measured[0][:32] != measured[1][:32]
    assert "prefix cache hit rate       60.0% (192 of 320 prompt tokens)" in capsys.readouterr().out


def test_shared_prefix_chat_without_cached_tokens_is_n_a(fake, tmp_path, capsys):
    s = fake(ttft_s=0.02, itl_s=0.01)  # no prompt_tokens_details: the server does not say
    out = tmp_path / "r.json"
    assert bench(["--url", s.url, "--endpoint", "chat", "--workload", "shared-prefix", "--num-prefixes", "2",
                  "--prefix-len", "20", "--input-len", "4", "--output-len", "2", "--num-requests", "4",
                  "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["prefix_cache"] == {"hit_rate": None, "cached_tokens": 0, "prompt_tokens": 0, "requests": 0}
    assert r["completed"] == 4 and r["mean_prompt_tokens"] == 24
    roles = [[m["role"] for m in b["messages"]] for b in s.t.bodies]
    assert roles == [["system", "user"]] * 4
    assert s.t.bodies[0]["messages"][0] == s.t.bodies[2]["messages"][0] != s.t.bodies[1]["messages"][0]
    assert "prefix cache hit rate       n/a" in capsys.readouterr().out


def _transcript(body: dict) -> str:
    return " ".join(m["content"] for m in body["messages"]) if "messages" in body else body["prompt"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_multi_turn_histories_and_per_turn_report(fake, tmp_path, capsys, endpoint):
    s = fake(ttft_s=0.08, itl_s=0.01, prefix_cache=True, cached_ttft_s=0.02)
    out = tmp_path / "r.json"
    rc = bench(["--url", s.url, "--endpoint", endpoint, "--workload", "multi-turn", "--conversations", "3",
                "--turns", "3", "--concurrency", "2", "--prefix-len", "32", "--input-len", "8",
                "--output-len", "3", "--think-time", "0.02", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"], r["config"]["num_requests"], r["config"]["concurrency"]) == (9, 0, 9, 2)
    # turn 1: 32 + 8 words, nothing cached; turn 2: + 3 answer + 8 words = 51, its 40 first words are
    # turn 1's prompt (2 blocks cached); turn 3: 62 words, 51 of them turn 2's prompt (3 blocks)
    mt = r["multi_turn"]
    assert [t["prefix_cache"] for t in mt["turns"]] == [
        {"hit_rate": 0.0, "cached_tokens": 0, "prompt_tokens": 120, "requests": 3},
        {"hit_rate": 96 / 153, "cached_tokens": 96, "prompt_tokens": 153, "requests": 3},
        {"hit_rate": 144 / 186, "cached_tokens": 144, "prompt_tokens": 186, "requests": 3}]
    assert mt["first_turn"]["prefix_cache"]["hit_rate"] == 0.0
    assert mt["later_turns"]["prefix_cache"]["hit_rate"] == 240 / 339
    assert r["prefix_cache"]["hit_rate"] == 240 / 459 and mt["turns_not_sent"] == 0
    assert [t["turn"] for t in mt["turns"]] == [1, 2, 3] and all(t["completed"] == 3 for t in mt["turns"])
    assert mt["turns"][0]["ttft_ms"]["p50"] == pytest.approx(80, abs=25)  # the fake's uncached TTFT
    assert mt["turns"][2]["ttft_ms"]["p50"] == pytest.approx(20, abs=15)  # ... and its cached one
    # every later turn is an earlier request + the answer the fake streamed for it + a new question
    answers = {_transcript(b): a for b, a in zip(s.t.bodies, s.t.answers)}
    later = [b for b in s.t.bodies if len(_transcript(b).split()) > 40]
    assert len(later) == 6
    for b in later:
        if endpoint == "chat":
            prev = " ".join(m["content"] for m in b["messages"][:-2])
            assert [m["role"] for m in b["messages"][-2:]] == ["assistant", "user"]
            assert b["messages"][-2]["content"] == answers[prev]
        else:
            prev = max((p for p in answers if b["prompt"].startswith(p) and p != b["prompt"]), key=len)
            assert b["prompt"].startswith(prev + answers[prev] + " ")
    printed = capsys.readouterr().out
    assert "--- turns" in printed and "turns 2+                    70.8% (240 of 339 prompt tokens)" in printed


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_endpoint_exits_1_via_cli(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "xpyd.bench.main", "--url", f"http://127.0.0.1:{_closed_port()}",
                           "--num-requests", "2", "--json", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "cannot reach" in proc.stderr and not (tmp_path / "r.json").exists()


def test_plot_without_matplotlib_exits_2_via_cli_before_any_request(tmp_path):
    """Nothing listens on the port: had the run started, it would exit 1 (cannot reach)."""
    hide = "import sys; sys.modules['matplotlib'] = None; from xpyd.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", hide, "bench", "--url", f"http://127.0.0.1:{_closed_port()}",
                           "--num-requests", "2", "--plot", str(tmp_path / "plots")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "--plot needs matplotlib" in proc.stderr and "pip install 'xpyd[plot]'" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "plots").exists()


def test_model_list_missing(fake, tmp_path, capsys):
    s = fake(ttft_s=0.01, itl_s=0.01, models=False)
    base = ["--url", s.url, "--num-requests", "1", "--input-len", "4", "--output-len", "2"]
    assert bench(base) == 1  # cannot tell which model to ask for
    assert "answered HTTP 404" in capsys.readouterr().err
    assert bench(base + ["--model", "mine"]) == 0
    assert s.t.bodies[-1]["model"] == "mine"


@pytest.mark.parametrize("argv, msg", [
    (["--num-requests", "2"], "--url is required"),
    (["--url", "http://x:1"], "--num-requests is required"),
    (["--url", "http://x:1", "--num-requests", "2", "--slo", "ttft=fast"], "bad SLO value"),
    (["--url", "http://x:1", "--num-requests", "2", "--workload", "jsonl"], "--prompts"),
    (["--url", "http://x:1", "--num-requests", "2", "--workload", "prefill-stall", "--rate", "2"],
     "--stall-long-rate"),
    (["--url", "http://x:1", "--num-requests", "2", "--input-len-range", "5:1", "--workload", "random"],
     "1 <= A <= B"),
    (["--url", "http://x:1", "--num-requests", "0"], "--num-requests must be >= 1"),
    (["--url", "http://x:1", "--num-requests", "2", "--num-prefixes", "2"],
     "--num-prefixes goes with --workload shared-prefix"),
    (["--url", "http://x:1", "--workload", "shared-prefix", "--num-requests", "2", "--turns", "2"],
     "--turns goes with --workload multi-turn"),
    (["--url", "http://x:1", "--num-requests", "2", "--think-time", "0"], "--think-time goes with"),
    (["--url", "http://x:1", "--num-requests", "2", "--shared-context"], "--shared-context goes with"),
    (["--url", "http://x:1", "--workload", "multi-turn", "--rate", "2"], "not --rate"),
    (["--url", "http://x:1", "--workload", "multi-turn", "--conversations", "3", "--turns", "2",
      "--num-requests", "5"], "3 x 2 = 6 requests; --num-requests 5 disagrees"),
    (["--url", "http://x:1", "--workload", "multi-turn", "--conversations", "2", "--concurrency", "3"],
     "--concurrency 3 > --conversations 2"),
    (["--url", "http://x:1", "--workload", "multi-turn", "--think-time", "-1"], "--think-time must be >= 0"),
])
def test_bad_arguments_exit_2(argv, msg, capsys):
    assert bench(argv) == 2
    assert msg in capsys.readouterr().err


def test_argparse_errors_exit_2():
    with pytest.raises(SystemExit) as e:
        bench(["--url", "http://x:1", "--num-requests", "2", "--concurrency", "2", "--rate", "1"])
    assert e.value.code == 2


def test_transfer_mode_dispatches_lazily(monkeypatch):
    calls = []
    fake_mod = types.ModuleType("xpyd.bench.transfer_bench")
    fake_mod.add_arguments = lambda p: p.add_argument("--sizes", default="1M")
    fake_mod.run = lambda args: calls.append(args.sizes) or 7
    monkeypatch.setitem(sys.modules, "xpyd.bench.transfer_bench", fake_mod)
    import xpyd.bench

    monkeypatch.setattr(xpyd.bench, "transfer_bench", fake_mod, raising=False)
    parser = argparse.ArgumentParser(prog="xpyd bench")
    bench_main.add_arguments(parser)
    assert bench_main.run(parser.parse_args(["transfer", "--sizes", "4K"])) == 7
    assert calls == ["4K"]
