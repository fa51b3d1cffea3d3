"""A decode worker hears of every prefill worker that registers while its own registration is on its way
(real etcd; ``xpyd.worker.main._join``). Its watch's callback was set only after its registration: a prefill
worker registering in that window was in the watch's map but never reached the worker's ``PrefillPeers``,
and every request naming it was refused (403) for good: 18 of 200 requests of a 2P6D cluster."""

from __future__ import annotations

from types import SimpleNamespace

from tests.integration.test_etcd_discovery import make_info
from tests.waiting import until
from xpyd.discovery import etcd as etcd_module
from xpyd.discovery.counts import EtcdOps
from xpyd.discovery.etcd import EtcdRegistration
from xpyd.discovery.types import Role
from xpyd.worker import main as worker_main
from xpyd.worker.config import WorkerConfig
from xpyd.worker.request_gate import PrefillPeers


async def test_a_prefill_worker_that_registers_during_the_decode_workers_registration_is_known(etcd, monkeypatch):
    early, late = make_info(Role.PREFILL, 31000), make_info(Role.PREFILL, 31010)
    first = EtcdRegistration(etcd.endpoint, early, ttl=5)
    await first.start()
    others: list[EtcdRegistration] = [first]
    real_start = EtcdRegistration.start

    async def start_with_a_newcomer(self) -> None:  # the window: another prefill worker registers meanwhile
        if b"/decode/" in self._key:
            newcomer = EtcdRegistration(etcd.endpoint, late, ttl=5)
            await newcomer.start()
            others.append(newcomer)
            watcher = registries[-1]
            await until(lambda: late.signal_addr in {w.signal_addr for w in watcher.workers(Role.PREFILL)},
                        "the decode worker's watch to see the newcomer")
        await real_start(self)

    registries = []
    real_registry = etcd_module.EtcdRegistry

    class Recorded(real_registry):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            registries.append(self)

    monkeypatch.setattr(EtcdRegistration, "start", start_with_a_newcomer)
    monkeypatch.setattr(worker_main, "EtcdRegistry", Recorded)
    config = WorkerConfig(role="decode", port=31020, etcd=etcd.endpoint, lease_ttl=5)
    decode = make_info(Role.DECODE, 31020)
    engine = SimpleNamespace(info=decode, metrics=SimpleNamespace(etcd=EtcdOps()), peers_left=lambda left, joined: None)
    peers = PrefillPeers(registry=True)
    registration, watcher = await worker_main._join(config, engine, peers)
    try:
        assert peers.knows(early.signal_addr)
        assert peers.knows(late.signal_addr), peers.describe()
    finally:
        await registration.close()
        await watcher.close()
        for r in others:
            await r.close()
