"""--kv-backend: config validation, what each name builds, and the clear refusals."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from types import SimpleNamespace

import pytest

from xpyd.worker.config import WorkerConfig, add_worker_arguments, config_from_args
from xpyd.model.kv_pool import KVLayout, KVPool
from xpyd.transfer.selection import kv_copy_threads, make_worker_backend
from xpyd.worker.kv_staging import adopt_pool


def test_config_default_is_auto_and_names_are_checked():
    assert WorkerConfig("decode").kv_backend == "auto"
    with pytest.raises(ValueError, match="--kv-backend must be one of auto, tcp, shm, nixl, neuron"):
        WorkerConfig("decode", kv_backend="rdma")
    for role in ("prefill", "decode"):
        p = argparse.ArgumentParser()
        add_worker_arguments(p, role)
        assert config_from_args(p.parse_args(["--kv-backend", "shm"]), role).kv_backend == "shm"


@pytest.mark.parametrize("name,backend,offers,segment", [
    ("tcp", "tcp", [], False),
    ("shm", "shm", ["shm-host"], True),
    ("auto", "tcp", ["shm", "shm-host"], True),
])
def test_each_name_builds_its_backend_and_places_the_prefill_pool(name, backend, offers, segment):
    runner = SimpleNamespace(pool=KVPool(KVLayout(2, 2, 8, "float32", 2, 16)))
    old = runner.pool
    t = make_worker_backend(name, "127.0.0.1", 0, None)
    try:
        adopt_pool(t, runner)
        desc = t.register(runner.pool.buffer())
        assert (desc.backend, [n for n, _ in desc.offers]) == (backend, offers)
        assert (runner.pool is not old) == segment and runner.pool.layout == old.layout
    finally:
        t.close()


def test_nixl_builds_when_installed_and_refuses_with_the_pip_command_otherwise(monkeypatch):
    if importlib.util.find_spec("nixl") is not None:
        t = make_worker_backend("nixl", "127.0.0.1", 0, None)
        try:
            assert t.register(memoryview(bytearray(4096))).backend == "nixl"
        finally:
            t.close()
    monkeypatch.setitem(sys.modules, "nixl", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'xpyd\[nixl\]'.*--no-deps nixl nixl-cu13"):
        make_worker_backend("nixl", "127.0.0.1", 0, None)


def test_neuron_refuses_with_a_reason():
    with pytest.raises((ImportError, NotImplementedError), match="torch-neuronx|device memory"):
        make_worker_backend("neuron", "127.0.0.1", 0, None)


def test_copy_threads_auto_leaves_the_engine_its_cores():
    """Auto: a second copy thread only when a core is left beside the engine's threads, or on a GPU."""
    assert kv_copy_threads(0, engine_threads=2, device="cpu", cpus=2) == 1  # 2 cores, engine on both
    assert kv_copy_threads(0, engine_threads=1, device="cpu", cpus=2) == 2
    assert kv_copy_threads(0, engine_threads=16, device="cpu", cpus=64) == 2
    assert kv_copy_threads(0, engine_threads=2, device="cuda", cpus=2) == 2  # the cores are free
    assert kv_copy_threads(3, engine_threads=2, device="cpu", cpus=2) == 3  # asked for: as asked
    assert WorkerConfig("decode").kv_copy_threads == 0
    with pytest.raises(ValueError, match="--kv-copy-threads"):
        WorkerConfig("decode", kv_copy_threads=17)
    p = argparse.ArgumentParser()
    add_worker_arguments(p, "decode")
    assert config_from_args(p.parse_args(["--kv-copy-threads", "2"]), "decode").kv_copy_threads == 2


@pytest.mark.parametrize("name", ["shm", "auto"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_worker_backend_copies_with_the_threads_it_was_given(name, threads):
    t = make_worker_backend(name, "127.0.0.1", 0, None, copy_threads=threads)
    try:
        assert t.copy_threads == threads
    finally:
        t.close()


def test_transfer_connections_fail_after_the_configured_stall():
    """A cut link drops packets without a word: the tcp backend's sockets let the kernel fail a connection
    whose peer acknowledges nothing for the worker's stall bound (on a real cut across hosts:
    tests/multihost/test_network_faults.py)."""
    import socket

    from xpyd.transfer.tcp import fail_when_stalled

    assert WorkerConfig("prefill", peer_timeout=3.0).transfer_stall_timeout == 3.0  # --peer-timeout
    assert WorkerConfig("prefill", peer_timeout=60.0).transfer_stall_timeout == 60.0
    assert WorkerConfig("decode").transfer_stall_timeout == 10.0  # (decode has no --peer-timeout: its default)
    assert WorkerConfig("decode", prefill_wait_timeout=4.0).transfer_stall_timeout == 4.0
    assert WorkerConfig("decode", prefill_wait_timeout=0.2).transfer_stall_timeout == 1.0
    names = ["tcp", "auto"] + (["nixl"] if importlib.util.find_spec("nixl") else [])
    for name in names:
        t = make_worker_backend(name, "127.0.0.1", 0, None, stall_timeout=4.5)
        try:
            assert (t.primary if name == "auto" else t).stall_timeout == 4.5
        finally:
            t.close()
    with socket.socket() as sock:
        fail_when_stalled(sock, 4.5)
        opt = lambda level, name: sock.getsockopt(level, name)  # noqa: E731
        assert opt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert opt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 4500
        assert (opt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE), opt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                opt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)) == (1, 1, 3)


def test_nixl_control_connections_fail_after_the_stall_as_tcp_ones_do():
    """(Importable without NIXL: the library loads when a backend is made.)"""
    import socket

    from xpyd.transfer import nixl_backend

    with socket.socket() as sock:
        nixl_backend._setup(sock, 4.5)  # what its acceptor and its connects run on each control socket
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 4500
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
