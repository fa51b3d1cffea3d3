"""etcd discovery against real etcd servers: LocalEtcd, EtcdRegistration, EtcdRegistry, `xpyd status`."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

import aetcd
import pytest

from xpyd import PROTOCOL_VERSION
from xpyd.discovery import status
from xpyd.discovery.base import RegistryError
from xpyd.discovery.etcd import EtcdRegistration, EtcdRegistry, worker_key
from xpyd.discovery.etcd_common import connect
from xpyd.discovery.local_etcd import LocalEtcd
from xpyd.discovery.types import Role, WorkerInfo

TTL = 2  # etcd's minimum


def make_info(role: Role, port: int, model: str = "m", version: int = PROTOCOL_VERSION) -> WorkerInfo:
    return WorkerInfo(role=role, http_url=f"http://127.0.0.1:{port}", signal_addr=f"127.0.0.1:{port + 1}",
                      model_id=model, protocol_version=version, capacity=8)


@asynccontextmanager
async def etcd_client(endpoint: str):
    """Another client, playing an operator or a second process."""
    client = connect(endpoint)
    try:
        yield client
    finally:
        await client.close()


async def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll every 5 ms; returns the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.005)
    return time.monotonic() - start


async def get_value(client: aetcd.Client, key: str) -> bytes | None:
    kv = await client.get(key.encode())
    return None if kv is None else kv.value


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- LocalEtcd ---------------------------------------------------------------------------


async def test_local_etcd_restart_keeps_endpoint_and_data() -> None:
    server = LocalEtcd()  # temp data dir
    endpoint = server.start()
    data_dir = server.data_dir
    assert endpoint == server.endpoint and (data_dir / "etcd.log").is_file()
    async with etcd_client(endpoint) as c:
        await c.put(b"/k", b"v")
    assert server.restart() == endpoint
    async with etcd_client(endpoint) as c:
        assert await get_value(c, "/k") == b"v"
    server.kill()
    assert not server.running and server.start() == endpoint
    server.stop()
    server.stop()  # idempotent
    assert not data_dir.exists()


# --- EtcdRegistration --------------------------------------------------------------------


def test_worker_key_from_http_url() -> None:
    assert worker_key(make_info(Role.DECODE, 8200)) == "/workers/decode/127.0.0.1/8200"
    bad = WorkerInfo(Role.PREFILL, "127.0.0.1:8100", "127.0.0.1:8101", "m", PROTOCOL_VERSION, 1)
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        worker_key(bad)
    with pytest.raises(ValueError, match="ttl"):
        EtcdRegistration("127.0.0.1:2379", make_info(Role.PREFILL, 8100), ttl=1)
    with pytest.raises(ValueError, match="HOST:PORT"):
        EtcdRegistration("127.0.0.1", make_info(Role.PREFILL, 8100))
    with pytest.raises(ValueError, match="HOST:PORT"):
        EtcdRegistry("localhost:notaport")


async def test_registration_refresh_and_close(etcd: LocalEtcd) -> None:
    info = make_info(Role.PREFILL, 8100)
    reg = EtcdRegistration(etcd.endpoint, info, ttl=TTL)
    await reg.start()
    assert reg.registered
    async with etcd_client(etcd.endpoint) as c:
        kv = await c.get(worker_key(info).encode())
        assert WorkerInfo.from_json(kv.value) == info and kv.value == info.to_json().encode()
        assert kv.lease != 0
        assert await c.get_lease_info(kv.lease) and (await c.get_lease_info(kv.lease)).grantedTTL == TTL

        # Kept alive past several TTLs, on the same lease (no re-registration).
        deadline = time.monotonic() + 3 * TTL
        while time.monotonic() < deadline:
            now = await c.get(worker_key(info).encode())
            assert now is not None and now.lease == kv.lease
            await asyncio.sleep(0.25)
        assert reg.registered

        # close() revokes: a watcher sees the DELETE at once, not when the lease would expire (TTL).
        watch = await c.watch(worker_key(info).encode())
        events = aiter(watch)
        t0 = time.monotonic()
        await reg.close()
        event = await asyncio.wait_for(anext(events), 3 * TTL)
        elapsed = time.monotonic() - t0
        await watch.cancel()
        assert event.kind == aetcd.EventKind.DELETE and elapsed < TTL / 2, elapsed
        assert not reg.registered
        await reg.close()  # idempotent


async def test_registers_again_after_lease_revoked_or_key_deleted(etcd: LocalEtcd) -> None:
    info = make_info(Role.DECODE, 8200)
    key = worker_key(info).encode()
    reg = EtcdRegistration(etcd.endpoint, info, ttl=TTL)
    await reg.start()
    try:
        async with etcd_client(etcd.endpoint) as c:
            old_lease = (await c.get(key)).lease
            await c.revoke_lease(old_lease)  # behind its back
            assert await c.get(key) is None
            present: list[aetcd.KeyValue | None] = [None]

            async def poll() -> None:
                while present[0] is None:
                    present[0] = await c.get(key)
                    await asyncio.sleep(0.02)

            await asyncio.wait_for(poll(), 1.2)  # refresh every ttl/3 = 0.67 s
            assert present[0].lease not in (0, old_lease)
            assert present[0].value == info.to_json().encode()

            await c.delete(key)  # the lease lives on, the key is gone
            present[0] = None
            await asyncio.wait_for(poll(), 1.2)
            assert present[0].value == info.to_json().encode()
        assert reg.registered
    finally:
        await reg.close()


async def test_registration_survives_etcd_restart(etcd: LocalEtcd, caplog) -> None:
    caplog.set_level(logging.WARNING, "xpyd.discovery")
    info = make_info(Role.PREFILL, 8300)
    reg = EtcdRegistration(etcd.endpoint, info, ttl=TTL)
    await reg.start()
    try:
        await asyncio.to_thread(etcd.kill)
        await wait_until(lambda: not reg.registered, 2.0, "registration notices the outage")
        await asyncio.sleep(1.0)  # several refresh attempts fail: the worker must not care
        outage_logs = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(outage_logs) == 1  # logged once per outage
        await asyncio.to_thread(etcd.start)
        await wait_until(lambda: reg.registered, 3.0, "registered again after etcd came back")
        registry = EtcdRegistry(etcd.endpoint)
        await registry.start()
        assert registry.workers(Role.PREFILL) == [info]
        await registry.close()

        # etcd comes back without its data (lease lost): the key is written under a new lease.
        await asyncio.to_thread(etcd.kill)
        shutil.rmtree(etcd.data_dir / "data")
        await asyncio.to_thread(etcd.start)
        async with etcd_client(etcd.endpoint) as c:
            kv: list = [None]

            async def poll() -> None:
                while kv[0] is None:
                    kv[0] = await c.get(worker_key(info).encode())
                    await asyncio.sleep(0.02)

            await asyncio.wait_for(poll(), 3.0)
            assert kv[0].lease != 0 and kv[0].value == info.to_json().encode()
    finally:
        await reg.close()


async def test_start_raises_when_etcd_unreachable() -> None:
    endpoint = f"127.0.0.1:{closed_port()}"
    t0 = time.monotonic()
    with pytest.raises(RegistryError, match="could not register"):
        await EtcdRegistration(endpoint, make_info(Role.PREFILL, 8100), start_timeout=0.5).start()
    with pytest.raises(RegistryError, match="unreachable"):
        await EtcdRegistry(endpoint, start_timeout=0.5).start()
    assert time.monotonic() - t0 < 4.0  # their start_timeout (0.5 s each), not the defaults (30 s)


# --- EtcdRegistry ------------------------------------------------------------------------


async def test_registry_lists_then_watches(etcd: LocalEtcd) -> None:
    p1, d1, d2 = make_info(Role.PREFILL, 8100), make_info(Role.DECODE, 8200), make_info(Role.DECODE, 8300)
    async with etcd_client(etcd.endpoint) as c:
        await c.put(worker_key(p1).encode(), p1.to_json().encode())
        await c.put(worker_key(d2).encode(), d2.to_json().encode())
        registry = EtcdRegistry(etcd.endpoint)
        changes = []
        registry.on_change(lambda: changes.append(registry.workers(Role.DECODE)))
        await registry.start()
        try:
            assert registry.healthy
            assert registry.workers(Role.PREFILL) == [p1] and registry.workers(Role.DECODE) == [d2]

            reg = EtcdRegistration(etcd.endpoint, d1, ttl=TTL)
            await reg.start()
            took = await wait_until(lambda: len(registry.workers(Role.DECODE)) == 2, 1.0, "new worker seen")
            assert registry.workers(Role.DECODE) == [d1, d2]  # sorted by URL
            assert changes[-1] == [d1, d2]
            logging.getLogger(__name__).info("new key seen after %.1f ms", took * 1000)

            await reg.close()  # revoke: DELETE without a value, removed by key
            await wait_until(lambda: registry.workers(Role.DECODE) == [d2], 1.0, "revoked worker gone")
            await c.delete(worker_key(p1).encode())
            await wait_until(lambda: registry.workers(Role.PREFILL) == [], 1.0, "deleted worker gone")
            assert len(changes) == 4  # start, add, revoke, delete
        finally:
            await registry.close()


async def test_registry_ignores_invalid_values(etcd: LocalEtcd, caplog) -> None:
    caplog.set_level(logging.WARNING, "xpyd.discovery")
    good = make_info(Role.PREFILL, 8100)
    other_model = make_info(Role.PREFILL, 8400, model="other")
    old_version = make_info(Role.DECODE, 8500, version=PROTOCOL_VERSION + 1)
    async with etcd_client(etcd.endpoint) as c:
        await c.put(worker_key(good).encode(), good.to_json().encode())
        await c.put(b"/workers/prefill/127.0.0.1/8600", b"not json")
        await c.put(worker_key(other_model).encode(), other_model.to_json().encode())
        registry = EtcdRegistry(etcd.endpoint, model_id="m")
        await registry.start()
        try:
            assert registry.workers(Role.PREFILL) == [good]
            await c.put(worker_key(old_version).encode(), old_version.to_json().encode())
            await c.put(b"/workers/decode/127.0.0.1/9999", make_info(Role.DECODE, 8700).to_json().encode())
            await c.put(b"/workers/decode/127.0.0.1/8800", b'{"role": "decode"}')
            await c.put(worker_key(good).encode(), b"garbage")  # a valid entry turning invalid is dropped
            await wait_until(lambda: registry.workers(Role.PREFILL) == [], 1.0, "garbage replaces good")
            assert registry.workers(Role.DECODE) == []
            assert registry.healthy
        finally:
            await registry.close()
    reasons = "\n".join(r.getMessage() for r in caplog.records)
    for expected in ("not WorkerInfo JSON", "expected 'm'", "protocol version", "does not match its value",
                     "invalid worker info"):
        assert expected in reasons, reasons


async def test_registry_keeps_last_set_during_outage_and_resyncs(etcd: LocalEtcd) -> None:
    a, b, c_new = make_info(Role.DECODE, 8200), make_info(Role.DECODE, 8300), make_info(Role.DECODE, 8400)
    async with etcd_client(etcd.endpoint) as c:
        for info in (a, b):
            await c.put(worker_key(info).encode(), info.to_json().encode())
    registry = EtcdRegistry(etcd.endpoint)
    await registry.start()
    try:
        await asyncio.to_thread(etcd.stop)
        await wait_until(lambda: not registry.healthy, 1.0, "registry notices the outage")
        # While etcd is away, the same data is edited through a side door (another client port,
        # same data dir and member): the registry cannot see these events, only the resync can.
        side = LocalEtcd(data_dir=etcd.data_dir, client_port=closed_port(), peer_port=etcd.peer_port)
        await asyncio.to_thread(side.start)
        async with etcd_client(side.endpoint) as c:
            await c.delete(worker_key(b).encode())
            await c.put(worker_key(c_new).encode(), c_new.to_json().encode())
        await asyncio.to_thread(side.stop)
        assert registry.workers(Role.DECODE) == [a, b] and not registry.healthy  # last-known set

        await asyncio.to_thread(etcd.start)
        await wait_until(lambda: registry.healthy, 3.0, "registry resyncs after etcd is back")
        assert registry.workers(Role.DECODE) == [a, c_new]
        # and it watches again
        async with etcd_client(etcd.endpoint) as c:
            await c.delete(worker_key(a).encode())
        await wait_until(lambda: registry.workers(Role.DECODE) == [c_new], 1.0, "watch after resync")
    finally:
        await registry.close()


async def test_frozen_etcd_is_noticed_by_grpc_keepalive(etcd: LocalEtcd) -> None:
    """A silent peer (no RST, like a partition): only HTTP/2 pings reveal it on the watch stream."""
    info = make_info(Role.PREFILL, 8100)
    reg = EtcdRegistration(etcd.endpoint, info, ttl=TTL)
    await reg.start()
    registry = EtcdRegistry(etcd.endpoint)
    await registry.start()
    pid = etcd.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        await wait_until(lambda: not registry.healthy, 20.0, "frozen etcd noticed")  # ping + 5 s timeout
        assert registry.workers(Role.PREFILL) == [info] and not reg.registered
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        await wait_until(lambda: registry.healthy and reg.registered, 5.0, "both recover")
        assert registry.workers(Role.PREFILL) == [info]
    finally:
        await registry.close()
        await reg.close()


# --- xpyd status -------------------------------------------------------------------------


async def test_status_prints_registered_workers(etcd: LocalEtcd, capsys) -> None:
    assert await asyncio.to_thread(status.main, etcd.endpoint) == 0
    assert "no workers registered" in capsys.readouterr().out

    infos = [make_info(Role.DECODE, 8200), make_info(Role.PREFILL, 8100, model="SmolLM2-135M-Instruct")]
    regs = [EtcdRegistration(etcd.endpoint, i, ttl=TTL) for i in infos]
    for reg in regs:
        await reg.start()
    try:
        assert await asyncio.to_thread(status.main, etcd.endpoint) == 0
    finally:
        for reg in regs:
            await reg.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ROLE", "HTTP", "URL", "SIGNAL", "ADDR", "MODEL", "CAPACITY"]
    assert lines[1].split() == ["decode", "http://127.0.0.1:8200", "127.0.0.1:8201", "m", "8"]
    assert lines[2].split() == ["prefill", "http://127.0.0.1:8100", "127.0.0.1:8101", "SmolLM2-135M-Instruct", "8"]
    assert lines[1].index("http://") == lines[2].index("http://") == lines[0].index("HTTP URL")  # aligned


def test_status_exit_code_2_when_etcd_unreachable(capsys) -> None:
    assert status.main(f"127.0.0.1:{closed_port()}") == 2
    err = capsys.readouterr().err
    assert "cannot reach etcd" in err
    assert status.main("no-port") == 2
    assert "HOST:PORT" in capsys.readouterr().err
