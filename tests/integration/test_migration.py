"""Request migration (``xpyd.proxy.migration``) with real processes: 2P2D simulated workers behind the proxy; a
request's decode worker is SIGKILLed while the client reads its stream, the proxy moves the request to the other
decode worker, and the client's answer is the one an uninterrupted run gives, token for token (greedy, seeded
sampling, chat, logprobs, a stop string, a JSON answer), with no error and the usage of the whole request. A
prefill worker killed while it computes a prompt costs the client nothing either (the request starts over).
The killed worker is started again after each test (same port), and the proxy routes to it once it is up."""

from __future__ import annotations

import json
import signal
import threading
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, Proc, free_port, post_json, wait_until

MAX_TOKENS = 32
KILL_AFTER = 6  # token chunks the client reads before the kill


class Bed:
    def __init__(self, c: Cluster, options: list[str], urls: dict[str, str], ports: dict[str, tuple[int, int]]):
        self.c, self.options, self.urls, self.ports = c, options, urls, ports

    def proc(self, url: str) -> Proc:
        return next(p for p in self.c.procs if p.url == url and p.popen.poll() is None)

    def decode_of(self, workers_header: str) -> str:
        """The URL of the decode worker an ``x-xpyd-workers`` header names."""
        name = dict(part.split("=") for part in workers_header.replace(" ", "").split(","))["decode"]
        cluster = _get(self.urls["proxy"] + "/cluster")
        return next(w["http_url"] for w in cluster["workers"] if w.get("name") == name)

    def restart(self, url: str) -> None:
        name = next(k for k, v in self.urls.items() if v == url)
        port, other = self.ports[name]
        self.c.procs = [p for p in self.c.procs if p.popen.poll() is None]  # (the killed one)
        role, flag = ("prefill", "--signal-port") if name.startswith("prefill") else ("decode", "--kv-port")
        self.c.start(name, [role, *self.options, "--port", str(port), flag, str(other)], url)
        self.c.wait_healthy()
        wait_until(lambda: all(w["health"] == "up" for w in _get(self.urls["proxy"] + "/cluster")["workers"]),
                   60, "the proxy to route to the restarted decode worker")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def bed(tmp_path_factory, smollm_dir: Path):
    # speed-up 1 of the built-in profile: a stream lasts long enough to be cut in the middle
    options = ["--model", str(smollm_dir), "--engine", "sim", "--sim-speedup", "1", "--threads", "1",
               "--batch-size", "8", "--max-model-len", "512", "--served-model-name", "m"]
    c = Cluster(tmp_path_factory.mktemp("migration"))
    xp = free_port()
    ports = {name: (free_port(), free_port()) for name in ("prefill0", "prefill1", "decode0", "decode1")}
    urls = {"proxy": f"http://127.0.0.1:{xp}", **{k: f"http://127.0.0.1:{p}" for k, (p, _) in ports.items()}}
    try:
        for name, (port, other) in ports.items():
            role, flag = ("prefill", "--signal-port") if name.startswith("prefill") else ("decode", "--kv-port")
            c.start(name, [role, *options, "--port", str(port), flag, str(other)], urls[name])
        # (the proxy serves, and answers /health, once every worker answered its /xpyd/info)
        c.start("proxy", ["proxy", "--port", str(xp), *(a for n in ports for a in (f"--{n[:-1]}", urls[n])),
                          "--policy", "round_robin", "--expose-worker-names"], urls["proxy"])
        c.wait_healthy()
        yield Bed(c, options, urls, ports)
    finally:
        c.stop()


def _streams_and_kill(bed: Bed, cases: list[tuple[str, dict]]) -> tuple[list[list[dict]], str, list[int]]:
    """Stream every (path, body) at once; once each has KILL_AFTER token chunks, SIGKILL the decode worker serving
    the first. Every stream's events (read to [DONE]), the killed worker's URL, and which streams it served."""
    opened = []
    for path, body in cases:
        req = urllib.request.Request(bed.urls["proxy"] + path, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        r = urllib.request.urlopen(req, timeout=60)
        opened.append((r, bed.decode_of(r.headers["x-xpyd-workers"])))
    events: list[list[dict]] = [[] for _ in cases]
    chunks = [0] * len(cases)

    def read(i: int) -> None:
        with opened[i][0] as r:
            for line in r:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    return
                events[i].append(json.loads(data))
                chunks[i] += bool(events[i][-1].get("choices"))

    readers = [threading.Thread(target=read, args=(i,)) for i in range(len(cases))]
    for t in readers:
        t.start()
    wait_until(lambda: min(chunks) >= KILL_AFTER, 30, f"{KILL_AFTER} token chunks on every stream")
    killed = opened[0][1]
    assert all(c < MAX_TOKENS for c in chunks), "a stream ended before the kill"
    bed.proc(killed).popen.send_signal(signal.SIGKILL)
    for t in readers:
        t.join(60)
    return events, killed, [i for i, (_, d) in enumerate(opened) if d == killed]


def _text(events: list[dict], chat: bool) -> str:
    out = []
    for e in events:
        assert "error" not in e, e
        for c in e.get("choices") or ():
            out.append((c["delta"].get("content") or "") if chat else c["text"])
    return "".join(out)


def _usage(events: list[dict]) -> dict:
    """A stream's usage, without the cached-token count (the second run of a prompt finds it cached)."""
    usage = next(e["usage"] for e in events if e.get("usage"))
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


def _counts(answer: dict) -> tuple[int, int]:
    return answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]


def _migrations(bed: Bed) -> float:
    with urllib.request.urlopen(bed.urls["proxy"] + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("xpyd_proxy_migrations_total "):
                return float(line.split()[1])
    return 0.0


CASES = {
    "greedy completion": ("/v1/completions", {"prompt": "The history of the city begins", "temperature": 0}),
    "seeded completion with logprobs": ("/v1/completions", {"prompt": "Once upon a time", "temperature": 0.8,
                                                              "seed": 5, "logprobs": 2}),
    "seeded chat with a penalty": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story"}],
                                                            "temperature": 1.0, "seed": 9, "top_p": 0.9,
                                                            "frequency_penalty": 0.5}),
}


def test_streams_whose_decode_worker_is_killed_go_on_token_exact(bed):
    cases = [(path, {**body, "model": "m", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                     "stream_options": {"include_usage": True}}) for path, body in CASES.values()]
    before = _migrations(bed)
    events, killed, moved = _streams_and_kill(bed, cases)
    try:
        assert moved and 0 in moved  # (the first's worker was killed; round robin put another there or not)
        for (path, body), got in zip(cases, events):
            chat = path.endswith("chat/completions")
            uninterrupted = post_json(bed.urls["proxy"], path, {**body, "stream": True})
            assert _text(got, chat) == _text(uninterrupted, chat)
            assert _usage(got) == _usage(uninterrupted)
            assert _usage(got)["completion_tokens"] == MAX_TOKENS
            if "logprobs" in body:  # every token's logprobs once, in order
                tokens = [t for e in got for c in e["choices"] for t in (c["logprobs"] or {}).get("tokens", [])]
                again = [t for e in uninterrupted for c in e["choices"] for t in (c["logprobs"] or {}).get("tokens", [])]
                assert tokens == again and len(tokens) == MAX_TOKENS
            assert len({e["id"] for e in got}) == 1  # one response, as the client started it
        assert _migrations(bed) == before + len(moved)
    finally:
        bed.restart(killed)


def _ask_and_kill(bed: Bed, body: dict, role: str) -> tuple[dict, dict, str]:
    """``body``'s JSON answer uninterrupted, then again with the ``role`` worker that runs it SIGKILLed meanwhile:
    (expected, got, the killed worker's URL)."""
    expected = post_json(bed.urls["proxy"], "/v1/completions", body)
    got: dict = {}
    running: list[str] = []

    def one_running() -> bool:
        running[:] = [bed.urls[n] for n in (f"{role}0", f"{role}1") if _get(bed.urls[n] + "/xpyd/stats").get("running")]
        return bool(running)

    t = threading.Thread(target=lambda: got.setdefault("answer", post_json(bed.urls["proxy"], "/v1/completions",
                                                                           body)))
    t.start()
    wait_until(one_running, 30, f"a {role} worker running the request")
    bed.proc(running[0]).popen.send_signal(signal.SIGKILL)
    t.join(60)
    return expected, got.get("answer", {}), running[0]


def test_a_json_answer_whose_decode_worker_is_killed_is_whole(bed):
    body = {"model": "m", "prompt": "A list of rivers:", "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0.7, "seed": 3, "stop": ["zzzz-never"]}
    before = _migrations(bed)
    expected, got, killed = _ask_and_kill(bed, body, "decode")
    try:
        assert got["choices"][0]["text"] == expected["choices"][0]["text"]
        assert _counts(got) == _counts(expected)
        assert _migrations(bed) == before + 1
    finally:
        bed.restart(killed)


def test_a_prefill_worker_killed_while_it_computes_the_prompt_costs_the_client_nothing(bed):
    # a long prompt: the simulated prefill takes a while (speed-up 1), long enough to be caught running
    body = {"model": "m", "prompt": "word " * 400, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    expected, got, killed = _ask_and_kill(bed, body, "prefill")
    try:
        assert got["choices"][0]["text"] == expected["choices"][0]["text"]
        assert _counts(got) == _counts(expected)
    finally:
        bed.restart(killed)
