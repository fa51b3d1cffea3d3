"""A hostile host on the bed's network tries every door of a cluster with a cluster token, while real traffic runs.

One dynamic cluster (etcd, the proxy, p0, d0 on their own namespace hosts; d1 joins during the sniffing test),
the cluster token on every worker and on the proxy, and a host ``mallory`` that belongs to nobody
(``third_party.py mallory``, run there). While client streams run through the proxy (a few threads, bounded in
requests and time), mallory:

- forges request ids at the decode worker's HTTP API, naming its own address as the prefill worker (unsigned, a
  wrong MAC, a real MAC moved onto its address; no bearer, a wrong one, the real one a sniffer reads): each is
  refused (401 without the bearer, 403 with it), and nothing ever connects to mallory's listener;
- opens signal-plane sessions at the prefill worker as the real decode worker (its signal address and other
  guesses as ZMQ routing id; no token, or a proof it cannot make) and sends handshake, kv_map_init, claims and
  pulls of real requests in flight, releases and heartbeats: each gets exactly one refusal, never a notify,
  a lookup answer or a byte of KV;
- reads the handshake of a decode worker that joins while ``tcpdump`` captures everything on the bed's switch
  (the bridge: every frame between every two hosts) and replays the decode worker's bytes: the capture holds no
  form of the token, the replay opens no session;
- floods the decode worker's transfer listener with idle connections: the listener closes each within its
  deadline, nothing mallory sent lands, the real transfers go on.

Every real request completes token-exact (against transformers), and afterwards no worker holds a request, a KV
block or a transfer.

What a sniffer on the workers' network does get: the HTTP calls from the proxy to the workers are plain HTTP and
carry the credential derived from the token (``Authorization: Bearer <ClusterKeys.http_bearer>``) and signed
request ids. With them it can call the workers' APIs as the proxy does, with ids the proxy signed (it cannot sign
another: the MAC covers the whole id); it cannot join the signal plane or open a transfer. The README says to keep
the workers' network private for that reason; ``test_a_sniffer_reads_no_token_and_a_replayed_handshake_opens_nothing``
asserts exactly this split.
"""

from __future__ import annotations

import base64
import re
import secrets
import select
import shutil
import signal as signals
import subprocess
import threading
import time
from pathlib import Path

import pytest
from test_network_faults import (IDLE_KEYS, Helper, Result, check_exact, complete, get, prompt,  # noqa: F401
                                 reference)  # (reference: a fixture)
from testbed import EtcdOnHost
from third_party import tcp_streams, zmtp_messages

from tests import door
from tests.cluster import Cluster, wait_until
from tests.request_log import dispatches
from xpyd import TRANSFER_SECRET_BYTES
from xpyd.signal import messages as m
from xpyd.signal.request_id import ClusterKeys, RequestId
from xpyd.transfer.base import Region

PREFILL_PORT, SIGNAL_PORT, DECODE_PORT, KV_PORT, PROXY_PORT = 8100, 8101, 8200, 8201, 8000
TRAP_PORT = 8101  # mallory's "prefill signal plane", the address its forged ids name
TOKEN = "hostile-bed-" + secrets.token_hex(16)
KEYS = ClusterKeys(TOKEN)
STREAMS = 3  # client threads of real traffic
MAX_PER_STREAM = 1000  # requests a thread sends at most (about 30 a second go through, all threads together)
MAX_SECONDS = 90.0  # ... and for at most this long
WORDS = 120  # prompt length of the real traffic (words; ~1.3 tokens each)
ZMTP_GREETING = 64  # bytes
DOOR_DEADLINE = 1.0  # the listener's promise (docs/transfer.md): a connection proves itself within ~1 s
CLOSE_BOUND = DOOR_DEADLINE + 4.0  # an idle connection's life at the listener (its deadline + scheduling on 2 cores)


# -- the cluster ------------------------------------------------------------------------------------


class Hostile:
    """etcd, the proxy, p0, d0 (and d1, started by a test) on their own hosts; mallory on the bed too."""

    def __init__(self, bed, workdir: Path) -> None:
        self.bed, self.workdir = bed, workdir
        self.hosts = {n: bed.add_host(n) for n in ("etcd", "proxy", "p0", "d0", "d1", "mallory")}
        self.etcd = EtcdOnHost(bed, self.hosts["etcd"], workdir)
        self.c = Cluster(workdir)
        self.urls: dict[str, str] = {}
        self.proxy = f"http://{self.hosts['proxy'].ip}:{PROXY_PORT}"
        self.model: Path | None = None

    def start(self, model: Path) -> None:
        self.model = model
        self.etcd.start()
        self.start_worker("p0")
        self.start_worker("d0")
        self.c.start("proxy", ["proxy", "--host", self.hosts["proxy"].ip, "--port", str(PROXY_PORT),
                               "--etcd", self.etcd.endpoint, "--log-requests"], self.proxy,
                     env={"XPYD_CLUSTER_TOKEN": TOKEN}, wrap=self.wrap("proxy"))
        self.c.wait_healthy()
        wait_until(lambda: len(self.listed()) == 2, 20, "the proxy to discover p0 and d0 in etcd")

    def start_worker(self, name: str) -> None:
        h = self.hosts[name]
        if name.startswith("p"):
            role, port, extra = "prefill", PREFILL_PORT, ["--signal-port", str(SIGNAL_PORT)]
        else:
            role, port, extra = "decode", DECODE_PORT, ["--kv-port", str(KV_PORT)]
        args = [role, "--model", str(self.model), "--dtype", "float32", "--threads", "1", "--max-model-len", "1024",
                "--batch-size", "8", "--host", h.ip, "--port", str(port), "--etcd", self.etcd.endpoint, *extra]
        self.urls[name] = self.c.start(name, args, f"http://{h.ip}:{port}", env={"XPYD_CLUSTER_TOKEN": TOKEN},
                                       wrap=self.wrap(name)).url

    def wrap(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[host].ns]

    def stop(self) -> None:
        self.c.stop()
        self.etcd.stop()

    def listed(self) -> dict[str, dict]:
        return {w["http_url"]: w for w in get(self.proxy + "/cluster")["workers"]}

    def signal_addr(self, name: str) -> str:
        return self.listed()[self.urls[name]]["signal_addr"]

    def stats(self, name: str) -> dict:
        return get(self.urls[name] + "/xpyd/stats", {"Authorization": f"Bearer {KEYS.http_bearer}"})

    def received(self, name: str) -> int:
        return self.stats(name)["kv_backend"]["received"].get("tcp", 0)

    def workers(self) -> list[str]:
        return [n for n in ("p0", "d0", "d1") if n in self.urls]

    def idle(self) -> bool:
        return all(self.stats(n)[k] == 0 for n in self.workers() for k in IDLE_KEYS)

    def internal_ids(self) -> list[str]:
        """The workers' ids of the requests the proxy dispatched so far (its --log-requests lines), newest last."""
        text = next(p for p in self.c.procs if p.name == "proxy").log.read_text(errors="replace")
        return [str(rid) for ids in dispatches(text).values() for rid in ids]


@pytest.fixture(scope="module")
def hostile(bed, tmp_path_factory, tiny_long_model_dir: Path):
    c = Hostile(bed, tmp_path_factory.mktemp("hostile-host"))
    try:
        c.start(tiny_long_model_dir)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def mallory(hostile, bed):
    m_ = Helper(bed, hostile.hosts["mallory"], "mallory")
    try:
        assert m_.ask({"op": "trap", "port": TRAP_PORT}) == {"trapping": TRAP_PORT}
        yield m_
    finally:
        m_.close()


# -- real traffic -----------------------------------------------------------------------------------


class Traffic:
    """``STREAMS`` client threads through the proxy, each sending streaming completions one after another
    until ``stop()`` (at most ``MAX_PER_STREAM`` each, for at most ``MAX_SECONDS``); every one must complete
    token-exact."""

    def __init__(self, cluster: Hostile, tag: str) -> None:
        self.cluster, self.tag = cluster, tag
        self.results: list[Result] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(s,), daemon=True) for s in range(STREAMS)]

    def __enter__(self) -> "Traffic":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self, stream: int) -> None:
        end = time.monotonic() + MAX_SECONDS
        for k in range(MAX_PER_STREAM):
            if self._stop.is_set() or time.monotonic() > end:
                return
            r = complete(self.cluster.proxy, prompt(f"{self.tag}{stream}.{k}", WORDS))
            with self._lock:
                self.results.append(r)

    def count(self) -> int:
        with self._lock:
            return len(self.results)

    def stop(self) -> list[Result]:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        assert not any(t.is_alive() for t in self._threads), "a client stream did not end"
        return list(self.results)


def all_exact(results: list[Result], reference) -> None:
    assert results, "no real request ran"
    assert [r.error for r in results if not r.ok] == []
    check_exact(results, reference)


# -- 1. a forged request id -------------------------------------------------------------------------


def test_a_forged_request_id_is_refused_before_the_decode_worker_connects_anywhere(hostile, mallory, reference):
    mallory_addr = f"{hostile.hosts['mallory'].ip}:{TRAP_PORT}"
    d0_sig, p0_sig = hostile.signal_addr("d0"), hostile.signal_addr("p0")
    real = KEYS.sign(str(RequestId.new(p0_sig, d0_sig)))  # an id the proxy signed (the MAC is over all of it)
    forged = str(RequestId.new(mallory_addr, d0_sig))
    moved = forged + real[real.index("~m~"):]  # the real MAC, on an id naming mallory
    wrong = forged + "~m~" + secrets.token_hex(32)
    sniffed = {"Authorization": f"Bearer {KEYS.http_bearer}"}  # what a sniffer reads off the proxy's calls
    tries = {  # (headers, id) -> the status it must get
        "unsigned, no bearer": ({}, forged, 401),
        "unsigned, a wrong bearer": ({"Authorization": "Bearer " + secrets.token_hex(32)}, forged, 401),
        "a moved MAC, no bearer": ({}, moved, 401),
        "a moved MAC, the token as bearer": ({"Authorization": f"Bearer {TOKEN}"}, moved, 401),
        "unsigned, the sniffed bearer": (sniffed, forged, 403),
        "a wrong MAC, the sniffed bearer": (sniffed, wrong, 403),
        "a moved MAC, the sniffed bearer": (sniffed, moved, 403),
    }
    body = {"prompt": prompt("forged", 40), "max_tokens": 4, "temperature": 0, "stream": True}
    with Traffic(hostile, "forge") as traffic:
        wait_until(lambda: traffic.count() >= STREAMS, 60, "real requests completing")
        answers = {what: mallory.ask({"op": "post", "url": hostile.urls["d0"] + "/v1/completions",
                                      "headers": {**headers, "X-Request-Id": rid}, "body": body})
                   for what, (headers, rid, _) in tries.items()}
        served = traffic.count()
        wait_until(lambda: traffic.count() >= served + STREAMS, 60, "real requests completing after the forgeries")
        results = traffic.stop()
    for what, (_, _, status) in tries.items():
        assert answers[what].get("status") == status, (what, answers[what])
    assert mallory.ask({"op": "caught"}) == {"peers": [], "bytes": 0}  # the decode worker never connected
    all_exact(results, reference)


# -- 2. a routing-id takeover -----------------------------------------------------------------------


def takeover_frames(sender: str, ids: list[str], mallory_kv: str) -> list[m.Message]:
    """What a stranger speaking as decode worker ``sender`` sends once past the hello: everything a session
    does, with real requests' ids (claims, pulls into mallory's pool, releases)."""
    pull = [m.LookupEntry(i, dest_blocks=(0, 1, 2), secret=secrets.token_bytes(TRANSFER_SECRET_BYTES)) for i in ids]
    return [
        m.Handshake(sender, "tiny", {}),
        m.KVMapInit(sender, {"backend": "tcp", "address": mallory_kv, "buffer_size": 1 << 24}, 4096, 64),
        m.LookupAll(sender, tuple(m.LookupEntry(i) for i in ids)),
        m.LookupAll(sender, tuple(pull)),
        m.Release(sender, tuple(ids)),
        m.Heartbeat(sender),
    ]


REFUSED = [{"type": "error", "seq": 10 + i, "ok": None, "error": "handshake first"} for i in range(6)]


def try_takeover(cluster: Hostile, mallory, as_decode: str, routing_id: bytes | None, claim: bool) -> list[dict]:
    """mallory at p0's signal plane as decode worker ``as_decode`` (a signal address), with ``routing_id``
    (None: the ROUTER names the connection), saying it proves the token (``claim``) or not; what came back."""
    ids = cluster.internal_ids()[-2 * STREAMS:]  # the newest dispatches: some are in flight now
    mallory_kv = f"{cluster.hosts['mallory'].ip}:{TRAP_PORT}"
    frames = [m.encode(10 + i, msg).hex() for i, msg in enumerate(takeover_frames(as_decode, ids, mallory_kv))]
    answer = mallory.ask({"op": "signal", "address": cluster.signal_addr("p0"), "sender": as_decode,
                          "routing_id": None if routing_id is None else routing_id.hex(), "claim_token": claim,
                          "frames": frames, "wait": 0.5}, timeout=30)
    return answer["received"]


def assert_refused(received: list[dict], claim: bool, what: str) -> None:
    """One refusal for the hello (or a challenge, then one for the proof) and one for each message after it:
    no notify, no lookup answer, no session."""
    if claim:  # p0 proves the token first; mallory's proof is wrong
        assert [a["type"] for a in received[:1]] == ["challenge"], (what, received)
        opening = [{"type": "auth_reply", "seq": 2, "ok": False, "error": "cluster token mismatch"}]
        received = received[1:]
    else:
        opening = [{"type": "handshake_reply", "seq": 1, "ok": False,
                    "error": "cluster token required (set --cluster-token / XPYD_CLUSTER_TOKEN on the decode worker)"}]
    assert received == opening + REFUSED, (what, claim, received)


def test_a_stranger_with_the_decode_workers_routing_id_gets_nothing(hostile, mallory, reference):
    d0_sig = hostile.signal_addr("d0")
    guesses = {"d0's signal address": d0_sig.encode(), "d0's HTTP address": hostile.urls["d0"][7:].encode(),
               "the ROUTER's own naming": None, "a short one": b"\x01", "a 5-byte one": b"\x01\x00\x00\x00\x01"}
    before = hostile.received("d0")
    with Traffic(hostile, "takeover") as traffic:
        wait_until(lambda: traffic.count() >= STREAMS, 60, "real requests completing")
        # (each routing id once per round: a ROUTER drops a connection whose routing id another one holds, and
        # mallory's previous one may not have been reaped yet)
        answers = {(what, claim): try_takeover(hostile, mallory, d0_sig, rid, claim)
                   for claim in (False, True) for what, rid in guesses.items()}
        served = traffic.count()
        wait_until(lambda: traffic.count() >= served + STREAMS, 60, "real requests completing after the takeovers")
        results = traffic.stop()
    print(f"\ntakeover: {len(answers)} sessions tried during {len(results)} real requests")
    for (what, claim), received in answers.items():
        assert_refused(received, claim, what)
    assert mallory.ask({"op": "caught"}) == {"peers": [], "bytes": 0}  # no KV came to mallory's "pool"
    all_exact(results, reference)
    assert hostile.received("d0") > before  # the real decode worker's own requests went on


# -- 3. sniffing the handshake ----------------------------------------------------------------------


def forms(secret: str) -> dict[str, bytes]:
    raw = secret.encode()
    return {"bytes": raw, "hex": raw.hex().encode(), "HEX": raw.hex().upper().encode(),
            "base64": base64.b64encode(raw).rstrip(b"="), "urlsafe base64": base64.urlsafe_b64encode(raw).rstrip(b"=")}


def test_a_sniffer_reads_no_token_and_a_replayed_handshake_opens_nothing(hostile, mallory, bed, reference, tmp_path):
    if shutil.which("tcpdump") is None:
        pytest.skip("tcpdump is not installed (apt-get install -y tcpdump)")
    pcap = tmp_path / "switch.pcap"
    # Everything on the bed's switch: the bridge in promiscuous mode sees every frame between every two hosts.
    dump = subprocess.Popen(["ip", "netns", "exec", bed.switch_ns, "tcpdump", "-i", "br0", "-n", "-U", "-s", "0",
                             "-w", str(pcap), "tcp"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        ready, _, _ = select.select([dump.stderr], [], [], 10)
        assert ready and b"listening on" in dump.stderr.readline(), "tcpdump did not start listening"
        hostile.start_worker("d1")  # a decode worker that joins (and shakes hands) while the capture runs
        hostile.c.wait_healthy()
        wait_until(lambda: hostile.urls["d1"] in hostile.listed(), 20, "the proxy to discover d1")
        d1_sig = hostile.signal_addr("d1")
        with Traffic(hostile, "sniff") as traffic:
            wait_until(lambda: hostile.received("d1") >= 2, 60, "d1 serving (its session with p0 open)")
            # Right after d1's session opened, mallory tries to take it over as d1.
            takeover = try_takeover(hostile, mallory, d1_sig, d1_sig.encode(), claim=True)
            served = hostile.received("d1")
            wait_until(lambda: hostile.received("d1") >= served + 2, 60, "d1 serving after the takeover")
            results = traffic.stop()
    finally:
        dump.send_signal(signals.SIGTERM)
        dump.wait(10)
    summary = dump.stderr.read().decode(errors="replace")
    assert re.search(r"^0 packets dropped by kernel$", summary, re.M), summary  # (what the checks read is all)
    assert_refused(takeover, True, "d1's address, right after d1 joined")
    all_exact(results, reference)
    streams = tcp_streams(pcap.read_bytes())
    p0, d1 = hostile.hosts["p0"].ip, hostile.hosts["d1"].ip
    # No form of the token anywhere on the wire; on the signal plane not even the HTTP credential.
    wire = b"".join(streams.values())
    signal_plane = b"".join(data for f, data in streams.items() if SIGNAL_PORT in (f[1], f[3]))
    for what, needle in forms(TOKEN).items():
        assert needle not in wire, f"the token's {what} is on the wire"
    assert KEYS.http_bearer.encode() not in signal_plane
    (client_flow,) = [f for f in streams if f[0] == d1 and f[2:] == (p0, SIGNAL_PORT)]
    server = streams[(p0, SIGNAL_PORT, d1, client_flow[1])]
    said = [m.decode(b).msg for b in zmtp_messages(streams[client_flow])]
    heard = [m.decode(b).msg for b in zmtp_messages(server)]
    # The capture holds d1's whole handshake: its hello, p0's challenge, its proof, and the session opening.
    assert isinstance(said[0], m.Hello) and said[0].sender == d1_sig and said[0].token, said[:1]
    assert isinstance(said[1], m.Proof) and said[1].proof is not None
    assert isinstance(heard[0], m.Challenge) and heard[0].proof is not None
    assert heard[1] == m.AuthReply(True)
    # What a sniffer does get: the proxy's calls to the workers carry the HTTP credential (a key derived from
    # the token, not the token) and signed request ids.
    http = b"".join(data for f, data in streams.items() if f[0] == hostile.hosts["proxy"].ip)
    assert f"Authorization: Bearer {KEYS.http_bearer}".lower().encode() in http.lower()
    assert re.search(rb"X-Request-Id: xpyd-[0-9a-f]{32}~p~\S+~d~\S+~m~[0-9a-f]{64}", http, re.I)
    assert KEYS.http_bearer != TOKEN and TOKEN not in KEYS.http_bearer

    # mallory replays d1's bytes verbatim (its ZMTP greeting, then the rest once p0 greeted back): p0 challenges
    # with a fresh nonce, the old proof fails it, and everything after is refused.
    recorded = streams[client_flow]
    answer = mallory.ask({"op": "replay", "address": f"{p0}:{SIGNAL_PORT}", "wait": 1.0,
                          "chunks": [recorded[:ZMTP_GREETING].hex(), recorded[ZMTP_GREETING:].hex()]}, timeout=30)
    replies = [m.decode(b) for b in zmtp_messages(bytes.fromhex(answer["received"]))]
    assert isinstance(replies[0].msg, m.Challenge) and replies[0].msg.nonce != heard[0].nonce, replies[:1]
    assert replies[1].msg == m.AuthReply(False, "cluster token mismatch"), replies[1:2]
    assert {type(r.msg) for r in replies[2:]} <= {m.ErrorReply}, replies[2:]
    assert all(r.msg.error == "handshake first" for r in replies[2:]), replies[2:]
    assert len(replies) == len(said)  # (one answer per replayed message, each a refusal after the first two)


# -- 4. flooding the transfer listener --------------------------------------------------------------

FLOOD_HOLD = 32  # idle connections mallory keeps open: twice what one source may have pending (16, docs/transfer.md)
FLOOD_SECONDS = 5.0


def test_idle_connections_at_a_transfer_listener_are_closed_and_real_transfers_go_on(hostile, mallory, reference):
    d0 = hostile.hosts["d0"].ip
    partial = door.tcp_header("xpyd-" + "0" * 32, [Region(0, 4096)], bytes(32))[:20]  # half a header
    before = hostile.stats("d0")["kv_backend"]
    received = hostile.received("d0")
    with Traffic(hostile, "flood") as traffic:
        wait_until(lambda: traffic.count() >= STREAMS, 60, "real requests completing")
        flood = mallory.ask({"op": "flood", "address": f"{d0}:{KV_PORT}", "hold": FLOOD_HOLD,
                             "seconds": FLOOD_SECONDS, "openings": ["", partial.hex()], "pace": 0.02,
                             "bound": CLOSE_BOUND}, timeout=FLOOD_SECONDS + CLOSE_BOUND + 30)
        results = traffic.stop()
    all_exact(results, reference)
    assert hostile.received("d0") > received  # transfers landed on d0 during the flood
    print(f"\nflood: {flood['opened']} connections, lives {min(flood['lives']):.2f}-{max(flood['lives']):.2f}s, "
          f"{flood['refused']} refused at connect; {len(results)} real requests")
    assert flood["opened"] > FLOOD_HOLD and flood["still_open"] == 0  # every one closed by the listener
    assert len(flood["lives"]) == flood["opened"] and max(flood["lives"]) <= CLOSE_BOUND, flood["lives"]
    assert flood["received"] == 0  # it answered nothing to what mallory sent
    after = hostile.stats("d0")["kv_backend"]
    assert after.get("refused") == before.get("refused")  # nothing mallory sent was taken for a transfer
    assert "unproven" in after, f"/xpyd/stats kv_backend does not count the connections closed at the door: {after}"
    assert after["unproven"] - before.get("unproven", 0) == flood["opened"]


# -- afterwards -------------------------------------------------------------------------------------


def test_no_worker_holds_anything_afterwards(hostile):
    """(last) No request, no KV block (cached ones aside) and no transfer left on any worker."""
    wait_until(hostile.idle, 15, "every worker idle")
