"""Network faults on the multi-host test bed, under 8 concurrent client streams (tiny random Llama, float32).

One dynamic 1P2D cluster: etcd, the proxy, p0, d0 and d1 each on its own namespace host, with a cluster
token, low fault timeouts (``--kv-ttl``, ``--peer-timeout``, ``--prefill-wait-timeout``, ``--lease-ttl``),
and a sixth host, x, that belongs to nobody. The test process is a client on the bed's access link;
every request streams through the proxy, and what completes is checked token for token against
transformers ``generate``. Each test restores the bed (heal, no loss, no shaping) however it ends.

- a third party at a decode worker's transfer listener (x), with the header of a transfer in flight that
  an on-path observer (a packet socket on p0's link) sniffed: without its MAC, with a wrong MAC, and
  replayed verbatim once the transfer finished. Refused, counted, the prefill pool byte for byte the
  same, the victim request and a later one that reuses its cached blocks on decode token-exact;
- 5% random loss on p0 and d0 (bursty: nftables drops whole GSO packets): every request completes,
  token-exact; how much slower is printed (no timed assertion);
- the P-D link cut (p0-d0) while KV moves over a tbf-shaped link: the requests it hits move on to
  another pair (migrated if the client had tokens, started over if not) and complete token-exact like
  the others, every pool returns to zero while the link is still cut, the proxy then routes around the
  pair (everything completes on d1, both workers still up), and after ``heal`` (and the pair's cool-down)
  d0 serves again;
- d0 cut off from etcd (not from the proxy or p0): its lease expires, the proxy stops routing to it, it
  drains, the other decode worker serves everything; after ``heal`` it registers again and serves.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import random
import select
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest
from testbed import ROOT, EtcdOnHost

from tests import door
from tests.cluster import Cluster, wait_until
from xpyd.signal.request_id import ClusterKeys

STREAMS = 8
MAX_TOKENS = 4
PREFILL_PORT, SIGNAL_PORT, DECODE_PORT, KV_PORT, PROXY_PORT = 8100, 8101, 8200, 8201, 8000
TOKEN = "bed-cluster-token"
KV_TTL, PEER_TIMEOUT, PREFILL_WAIT, LEASE_TTL = 5.0, 3.0, 8.0, 2
SIGNAL_TIMEOUT = 5.0  # the decode workers' signal-plane deadline (--signal-timeout)
PAIR_COOLDOWN = 20.0  # the proxy avoids a pair whose path failed this long (--pair-cooldown)
CLIENT_TIMEOUT = 40.0  # a request with no byte for this long counts as hung
WORDS = ("the quick brown fox jumps over a lazy dog while seven small birds sing in green trees near "
         "old stone walls and bright yellow flowers open to warm morning light").split()


def prompt(tag: str, words: int) -> str:
    """A prompt of about ``words`` tokens that shares no KV block with any other tag's."""
    rng = random.Random(tag)
    return f"{tag}: " + " ".join(rng.choice(WORDS) for _ in range(words))


# -- the cluster ------------------------------------------------------------------------------------


class OneByTwo:
    """etcd, p0, d0, d1 and the proxy, each on its own bed host; x is on the bed too (no worker)."""

    def __init__(self, bed, workdir: Path) -> None:
        self.bed = bed
        self.hosts = {n: bed.add_host(n) for n in ("etcd", "proxy", "p0", "d0", "d1", "x")}
        self.etcd = EtcdOnHost(bed, self.hosts["etcd"], workdir)
        self.c = Cluster(workdir)
        self.urls: dict[str, str] = {}
        self.proxy = f"http://{self.hosts['proxy'].ip}:{PROXY_PORT}"

    def start(self, model: Path) -> None:
        self.etcd.start()
        for name in ("p0", "d0", "d1"):
            h = self.hosts[name]
            if name == "p0":
                role, port = "prefill", PREFILL_PORT
                extra = ["--signal-port", str(SIGNAL_PORT), "--kv-ttl", str(KV_TTL),
                         "--peer-timeout", str(PEER_TIMEOUT)]
            else:
                role, port = "decode", DECODE_PORT
                extra = ["--kv-port", str(KV_PORT), "--prefill-wait-timeout", str(PREFILL_WAIT),
                         "--signal-timeout", str(SIGNAL_TIMEOUT)]
            args = [role, "--model", str(model), "--dtype", "float32", "--threads", "1", "--max-model-len", "2048",
                    "--batch-size", "8", "--host", h.ip, "--port", str(port), "--etcd", self.etcd.endpoint,
                    "--lease-ttl", str(LEASE_TTL), *extra]
            self.urls[name] = self.c.start(name, args, f"http://{h.ip}:{port}", env={"XPYD_CLUSTER_TOKEN": TOKEN},
                                           wrap=self.wrap(name)).url
        self.c.start("proxy", ["proxy", "--host", self.hosts["proxy"].ip, "--port", str(PROXY_PORT),
                               "--etcd", self.etcd.endpoint, "--pair-cooldown", str(PAIR_COOLDOWN)], self.proxy,
                     env={"XPYD_CLUSTER_TOKEN": TOKEN}, wrap=self.wrap("proxy"))
        self.c.wait_healthy()
        wait_until(lambda: len(self.listed()) == 3, 20, "the proxy to discover 3 workers in etcd")

    def wrap(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[host].ns]

    def stop(self) -> None:
        self.c.stop()
        self.etcd.stop()

    def listed(self) -> dict[str, dict]:
        """The workers the proxy knows, by HTTP URL."""
        return {w["http_url"]: w for w in get(self.proxy + "/cluster")["workers"]}

    def stats(self, name: str) -> dict:
        return get(self.urls[name] + "/xpyd/stats", {"Authorization": f"Bearer {ClusterKeys(TOKEN).http_bearer}"})

    def pid(self, name: str) -> int:
        return next(p.popen.pid for p in self.c.procs if p.name == name)  # (ip netns exec execs the worker)

    def received(self, name: str) -> int:
        """KV transfers decode worker ``name`` received so far (all tcp: every peer is on another host)."""
        return self.stats(name)["kv_backend"]["received"].get("tcp", 0)


def get(url: str, headers: dict[str, str] | None = None) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
        return json.loads(r.read())


def metric(url: str, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


IDLE_KEYS = ("waiting", "running", "transferring", "blocks_used", "kv_used_bytes",
             "transfers_in_flight")


def idle(cluster: OneByTwo) -> bool:
    """Every worker holds no request, no KV block (cached blocks aside) and no transfer."""
    return all(cluster.stats(n)[k] == 0 for n in ("p0", "d0", "d1") for k in IDLE_KEYS)


@pytest.fixture(scope="module")
def cluster(bed, tmp_path_factory, tiny_long_model_dir: Path):
    c = OneByTwo(bed, tmp_path_factory.mktemp("network-faults"))
    try:
        c.start(tiny_long_model_dir)
        yield c
    finally:
        c.stop()  # (then the bed fixture removes the namespaces and whatever still runs in them)


@pytest.fixture(scope="module")
def reference(tiny_long_model_dir: Path):
    """Greedy transformers ``generate`` on the same model in float32: prompt -> (text, finish_reason, decided),
    ``decided`` the text of the leading tokens whose exact (float64) top-2 margin exceeds twice the float32
    error (``tests.numerics``): any float32 path picks those, while at a closer call (the prompts carry
    timestamps, and one in a few hundred meets an exact float32 tie) another path may pick the other token,
    and nothing after it is comparable.

    Every answer is computed on one background thread, in the order asked for; ``reference.prefetch(prompt)``
    asks without waiting (a client stream does, for each request it completed, so the references compute
    while the test waits on the cluster's timeouts instead of all at the end)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.numerics import Reference
    from xpyd.model.tokenizer import encode_prompt

    tok = AutoTokenizer.from_pretrained(str(tiny_long_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_long_model_dir), dtype=torch.float32).eval()
    model64 = AutoModelForCausalLM.from_pretrained(str(tiny_long_model_dir), dtype=torch.float64).eval()
    cache: dict[str, Future] = {}
    lock = threading.Lock()

    def compute(text: str) -> tuple[str, str, str | None]:
        ids = encode_prompt(tok, text)
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=MAX_TOKENS, do_sample=False)
            new = out[0, len(ids):].tolist()
            seq = torch.tensor([ids + new[:-1]])
            ref = Reference.measure(model64(seq).logits[0], model(seq).logits[0])
        rows = Reference(ref.exact[len(ids) - 1:], ref.bound)
        margins = rows.margins().tolist()
        undecided = next((t for t, m in enumerate(margins) if m <= 2 * rows.bound), None)
        finish = "stop" if new and new[-1] == tok.eos_token_id else "length"
        decided = None if undecided is None else tok.decode(new[:undecided], skip_special_tokens=True)
        return tok.decode(new, skip_special_tokens=True), finish, decided

    def prefetch(text: str) -> Future:
        with lock:
            if text not in cache:
                cache[text] = pool.submit(compute, text)
            return cache[text]

    def generate(text: str) -> tuple[str, str, str | None]:
        return prefetch(text).result()

    generate.prefetch = prefetch
    pool = ThreadPoolExecutor(1, thread_name_prefix="reference")
    try:
        yield generate
    finally:
        pool.shutdown(cancel_futures=True)  # (what a failed test left asked for is not computed)


# -- client streams ---------------------------------------------------------------------------------


@dataclass
class Result:
    prompt: str
    start: float  # monotonic
    end: float
    text: str = ""
    finish: str | None = None
    status: int = 0  # HTTP status of the response
    error: str | None = None  # an error event in the stream, a 5xx body, or what the client saw

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish is not None


def complete(proxy: str, text: str, timeout: float = CLIENT_TIMEOUT) -> Result:
    """One streaming completion through the proxy, read to its end (or its error)."""
    host, port = proxy.removeprefix("http://").rsplit(":", 1)
    r = Result(text, time.monotonic(), 0.0)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        body = json.dumps({"prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        r.status = resp.status
        if resp.status != 200:
            err = json.loads(resp.read() or b"{}").get("error") or {}
            r.error = f"HTTP {resp.status}: {err.get('message')}"
            return r
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                r.error = f"error event: {event['error'].get('message')}"
            elif event.get("choices"):
                r.text += event["choices"][0].get("text") or ""
                r.finish = event["choices"][0].get("finish_reason") or r.finish
        if r.error is None and r.finish is None:
            r.error = "the stream ended without a finish reason"
    except OSError as e:  # (a timeout is a hang)
        r.error = f"client: {type(e).__name__}: {e}"
    finally:
        conn.close()
        r.end = time.monotonic()
    return r


class Load:
    """``STREAMS`` client streams, each sending one request after another (prompts from ``make(stream, k)``)
    until ``stop()``, or ``per_stream`` requests each; with ``reference``, each completed request's reference
    answer is asked for at once (computed in the background, for a check of every result afterwards)."""

    def __init__(self, proxy: str, make, per_stream: int | None = None, reference=None) -> None:
        self.proxy, self.make, self.per_stream, self.reference = proxy, make, per_stream, reference
        self.results: list[Result] = []
        self._started: dict[int, float] = {}  # stream -> start of its request in flight
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(s,), daemon=True) for s in range(STREAMS)]

    def start(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def _run(self, stream: int) -> None:
        k = 0
        while not self._stop.is_set() and (self.per_stream is None or k < self.per_stream):
            with self._lock:
                self._started[stream] = time.monotonic()
            r = complete(self.proxy, self.make(stream, k))
            if r.ok and self.reference is not None:
                self.reference.prefetch(r.prompt)
            with self._lock:
                del self._started[stream]
                self.results.append(r)
            k += 1

    def ended_all_started_before(self, t: float) -> bool:
        """Every request started before ``t`` has ended."""
        with self._lock:
            return all(start >= t for start in self._started.values())

    def count(self) -> int:
        with self._lock:
            return len(self.results)

    def stop(self) -> list[Result]:
        """Stop issuing requests, wait for those in flight (each ends within CLIENT_TIMEOUT), return all."""
        self._stop.set()
        for t in self._threads:
            t.join(CLIENT_TIMEOUT + 5)
        assert not any(t.is_alive() for t in self._threads), "a client stream did not end"
        return list(self.results)


EXACT_SAMPLE = 40  # completed requests a check compares with the reference at most (each costs a generate)


def spread(items: list, n: int) -> list:
    """At most ``n`` of ``items``, evenly spread over them, the first and the last included."""
    if len(items) <= n:
        return list(items)
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def check_exact(results: list[Result], reference) -> None:
    """Completed requests give the reference's tokens, up to the first step the reference calls too close for
    float32 (then its leading decided text only): all of them, or ``EXACT_SAMPLE`` spread over a long run (a
    flood or takeover test's traffic runs hundreds of distinct prompts; a transformers reference of each cost
    more than the rest of the test)."""
    for r in spread([r for r in results if r.ok], EXACT_SAMPLE):
        text, finish, decided = reference(r.prompt)
        if decided is None:
            assert (r.text, r.finish) == (text, finish), r.prompt[:40]
        else:
            assert r.text.startswith(decided), (r.prompt[:40], r.text, decided)


def run_round(cluster: OneByTwo, reference, tag: str, words: int, per_stream: int = 1) -> tuple[list[Result], float]:
    """``per_stream`` requests on each of the 8 streams; all must succeed, token-exact; (results, wall time)."""
    t0 = time.monotonic()
    results = Load(cluster.proxy, lambda s, k: prompt(f"{tag}{s}.{k}", words), per_stream, reference).start().stop()
    wall = time.monotonic() - t0
    assert [r.error for r in results if not r.ok] == []
    check_exact(results, reference)
    return results, wall


# -- a third party at a transfer listener -----------------------------------------------------------


class Helper:
    """tests/multihost/third_party.py running on a bed host; JSON lines out (and in)."""

    def __init__(self, bed, host, *args: str) -> None:
        self.proc = bed.popen(host, [sys.executable, str(Path(__file__).with_name("third_party.py")), *args],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              bufsize=0, cwd=ROOT)
        self._buf = b""

    def line(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            assert left > 0 and select.select([fd], [], [], left)[0], f"{self.proc.args[-3:]}: nothing in {timeout:g}s"
            chunk = os.read(fd, 1 << 16)
            assert chunk, f"{self.proc.args[-3:]} exited with {self.proc.wait()}"
            self._buf += chunk
        text, _, self._buf = self._buf.partition(b"\n")
        return json.loads(text)

    def ask(self, request: dict, timeout: float = 10.0) -> dict:
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        return self.line(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def segment_digest(pid: int) -> str:
    """SHA-256 of prefill worker ``pid``'s KV pool (auto keeps it in /dev/shm/xpyd-kv-<pid>-*)."""
    (path,) = Path("/dev/shm").glob(f"xpyd-kv-{pid}-*")
    return hashlib.sha256(path.read_bytes()).hexdigest()


VICTIM_WORDS = 400


def test_a_third_host_cannot_write_into_a_pool(cluster, bed, reference):
    """x knocks at the decode worker a real transfer goes to, with that transfer's own header (sniffed
    on p0's link): no MAC and a wrong MAC while the transfer is in flight, the header verbatim once it
    finished. Each is refused before a byte lands; nothing in either pool moves."""
    p0 = cluster.hosts["p0"]
    sniffer = Helper(bed, p0, "sniff", "eth0", str(KV_PORT))
    intruder = Helper(bed, cluster.hosts["x"], "knock")
    # ~200 KB of KV: ~3 s over 600 kbit/s; within one prefill chunk, so its KV moves as one transfer
    victim_prompt = prompt("victim", VICTIM_WORDS)
    try:
        assert sniffer.line(10) == {"listening": "eth0"}
        bed.shape(p0, "600kbit", burst="16kb")  # (a burst smaller than the victim's KV)
        box: list[Result] = []
        victim = threading.Thread(target=lambda: box.append(complete(cluster.proxy, victim_prompt)))
        victim.start()
        seen = sniffer.line(30)  # the header of the victim's transfer, as it left p0
        header = msgpack.unpackb(bytes.fromhex(seen["frame"])[4:], raw=False)
        target = next(n for n in ("d0", "d1") if cluster.hosts[n].ip == seen["dst"])
        address = f"{seen['dst']}:{KV_PORT}"
        before = cluster.stats(target)
        pool = segment_digest(cluster.pid("p0"))
        assert before["transfers_in_flight"] == 1 and before["transferring"] == 1, before  # the victim, in flight
        dst = door.regions(header["dst"])
        answers = {
            "no MAC": intruder.ask({"address": address, "frame": door.tcp_header(header["id"], dst, door.NO_MAC).hex(),
                                    "payload": header["total"]}),
            "the MAC does not match": intruder.ask(
                {"address": address, "frame": door.tcp_header(header["id"], dst, random.randbytes(32)).hex(),
                 "payload": header["total"]}),
        }
        assert cluster.stats(target)["transferring"] == 1  # (both knocks came while the victim was in flight)
        victim.join(CLIENT_TIMEOUT + 5)
        (result,) = box
        assert result.ok, result
        check_exact([result], reference)
        answers["unexpected transfer id"] = intruder.ask({"address": address, "frame": seen["frame"],
                                                          "payload": header["total"]})  # a replay
        for needle, answer in answers.items():
            (reply,) = answer["replies"]
            assert reply["ok"] is False and needle in reply["error"] and answer["hung_up"], (needle, answer)
        after = cluster.stats(target)
        assert after["kv_backend"]["refused"] == before["kv_backend"]["refused"] + 3
        assert segment_digest(cluster.pid("p0")) == pool  # the prefill pool, byte for byte
        assert after["blocks_used"] == after["transfers_in_flight"] == 0
    finally:
        bed.unshape(p0)
        sniffer.close()
        intruder.close()
    # The decode pool: the victim's blocks stayed cached there; a follow-up reuses them instead of pulling.
    follow_up = victim_prompt + " and then"
    reused = cluster.stats(target)["kv_reused_blocks"]
    wait_until(lambda: cluster.listed()[cluster.urls[target]]["cache"]["indexed_blocks"] >= VICTIM_WORDS // 16, 10,
               "the proxy to learn which blocks the victim left cached on its decode worker")
    r = complete(cluster.proxy, follow_up)
    assert r.ok, r
    check_exact([r], reference)
    assert cluster.stats(target)["kv_reused_blocks"] > reused  # (cache-aware routing sent it to that worker)


# -- loss -------------------------------------------------------------------------------------------


def test_five_percent_loss_on_the_prefill_and_a_decode_host(cluster, bed, reference):
    p0, d0 = cluster.hosts["p0"], cluster.hosts["d0"]
    _, clean = run_round(cluster, reference, "clean", 300, per_stream=3)
    try:
        bed.loss(p0, 5)
        bed.loss(d0, 5)
        _, lossy = run_round(cluster, reference, "lossy", 300, per_stream=3)
    finally:
        bed.no_loss(p0)
        bed.no_loss(d0)
    print(f"\n24 requests on 8 streams: {clean:.2f}s clean, {lossy:.2f}s with 5% loss on p0 and d0 "
          f"({lossy / clean:.2f}x)")
    wait_until(lambda: idle(cluster), 10, "every worker idle after the lossy round")


# -- the P-D link cut -------------------------------------------------------------------------------

CUT_RATE = "4mbit"  # 0.5 MB/s: 800 tokens of KV (400 KB) take 0.8 s alone, seconds when 8 share the link
CUT_WORDS = 800
# A request the cut hits fails when its decode worker gives up on p0: p0 answers nothing within the signal
# plane's deadline (or the KV is not there by --prefill-wait-timeout, if that is shorter).
FAIL_BOUND = min(SIGNAL_TIMEOUT, PREFILL_WAIT) + 3.0  # from the cut (or the request's start, if later)
POOL_BOUND = KV_TTL + PEER_TIMEOUT  # from the last request's end to every pool empty, link still cut


@pytest.mark.timeout(600)  # (every request now completes and is checked against the reference: more to compute)
def test_the_pd_link_cut_during_kv_transfers(cluster, bed, reference):
    p0, d0 = cluster.hosts["p0"], cluster.hosts["d0"]
    failed_recv = metric(cluster.urls["d0"], "xpyd_kv_transfers_total", direction="recv", outcome="failed")
    failed_send = metric(cluster.urls["p0"], "xpyd_kv_transfers_total", direction="send", outcome="failed")
    bed.shape(p0, CUT_RATE)
    load = Load(cluster.proxy, lambda s, k: prompt(f"cut{s}.{k}", CUT_WORDS), reference=reference).start()
    try:
        wait_until(lambda: cluster.stats("d0")["transferring"] > 0 and cluster.stats("p0")["transfers_in_flight"] > 0,
                   30, "KV moving from p0 to d0")
        bed.cut(p0, d0)
        t_cut = time.monotonic()
        # (they move on to another pair once their KV path failed, then decode to their end there)
        wait_until(lambda: load.ended_all_started_before(t_cut), FAIL_BOUND + 60,
                   "the requests in flight at the cut ended")
        results = load.stop()  # (and those that started since, under the cut)
        t_end = time.monotonic()
        wait_until(lambda: idle(cluster), POOL_BOUND, "every pool empty while p0-d0 is still cut")
        emptied = time.monotonic() - t_cut
        # The proxy heard from d0 that it cannot reach p0 (kv_path): while the link is cut, it routes
        # around the pair, to d1; nothing fails, though p0 and d0 are both healthy in its view.
        before = cluster.received("d0"), cluster.received("d1")
        run_round(cluster, reference, "around.", 100)
        assert cluster.received("d0") == before[0] and cluster.received("d1") > before[1]
        view = get(cluster.proxy + "/cluster")
        (avoided,) = view["avoided_pairs"]
        assert (avoided["prefill"], avoided["decode"]) == (cluster.urls["p0"], cluster.urls["d0"]), avoided
        assert all(w["health"] == "up" for w in view["workers"]), view["workers"]
    finally:
        load.stop()
        bed.heal(p0, d0)
        bed.unshape(p0)
    failed = [r for r in results if not r.ok]
    print(f"\ncut: {len(results)} requests, {len(failed)} failed, errors "
          f"{sorted(round(r.end - max(r.start, t_cut), 1) for r in failed)} s after the cut (or their start); "
          f"pools empty {emptied:.1f}s after the cut ({time.monotonic() - t_end:.1f}s after the last request)")
    # The requests whose KV was crossing the cut moved on to another pair (the proxy's migration, or a start over
    # for one whose client had nothing yet): none failed, and every answer is the reference's.
    assert not failed, [(r.error, r.end - t_cut) for r in failed]
    check_exact(results, reference)
    assert metric(cluster.urls["d0"], "xpyd_kv_transfers_total", direction="recv", outcome="failed") > failed_recv
    assert metric(cluster.urls["p0"], "xpyd_kv_transfers_total", direction="send", outcome="failed") > failed_send

    # Healed: requests succeed again, d0 among the decode workers that serve them (once the pair's
    # cool-down has passed).
    served = cluster.received("d0")
    deadline = time.monotonic() + PAIR_COOLDOWN + 15
    while cluster.received("d0") == served:
        assert time.monotonic() < deadline, "d0 served nothing within the cool-down + 15s of the heal"
        run_round(cluster, reference, f"healed{int(time.monotonic() * 1000)}.", 100)


# -- a decode host cut off from etcd -----------------------------------------------------------------


@pytest.mark.timeout(600)  # (its reference answers are computed on a loaded 2-core machine: a hang guard, not a bound)
def test_a_decode_host_cut_off_from_etcd_drains_and_comes_back(cluster, bed, reference):
    d0, etcd = cluster.hosts["d0"], cluster.hosts["etcd"]
    d0_url = cluster.urls["d0"]
    load = Load(cluster.proxy, lambda s, k: prompt(f"etcd{s}.{k}", 200)).start()
    try:
        wait_until(lambda: cluster.stats("d0")["requests_held"] > 0, 20, "d0 serving")
        bed.cut(d0, etcd)
        t_cut, at_cut = time.monotonic(), cluster.received("d0")
        wait_until(lambda: d0_url not in cluster.listed(), LEASE_TTL + 5, "the proxy to drop d0 (lease expired)")
        t_gone = time.monotonic()
        gone = t_gone - t_cut
        assert cluster.received("d0") > at_cut  # it served on until its lease expired
        # Drained: every request started before the proxy dropped d0 has ended (one routed to d0 just before
        # may still be on its way there when d0 first reports nothing held), and d0 holds nothing.
        wait_until(lambda: load.ended_all_started_before(t_gone), CLIENT_TIMEOUT,
                   "the requests started before d0 was dropped")
        wait_until(lambda: cluster.stats("d0")["requests_held"] == 0, CLIENT_TIMEOUT, "d0 drained")
        drained = time.monotonic() - t_cut
        before = cluster.received("d0"), cluster.received("d1")
        wait_until(lambda: cluster.received("d1") >= before[1] + 2 * STREAMS, 30, "d1 serving while d0 is out")
        results = load.stop()
        assert cluster.received("d0") == before[0]  # no request went to d0 meanwhile
    finally:
        load.stop()
        bed.heal(d0, etcd)
    print(f"\netcd cut: d0 gone from the proxy {gone:.1f}s after the cut, drained after {drained:.1f}s; "
          f"{len(results)} requests, {sum(not r.ok for r in results)} failed")
    assert [r.error for r in results if not r.ok] == []  # in flight on d0 when it left: finished there
    check_exact(results, reference)
    wait_until(lambda: d0_url in cluster.listed(), 15, "d0 registered again after the heal")
    served = cluster.received("d0")
    deadline = time.monotonic() + 30
    while cluster.received("d0") == served:
        assert time.monotonic() < deadline, "d0 served nothing within 30s of registering again"
        run_round(cluster, reference, f"back{int(time.monotonic() * 1000)}.", 100)
