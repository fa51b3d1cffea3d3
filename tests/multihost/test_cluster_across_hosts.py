"""A dynamic 2P2D cluster with every process on its own host of the test bed (tiny random Llama, float32).

etcd, the proxy and each of the 2 prefill and 2 decode workers run in their own network namespace,
joined through a bridge (scripts/netbed.py); nothing shares a loopback or a network namespace, so the
workers' advertised addresses, etcd discovery, the signal plane and the KV transfer listener all cross
a real network boundary. The test process reaches the hosts through the bed's access link, like a
client on the same network, and talks to the proxy with the official ``openai`` client. Checked: text
token-exact against transformers ``generate``, the addresses in etcd and the proxy's view are the
hosts' own, ``auto`` chose tcp for every transfer (worker ``/xpyd/stats`` ``kv_backend``), and the KV
bytes the metrics count went over the prefill hosts' links.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from testbed import EtcdOnHost

from tests.cluster import Cluster, wait_until

MAX_TOKENS = 8
PREFILL_PORT, SIGNAL_PORT, DECODE_PORT, KV_PORT, PROXY_PORT = 8100, 8101, 8200, 8201, 8000
PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog", "one two three four five six",
           "etcd is a key value store", "disaggregated prefill and decode on separate hosts"]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three colors."}]]


class AcrossHosts:
    """etcd, 2 prefill + 2 decode workers and the proxy, each on its own bed host."""

    def __init__(self, bed, workdir: Path, model: Path) -> None:
        self.bed = bed
        self.hosts = {n: bed.add_host(n) for n in ("etcd", "proxy", "p0", "p1", "d0", "d1")}
        self.etcd = EtcdOnHost(bed, self.hosts["etcd"], workdir)
        self.c = Cluster(workdir)
        self.urls: dict[str, str] = {}
        self.proxy = f"http://{self.hosts['proxy'].ip}:{PROXY_PORT}"

    def start(self, model: Path) -> None:
        self.etcd.start()
        for name in ("p0", "p1", "d0", "d1"):
            h = self.hosts[name]
            role, port, extra = (("prefill", PREFILL_PORT, ["--signal-port", str(SIGNAL_PORT)]) if name[0] == "p"
                                 else ("decode", DECODE_PORT, ["--kv-port", str(KV_PORT)]))
            args = [role, "--model", str(model), "--dtype", "float32", "--threads", "1", "--max-model-len", "256",
                    "--batch-size", "4", "--host", h.ip, "--port", str(port), "--etcd", self.etcd.endpoint,
                    "--lease-ttl", "2", *extra]  # (--kv-backend: the default, auto)
            self.urls[name] = self.c.start(name, args, f"http://{h.ip}:{port}", wrap=self.wrap(name)).url
        # (at once: a proxy in dynamic mode starts with no workers and finds them as they register)
        self.c.start("proxy", ["proxy", "--host", self.hosts["proxy"].ip, "--port", str(PROXY_PORT),
                               "--etcd", self.etcd.endpoint], self.proxy, wrap=self.wrap("proxy"))
        self.c.wait_healthy()
        wait_until(lambda: len(self.cluster()["workers"]) == 4, 20, "the proxy to discover 4 workers in etcd")

    def wrap(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[host].ns]

    def stop(self) -> None:
        self.c.stop()
        self.etcd.stop()

    def cluster(self) -> dict:
        return get(self.proxy + "/cluster")


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples on ``url``/metrics whose labels include ``labels``."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


@pytest.fixture(scope="module")
def across(bed, tmp_path_factory, tiny_model_dir: Path):
    workdir = tmp_path_factory.mktemp("across-hosts")
    c = AcrossHosts(bed, workdir, tiny_model_dir)
    try:
        c.start(tiny_model_dir)
        yield c
    finally:
        c.stop()  # (then the bed fixture removes the namespaces, and anything left running in them)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):
    """Greedy single-process transformers ``generate`` on the same model, float32: (text, tokens, finish)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xpyd.model.tokenizer import encode_chat, encode_prompt

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    cache: dict = {}

    def generate(prompt: str | None = None, messages: list | None = None) -> tuple[str, int, str]:
        key = json.dumps([prompt, messages])
        if key not in cache:
            ids = encode_chat(tok, messages) if messages is not None else encode_prompt(tok, prompt)
            with torch.inference_mode():
                out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=MAX_TOKENS, do_sample=False)
            new = out[0, len(ids):].tolist()
            finish = "stop" if new and new[-1] == tok.eos_token_id else "length"
            cache[key] = (tok.decode(new, skip_special_tokens=True), len(new), finish)
        return cache[key]

    return generate


def test_workers_register_and_are_found_by_their_host_addresses(across):
    from xpyd.discovery.status import fetch_workers

    registered = asyncio.run(fetch_workers(across.etcd.endpoint))  # etcd on its host, read from outside
    by_url = {w.http_url: w for w in registered}
    assert set(by_url) == set(across.urls.values())
    for name, url in across.urls.items():
        ip = across.hosts[name].ip
        assert url.startswith(f"http://{ip}:")
        assert by_url[url].signal_addr.rsplit(":", 1)[0] == ip  # the signal plane / KV address peers dial
        assert get(url + "/xpyd/info")["http_url"] == url
    seen = {w["http_url"]: w for w in across.cluster()["workers"]}  # the proxy, on its own host, via etcd
    assert set(seen) == set(across.urls.values()) and all(w["health"] == "up" for w in seen.values()), seen


def test_openai_client_across_hosts_matches_transformers(across, reference):
    import openai

    client = openai.OpenAI(base_url=across.proxy + "/v1", api_key="unused", timeout=60, max_retries=0)
    model = client.models.list().data[0].id

    def completion(prompt: str) -> None:
        text, n, finish = reference(prompt=prompt)
        c = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert (c.choices[0].text, c.usage.completion_tokens, c.choices[0].finish_reason) == (text, n, finish)
        chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [finish]
        assert chunks[-1].usage.completion_tokens == n and len({ch.id for ch in chunks}) == 1

    def chat(messages: list) -> None:
        text, n, finish = reference(messages=messages)
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].message.role == "assistant"
        assert (r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason) == (text, n, finish)
        chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [finish]

    with client, ThreadPoolExecutor(4) as ex:  # several at once, so both pairs of hosts serve
        for f in [ex.submit(completion, p) for p in PROMPTS] + [ex.submit(chat, m) for m in CHATS]:
            f.result()


def test_auto_chose_tcp_and_the_kv_crossed_the_links(across):
    # (enough requests of its own that every prefill host served some: routing may favour one pair)
    for i in range(40):
        body = {"prompt": f"{i} " + PROMPTS[i % len(PROMPTS)], "max_tokens": 2, "temperature": 0}
        req = urllib.request.Request(across.proxy + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        if i >= 8 and all(get(across.urls[p] + "/xpyd/stats")["kv_backend"]["sent"] for p in ("p0", "p1")):
            break
    def idle() -> bool:  # (prefill learns a send ended from decode's ack, a moment after the client's answer)
        stats = [get(url + "/xpyd/stats") for url in across.urls.values()]
        return all(s["blocks_used"] == s["transfers_in_flight"] == 0 for s in stats)

    wait_until(idle, 10, "every worker idle, its KV freed")
    prefills = {p: get(across.urls[p] + "/xpyd/stats")["kv_backend"] for p in ("p0", "p1")}
    decodes = {d: get(across.urls[d] + "/xpyd/stats")["kv_backend"] for d in ("d0", "d1")}
    for name, kv in prefills.items():  # P and D on different hosts: tcp, never shm
        assert kv["name"] == "auto" and set(kv["sent"]) == {"tcp"} and kv["sent"]["tcp"] > 0, (name, kv)
    for name, kv in decodes.items():
        assert kv["name"] == "auto" and set(kv["received"]) <= {"tcp"}, (name, kv)
    assert sum(kv["sent"]["tcp"] for kv in prefills.values()) == \
        sum(kv["received"].get("tcp", 0) for kv in decodes.values())

    sent = {p: metric(across.urls[p], "xpyd_kv_transfer_bytes_total", direction="send") for p in prefills}
    received = sum(metric(across.urls[d], "xpyd_kv_transfer_bytes_total", direction="recv") for d in decodes)
    assert all(n > 0 for n in sent.values()) and received == sum(sent.values()), (sent, received)
    for p, n in sent.items():  # and those bytes left through the prefill host's own link
        tx, _ = across.bed.link_bytes(p)
        assert tx > n, (p, tx, n)
