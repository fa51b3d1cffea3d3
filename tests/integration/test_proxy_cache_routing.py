"""Cache-aware routing through the real proxy (aiohttp.web, real ports) over fake aiohttp workers.

The fake workers serve the worker contract for it: ``GET /xpyd/tokenizer`` (a small word-level
tokenizer with a chat template), ``GET /xpyd/kv_events`` (events since a cursor, or a snapshot), and
block counts in ``GET /xpyd/stats``. Each one keeps the blocks of every prompt it was sent (as a
prefix cache does), and the test can put blocks in its cache or evict them. The registry is an in-test
fake, as etcd would be.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web
from tokenizers import Tokenizer, models, pre_tokenizers

from xpyd import PROTOCOL_VERSION
from xpyd.api.openai import RequestKind, parse_request
from xpyd.discovery.types import Role, WorkerInfo
from xpyd.netaddr import reserve_tcp
from xpyd.prefix_hash import block_hashes, hash_key, salted_seed
from xpyd.proxy.app import ProxyConfig, create_app
from xpyd.proxy.http_server import serve
from xpyd.proxy.prompt_tokens import PromptTokenizer, TokenizerSpec
from tests.cluster import free_port
from tests.waiting import until

MODEL = "fake-model"
BLOCK = 16
SEED = 12345
VOCAB = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(999)}}
TEMPLATE = ("{% for m in messages %}{{ bos_token }}{{ m['role'] }} {{ m['content'] }} {{ eos_token }} "
            "{% endfor %}{% if add_generation_prompt %}w1 w2{% endif %}")


def tokenizer_json() -> str:
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok.to_str()


SPEC = {"tokenizer": tokenizer_json(), "chat_template": TEMPLATE,
        "special_tokens": {"bos_token": "w7", "eos_token": "w8", "unk_token": "[UNK]", "pad_token": None},
        "block_size": BLOCK, "hash_seed": SEED}
TOKENS = PromptTokenizer(TokenizerSpec.from_json(json.dumps(SPEC)))  # the fakes tokenize as a worker would


def words(start: int, n: int) -> str:
    return " ".join(f"w{start + i}" for i in range(n))


PREFIX = words(100, 20 * BLOCK)  # 20 blocks shared by the requests below


def prompt_hashes(body: dict, kind: RequestKind = RequestKind.COMPLETION, key: bytes = b"") -> list[int]:
    """The blocks a worker names for ``body``, keyed with ``key`` and salted with its ``cache_salt``."""
    ids = TOKENS.token_ids(parse_request(json.dumps(body).encode(), kind))
    return block_hashes(ids, BLOCK, salted_seed(SEED, body.get("cache_salt"), key), key=key)


# ------------------------------------------------------------------ fakes


@dataclass
class CacheWorker:
    role: Role
    signal_port: int
    capacity: int = 4
    backlog: int = 0  # reported as waiting
    serve_tokenizer: bool = True
    key: bytes = b""  # the block-hash key (the cluster token's)
    received: list[str] = field(default_factory=list)  # prompts (or the last message)
    cache: set[int] = field(default_factory=set)
    epoch: str = field(default_factory=lambda: secrets.token_hex(4))
    log: list[tuple[int, str, int]] = field(default_factory=list)  # (seq, kind, hash)
    seq: int = 0
    snapshots: int = 0  # kv_events answered with a snapshot
    query_tokens: int = 0
    hit_tokens: int = 0
    tokenizer_fetches: int = 0
    port: int = 0
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def info(self) -> WorkerInfo:
        return WorkerInfo(self.role, self.url, f"127.0.0.1:{self.signal_port}", MODEL, PROTOCOL_VERSION,
                          self.capacity)

    def store(self, hashes: list[int]) -> None:
        for h in hashes:
            if h not in self.cache:
                self.cache.add(h)
                self.seq += 1
                self.log.append((self.seq, "stored", h))

    def evict(self, hashes: list[int]) -> None:
        for h in hashes:
            if h in self.cache:
                self.cache.discard(h)
                self.seq += 1
                self.log.append((self.seq, "removed", h))

    def restart_cache(self) -> None:
        """As a restarted worker: an empty cache and a new epoch."""
        self.cache.clear()
        self.log.clear()
        self.epoch, self.seq = secrets.token_hex(4), 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/xpyd/stats", self._stats)
        app.router.add_get("/xpyd/tokenizer", self._tokenizer)
        app.router.add_get("/xpyd/kv_events", self._kv_events)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True).start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _stats(self, _request: web.Request) -> web.Response:
        stats = {"waiting": self.backlog, "running": 0, "transferring": 0, "blocks_total": 1000,
                 "blocks_used": 0, "blocks_cached": len(self.cache), "blocks_free": 1000 - len(self.cache),
                 "prefix_query_tokens": self.query_tokens,
                 "prefix_hit_tokens": self.hit_tokens}
        if self.role is Role.PREFILL:
            stats["queued_tokens"] = 0
        return web.json_response(stats)

    async def _tokenizer(self, _request: web.Request) -> web.Response:
        self.tokenizer_fetches += 1
        if not self.serve_tokenizer:
            return web.Response(status=404)
        return web.json_response(SPEC)

    async def _kv_events(self, request: web.Request) -> web.Response:
        epoch, since = request.query.get("epoch"), request.query.get("since")
        if epoch == self.epoch and since is not None and (not self.log or self.log[0][0] <= int(since) + 1):
            events = [[kind, h] for seq, kind, h in self.log if seq > int(since)]
            return web.json_response({"epoch": self.epoch, "seq": self.seq, "events": events})
        self.snapshots += 1
        return web.json_response({"epoch": self.epoch, "seq": self.seq, "snapshot": sorted(self.cache)})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path.endswith("chat/completions")
        kind = RequestKind.CHAT if chat else RequestKind.COMPLETION
        self.received.append(body["messages"][-1]["content"] if chat else body["prompt"])
        if isinstance(body.get("prompt"), list):
            ids = body["prompt"]  # token ids: as they are (a real worker checks its vocabulary)
        else:
            ids = TOKENS.token_ids(parse_request(json.dumps(body).encode(), kind))
        hashes = block_hashes(ids, BLOCK, salted_seed(SEED, body.get("cache_salt"), self.key), key=self.key)
        hits = 0
        while hits < len(hashes) and hashes[hits] in self.cache:
            hits += 1
        self.query_tokens += len(ids)
        self.hit_tokens += hits * BLOCK
        self.store(hashes)
        text = {"text": "Hi"} if not chat else {"message": {"role": "assistant", "content": "Hi"}}
        if self.role is Role.PREFILL:
            return web.json_response({"choices": [{"index": 0, **text, "finish_reason": None}],
                                      "usage": {"prompt_tokens": len(ids), "completion_tokens": 1}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        name = {**body["kv_transfer_params"]["response"],
                "object": "chat.completion.chunk" if chat else "text_completion"}
        delta = {"delta": {"content": "!"}} if chat else {"text": "!"}
        usage = {"prompt_tokens": len(ids), "completion_tokens": 2, "total_tokens": len(ids) + 2}
        last = {**name, "choices": [{"index": 0, **delta, "finish_reason": "length"}]}
        await resp.write(f"data: {json.dumps(last)}\n\ndata: {json.dumps({**name, 'choices': [], 'usage': usage})}"
                         "\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp


class FakeRegistry:
    def __init__(self, workers: list[CacheWorker]) -> None:
        self.listed = list(workers)

    async def start(self) -> None: ...

    def workers(self, role: Role) -> list[WorkerInfo]:
        return [w.info for w in self.listed if w.role is role]

    async def close(self) -> None: ...


@dataclass
class Env:
    url: str
    http: aiohttp.ClientSession
    prefill: list[CacheWorker]
    decode: list[CacheWorker]

    async def complete(self, prompt: str | list[int], **fields) -> None:
        async with self.http.post(self.url + "/v1/completions",
                                  json={"model": MODEL, "prompt": prompt, "max_tokens": 2, **fields}) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["choices"][0]["text"] == "Hi!"

    async def chat(self, messages: list[dict]) -> None:
        async with self.http.post(self.url + "/v1/chat/completions",
                                  json={"model": MODEL, "messages": messages, "max_tokens": 2}) as r:
            assert r.status == 200, await r.text()

    async def cluster(self) -> dict:
        async with self.http.get(self.url + "/cluster") as r:
            assert r.status == 200
            return await r.json()

    async def view(self, w: CacheWorker) -> dict:
        return next(v for v in (await self.cluster())["workers"] if v["http_url"] == w.url)

    async def settle(self) -> None:
        """Until a stats poll of every worker came after the last request (nothing assigned since)."""
        async def settled() -> bool:
            return all(v["load"]["assigned"] == 0 and v["load"]["assigned_blocks"] == 0
                       for v in (await self.cluster())["workers"])

        await until(settled, "a stats poll of every worker since the last request")

    async def reported(self, w: CacheWorker) -> None:
        """Until the proxy has seen ``w``'s current backlog in its stats."""
        async def seen() -> bool:
            return (await self.view(w))["load"]["waiting"] == w.backlog

        await until(seen, f"the proxy to see {w.url}'s backlog of {w.backlog}")

    async def indexed(self, w: CacheWorker, blocks: int) -> None:
        """Until the proxy's index holds ``blocks`` blocks for ``w`` as its events reported them."""
        async def seen() -> bool:
            return (await self.view(w))["cache"]["indexed_blocks"] == blocks

        await until(seen, f"the proxy to index {blocks} blocks for {w.url}")


@pytest.fixture
async def make_env() -> AsyncIterator:
    cleanups = []

    async def make(serve_tokenizer: bool = True, key: bytes = b"", **config_kw) -> Env:
        prefill = [CacheWorker(Role.PREFILL, 15100 + i) for i in range(2)]
        decode = [CacheWorker(Role.DECODE, 16100 + i) for i in range(2)]
        for w in (*prefill, *decode):
            w.serve_tokenizer, w.key = serve_tokenizer, key
            await w.start()
        # (every prompt prefilled on a prefill worker: the routing of P/D pairs is what these tests look at)
        config = ProxyConfig(port=free_port(), poll_interval=0.05, **{"local_prefill_max_tokens": 0, **config_kw})
        stop = asyncio.Event()
        task = asyncio.create_task(serve(create_app(config, FakeRegistry([*prefill, *decode])), stop,
                                         reserve_tcp("127.0.0.1", config.port), graceful_timeout=1))
        http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        env = Env(f"http://127.0.0.1:{config.port}", http, prefill, decode)

        async def close() -> None:
            await http.close()
            stop.set()
            await asyncio.wait_for(task, 5)
            for w in (*prefill, *decode):
                await w.stop()

        cleanups.append(close)

        async def ready() -> bool:
            try:
                data = await env.cluster()
            except aiohttp.ClientConnectionError:
                return False
            return data["tokenizer"] is not None or not serve_tokenizer

        await until(ready, "the proxy to listen and fetch the tokenizer")
        return env

    yield make
    for close in cleanups:
        await close()


# ------------------------------------------------------------------ tests


async def test_shared_prefix_goes_where_it_is_cached_until_evicted(make_env):
    env = await make_env()
    (pa, pb), (da, db) = env.prefill, env.decode
    assert (await env.cluster())["policy"] == "cache_aware"
    assert (await env.cluster())["tokenizer"]["block_size"] == BLOCK
    prefix = prompt_hashes({"prompt": PREFIX})
    assert len(prefix) == 20
    # pa and db hold the prefix (earlier requests, as far as the proxy is concerned: it learns it from
    # their KV events). Both are busier than their peer, so load alone would pick the others.
    pa.store(prefix)
    db.store(prefix)
    pa.backlog = db.backlog = 1
    for w in (pa, db):
        await env.indexed(w, 20)
        await env.reported(w)
    for i in range(6):
        await env.settle()
        await env.complete(f"{PREFIX} w{900 + i}")
    assert (len(pa.received), len(pb.received), len(da.received), len(db.received)) == (6, 0, 0, 6)
    assert pa.hit_tokens == 6 * 20 * BLOCK
    view = await env.view(pa)
    assert view["cache"]["blocks_cached"] == 20 and view["cache"]["indexed_blocks"] == 20
    assert await until(lambda: _hit_rate(env, pa), "pa's hit rate") == round(320 / 321, 4)  # 20 of 20 blocks + 1
    assert (await env.view(pb))["cache"]["hit_rate"] is None  # asked nothing yet

    # pa evicts the prefix: once its events say so, the requests go by load (to pb, idle) and stay there,
    # now that pb holds it.
    pa.evict(prefix)
    await env.indexed(pa, 0)
    for i in range(4):
        await env.settle()
        await env.complete(f"{PREFIX} w{950 + i}")
    assert (len(pa.received), len(pb.received)) == (6, 4)
    assert len(db.received) == 10  # decode still holds it
    # A request without the prefix: no one holds it, load decides (the idle workers).
    await env.settle()
    await env.complete(words(500, 3 * BLOCK))
    assert (len(pa.received), len(pb.received), len(da.received)) == (6, 5, 1)


async def test_keyed_salted_prefixes_go_where_the_same_salt_is_cached(make_env):
    """Workers with a cluster token key their block hashes and salt them with each request's cache_salt; the
    proxy (same token) names a request's blocks the same way: a prefix cached under one salt draws requests
    with that salt, and none with another salt or without one."""
    token = "a-cluster-token"
    key = hash_key(token)
    env = await make_env(key=key, cluster_token=token)
    (pa, pb), (da, db) = env.prefill, env.decode
    alice = prompt_hashes({"prompt": PREFIX, "cache_salt": "alice"}, key=key)
    assert len(alice) == 20 and not set(alice) & set(prompt_hashes({"prompt": PREFIX, "cache_salt": "bob"}, key=key))
    pa.store(alice)  # pa and db hold alice's prefix, and are busier than their peers
    db.store(alice)
    pa.backlog = db.backlog = 1
    for w in (pa, db):
        await env.indexed(w, 20)
        await env.reported(w)
    for i in range(3):
        await env.settle()
        await env.complete(f"{PREFIX} w{900 + i}", cache_salt="alice")
    assert (len(pa.received), len(pb.received), len(da.received), len(db.received)) == (3, 0, 0, 3)
    assert pa.hit_tokens == 3 * 20 * BLOCK
    for i, fields in enumerate(({"cache_salt": "bob"}, {}, {"cache_salt": "bob"})):  # by load: the idle ones
        await env.settle()
        await env.complete(f"{PREFIX} w{950 + i}", **fields)
    assert (len(pa.received), len(db.received)) == (3, 3)
    assert pb.hit_tokens == 20 * BLOCK  # the second bob request found the first one's blocks


async def _hit_rate(env: Env, w: CacheWorker) -> float | None:
    return (await env.view(w))["cache"]["hit_rate"]


async def test_a_conversation_follows_its_history(make_env):
    env = await make_env()
    turns = [[{"role": "system", "content": words(300 + 100 * c, 4 * BLOCK)},
              {"role": "user", "content": words(10 * c + 1, 3)}] for c in range(4)]
    for messages in turns:  # four conversations: equal workers take turns
        await env.settle()
        await env.chat(messages)
    holder = {c: next(w for w in env.prefill if turns[c][-1]["content"] in w.received) for c in range(4)}
    assert {len(w.received) for w in env.prefill} == {2}
    # Their second turns, in another order: each back to the worker that has its history.
    for c in (2, 0, 3, 1):
        turns[c] += [{"role": "assistant", "content": "w5 w6"}, {"role": "user", "content": words(600 + c, 20)}]
        await env.settle()
        await env.chat(turns[c])
        assert turns[c][-1]["content"] in holder[c].received, f"conversation {c} moved"
    assert {len(w.received) for w in env.prefill} == {4}
    # What they share (the system prompt and the first question, up to the generation prompt): 4 blocks each.
    assert sum(w.hit_tokens for w in env.prefill) == 4 * 4 * BLOCK


async def test_a_restarted_worker_is_resynced_from_its_snapshot(make_env):
    env = await make_env()
    pa, pb = env.prefill
    prefix = prompt_hashes({"prompt": PREFIX})
    pa.store(prefix)
    await env.indexed(pa, 20)
    snapshots = pa.snapshots
    pa.restart_cache()  # its cache started over: a new epoch, the proxy's cursor is from another life
    await env.indexed(pa, 0)
    assert pa.snapshots == snapshots + 1
    pb.store(prefix)
    await env.indexed(pb, 20)
    await env.settle()
    await env.complete(f"{PREFIX} w901")
    assert (len(pa.received), len(pb.received)) == (0, 1)
    # Events it no longer has (its log was trimmed before the proxy read them): a snapshot too.
    snapshots = pb.snapshots
    pb.store(prompt_hashes({"prompt": words(700, 2 * BLOCK)}))
    pb.log = pb.log[-1:]
    await env.indexed(pb, 22)
    assert pb.snapshots == snapshots + 1


async def test_requests_go_by_load_when_they_cannot_be_tokenized(make_env):
    env = await make_env()
    for w in env.prefill:
        w.store(prompt_hashes({"prompt": PREFIX}))
    await env.complete([5000, 5001])  # not in the proxy's (tiny) vocabulary: routed, not refused
    assert sum(len(w.received) for w in env.prefill) == 1


async def test_no_tokenizer_means_least_loaded_and_a_later_retry(make_env, monkeypatch):
    monkeypatch.setattr("xpyd.proxy.cache_feed.TOKENIZER_RETRY_SECONDS", 0.2)
    env = await make_env(serve_tokenizer=False)  # as older workers: 404
    pa, pb = env.prefill
    pa.store(prompt_hashes({"prompt": PREFIX}))
    await env.indexed(pa, 20)  # (their KV events would still be indexed)
    pa.backlog = 2
    await env.reported(pa)
    for _ in range(3):
        await env.settle()
        await env.complete(PREFIX)
    assert (await env.cluster())["tokenizer"] is None
    assert (len(pa.received), len(pb.received)) == (0, 3)  # by load: its cache is unknown to the requests
    await until(lambda: sum(w.tokenizer_fetches > 0 for w in (*env.prefill, *env.decode)) >= 2,
                "the fetch retried, from the next worker")
    for w in (*env.prefill, *env.decode):
        w.serve_tokenizer = True

    async def fetched() -> bool:
        return (await env.cluster())["tokenizer"] is not None

    await until(fetched, "the tokenizer once a worker serves it")
    other = words(600, 4 * BLOCK)  # (pb holds PREFIX too by now: it served it)
    pa.store(prompt_hashes({"prompt": other}))
    await env.indexed(pa, 24)
    await env.settle()
    await env.complete(f"{other} w5")
    assert len(pa.received) == 1  # its cache wins over a backlog of 2 (< a batch)
