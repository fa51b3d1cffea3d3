"""The Registry contract, run against every implementation with real peers.

static: tiny aiohttp servers answering ``GET /xpyd/info`` as workers do.
etcd:   a real etcd, the workers registered through ``EtcdRegistration``.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import time
import timeit
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from xpyd import PROTOCOL_VERSION
from xpyd.discovery.base import Registry, RegistryError
from xpyd.discovery.etcd import EtcdRegistration, EtcdRegistry
from xpyd.discovery.local_etcd import LocalEtcd
from xpyd.discovery.static import StaticRegistry
from xpyd.discovery.types import Role, WorkerInfo

# make_registry({role: count}) -> (a registry that will find these workers, not started; the workers)
Factory = Callable[[dict[Role, int]], Awaitable[tuple[Registry, list[WorkerInfo]]]]


def bound_socket() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


def worker_infos(ports: dict[Role, list[int]]) -> list[WorkerInfo]:
    return [
        WorkerInfo(role=role, http_url=f"http://127.0.0.1:{port}", signal_addr=f"127.0.0.1:{port + 1}",
                   model_id="SmolLM2-135M-Instruct", protocol_version=PROTOCOL_VERSION, capacity=4 + i)
        for role, role_ports in ports.items()
        for i, port in enumerate(role_ports)
    ]


@pytest.fixture(params=["static", "etcd"])
async def make_registry(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[Factory]:
    cleanups: list[Callable[[], Awaitable[None]]] = []
    etcd: LocalEtcd | None = None
    if request.param == "etcd":
        etcd = request.getfixturevalue("etcd")

    async def static(infos: list[WorkerInfo]) -> Registry:
        for info in infos:
            app = web.Application()

            async def handle(_req: web.Request, info: WorkerInfo = info) -> web.Response:
                return web.Response(text=info.to_json(), content_type="application/json")

            app.router.add_get("/xpyd/info", handle)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.SockSite(runner, sockets.pop(info.http_url)).start()
            cleanups.append(runner.cleanup)
        return StaticRegistry([i.http_url for i in infos if i.role is Role.PREFILL],
                              [i.http_url for i in infos if i.role is Role.DECODE], timeout=5.0)

    async def dynamic(infos: list[WorkerInfo]) -> Registry:
        for info in infos:
            reg = EtcdRegistration(etcd.endpoint, info, ttl=2)
            await reg.start()
            cleanups.append(reg.close)
        return EtcdRegistry(etcd.endpoint, model_id="SmolLM2-135M-Instruct")

    # Real listening sockets, so the URLs are unique and (for static) served.
    sockets: dict[str, socket.socket] = {}

    async def factory(ports_per_role: dict[Role, int]) -> tuple[Registry, list[WorkerInfo]]:
        ports = {}
        for role, n in ports_per_role.items():
            socks = [bound_socket() for _ in range(n)]
            ports[role] = sorted(s.getsockname()[1] for s in socks)
            for s in socks:
                sockets[f"http://127.0.0.1:{s.getsockname()[1]}"] = s
        infos = worker_infos(ports)
        registry = await (static if request.param == "static" else dynamic)(infos)
        cleanups.append(registry.close)
        return registry, infos

    yield factory
    for cleanup in reversed(cleanups):
        await cleanup()
    for s in sockets.values():
        s.close()


def by_url(infos: list[WorkerInfo]) -> list[WorkerInfo]:
    return sorted(infos, key=lambda i: i.http_url)


async def test_start_lists_the_workers_with_their_roles(make_registry: Factory) -> None:
    registry, infos = await make_registry({Role.PREFILL: 1, Role.DECODE: 2})
    assert isinstance(registry, Registry)
    await registry.start()
    for role in Role:
        expected = [i for i in infos if i.role is role]
        got = registry.workers(role)
        assert by_url(got) == by_url(expected)  # every WorkerInfo field round-tripped
        assert all(type(w) is WorkerInfo and w.role is role for w in got)


async def test_workers_is_a_non_blocking_snapshot(make_registry: Factory) -> None:
    registry, _ = await make_registry({Role.PREFILL: 1, Role.DECODE: 1})
    assert not inspect.iscoroutinefunction(registry.workers)
    await registry.start()
    snapshot = registry.workers(Role.DECODE)
    snapshot.clear()  # the caller's copy
    assert len(registry.workers(Role.DECODE)) == 1
    # Memory only, no I/O: as fast (within a small factor) as copying a list of the same workers. Best of
    # five runs each, so a busy machine pausing one run does not count.
    held = registry.workers(Role.PREFILL)
    call = min(timeit.repeat(lambda: registry.workers(Role.PREFILL), number=10_000, repeat=5))
    copy = min(timeit.repeat(lambda: list(held), number=10_000, repeat=5))
    assert call < 50 * copy, (call, copy)


async def test_close_is_idempotent(make_registry: Factory) -> None:
    registry, _ = await make_registry({Role.PREFILL: 1, Role.DECODE: 1})
    await registry.start()
    await registry.close()
    await registry.close()
    assert registry.workers(Role.PREFILL) == [] and registry.workers(Role.DECODE) == []


async def test_close_without_start(make_registry: Factory) -> None:
    registry, _ = await make_registry({Role.PREFILL: 1, Role.DECODE: 1})
    await asyncio.wait_for(registry.close(), 1.0)


@pytest.mark.parametrize("kind", ["static", "etcd"])
async def test_start_fails_with_registry_error_when_unreachable(kind: str) -> None:
    with bound_socket() as a, bound_socket() as b:  # bound, not listening: connections are refused
        addr = [f"127.0.0.1:{s.getsockname()[1]}" for s in (a, b)]
        registry = (StaticRegistry([f"http://{addr[0]}"], [f"http://{addr[1]}"], timeout=0.5)
                    if kind == "static" else EtcdRegistry(addr[0], start_timeout=0.5))
        t0 = time.monotonic()
        with pytest.raises(RegistryError):
            await registry.start()
        assert time.monotonic() - t0 < 4.0  # its timeout (0.5 s), not the default (60 s static, 5 s etcd)
        await registry.close()
