"""A decode worker in an etcd cluster without a cluster token follows a request id only to a prefill worker
registered in etcd (real etcd, real workers; xpyd.worker.request_gate.PrefillPeers fed by the worker's watch).

An id naming an address nobody registered is refused (403) and nothing connects there; once a prefill worker
registers that address, the same kind of id is followed to it; a registered real prefill worker serves.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port, wait_until
from xpyd import PROTOCOL_VERSION
from xpyd.discovery.etcd import EtcdRegistration
from xpyd.discovery.status import fetch_workers
from xpyd.discovery.types import Role, WorkerInfo
from xpyd.signal.request_id import RequestId

BODY = {"prompt": "hello world", "max_tokens": 4, "temperature": 0}


def _call(url: str, body: dict | None = None, rid: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"X-Request-Id": rid} if rid else {})}
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _listener() -> tuple[socket.socket, str]:
    sock = socket.create_server(("127.0.0.1", 0), backlog=8)
    return sock, f"127.0.0.1:{sock.getsockname()[1]}"


def _connected(sock: socket.socket, timeout: float = 0.0) -> bool:
    return bool(select.select([sock], [], [], timeout)[0])


@pytest.fixture
def cluster(etcd, tmp_path: Path, tiny_model_dir: Path):
    c = Cluster(tmp_path)
    common = ["--model", str(tiny_model_dir), "--dtype", "float32", "--threads", "1", "--max-model-len", "256",
              "--batch-size", "2", "--etcd", etcd.endpoint]
    pp, ps, dp = free_port(), free_port(), free_port()
    urls = {"prefill": f"http://127.0.0.1:{pp}", "signal": f"127.0.0.1:{ps}", "decode": f"http://127.0.0.1:{dp}"}
    c.start("prefill", ["prefill", *common, "--port", str(pp), "--signal-port", str(ps)], urls["prefill"])
    c.start("decode", ["decode", *common, "--port", str(dp), "--kv-port", str(free_port())], urls["decode"])
    try:
        c.wait_healthy()
        wait_until(lambda: len(asyncio.run(fetch_workers(etcd.endpoint))) == 2, 30, "both workers registered")
        yield urls
    finally:
        c.stop()


def test_decode_follows_ids_only_to_prefill_workers_registered_in_etcd(cluster, etcd):
    decode = cluster["decode"]
    dinfo = _call(decode + "/xpyd/info")[1]
    stranger, addr = _listener()
    try:
        status, body = _call(decode + "/v1/completions", BODY, str(RequestId.new(addr, dinfo["signal_addr"])))
        assert status == 403 and addr in body["error"]["message"], body
        assert not _connected(stranger)

        async def register() -> EtcdRegistration:
            info = WorkerInfo(Role.PREFILL, f"http://{addr}", addr, dinfo["model_id"], PROTOCOL_VERSION, 2)
            reg = EtcdRegistration(etcd.endpoint, info, ttl=5)
            await reg.start()
            return reg

        loop = asyncio.new_event_loop()
        reg = loop.run_until_complete(register())
        try:  # now registered: followed (nobody answers there; the request fails later, we do not wait)
            rid = str(RequestId.new(addr, dinfo["signal_addr"]))
            threading.Thread(target=_call, args=(decode + "/v1/completions", BODY, rid), daemon=True).start()
            assert _connected(stranger, timeout=30), "the decode worker did not follow the registered address"
        finally:
            loop.run_until_complete(reg.close())
            loop.close()
    finally:
        stranger.close()


def test_a_registered_prefill_worker_serves(cluster):
    dinfo = _call(cluster["decode"] + "/xpyd/info")[1]
    rid = str(RequestId.new(cluster["signal"], dinfo["signal_addr"]))
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("d", _call(
        cluster["decode"] + "/v1/completions", {**BODY, "kv_transfer_params": {"role": "decode"}}, rid)))
    t.start()
    ps, pbody = _call(cluster["prefill"] + "/v1/completions",
                      {**BODY, "max_tokens": 1, "kv_transfer_params": {"role": "prefill", "max_tokens": 4}}, rid)
    t.join(60)
    assert ps == 200 and out["d"][0] == 200, (pbody, out["d"])
    assert out["d"][1]["usage"]["completion_tokens"] == 4
