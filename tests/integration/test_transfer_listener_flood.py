"""Idle connections cannot crowd real senders out of a transfer listener (real listeners, real sockets).

A flood opens hundreds of connections to a receiving backend's listener from several loopback source
addresses (127.0.0.2-6; the real sender connects from 127.0.0.1) and holds them idle: silent, or after
half a tcp header, or after a valid Hello (shm, nixl) and no offer. Whenever the listener closes one, the
flood opens another. Before the listener admitted connections through ``listener.Door``, 256 such filled
its readers and it closed every real sender's connection at once. Now, while the flood runs, real
transfers (each on a fresh connection) land byte for byte; the listener never holds more pending
connections than its caps; and every flood connection is closed (after the flood stops: each within a
few seconds, none before ``OPEN_TIMEOUT`` unless evicted) and counted (``unproven``). An idle connection
that nobody evicts is closed at the deadline, not after the 30 s ``io_timeout``.

The nixl cases keep UCX on loopback (``UCX_NET_DEVICES=lo``): the test bed of tests/multihost adds and
removes an interface in this network namespace while these tests run in a parallel pytest worker, and a
sender whose NIXL agent started while it existed cannot be reached once it is gone
(test_transfer_nixl_stale_interface.py). Which interfaces UCX uses is not what these tests are about.
"""

from __future__ import annotations

import importlib.util
import random
import select
import socket
import threading
import time

import pytest

from tests import door
from xpyd import PROTOCOL_VERSION
from xpyd.transfer import make_backend, shm_segment
from xpyd.transfer.auth import new_secret
from xpyd.transfer.base import Region
from xpyd.transfer.listener import MAX_PENDING, MAX_PENDING_PER_SOURCE, OPEN_TIMEOUT
from xpyd.transfer.tcp_wire import parse_address

SIZE = 1 << 20
FLOOD_SOURCES = [f"127.0.0.{i}" for i in range(2, 7)]  # 5 x 16 > MAX_PENDING: both caps bite
HOLD = 60  # per source: 300 in all, more than the listener's 256 readers
PACE = 0.002  # seconds between a flood thread's connects
ROUNDS = 5  # real transfers during the flood, each on a new connection
CLOSE_BOUND = 10.0  # an unevicted idle connection is closed well within this (OPEN_TIMEOUT is 1 s)

NIXL = pytest.param("nixl", marks=pytest.mark.skipif(importlib.util.find_spec("nixl") is None,
                                                     reason="NIXL is not installed (pip install --no-deps nixl nixl-cu13)"))


@pytest.fixture(autouse=True)
def _ucx_on_loopback(monkeypatch):
    """UCX reads it when each NIXL agent starts (``register``); see the module docstring."""
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")


def _idle_opening(backend: str, n: int) -> bytes:
    """What flood connection ``n`` sends before it goes silent: nothing, or (every other one) half a tcp
    header / a Hello that passes (shm: this host's key; nixl: any metadata)."""
    if n % 2 == 0:
        return b""
    if backend == "tcp":
        return door.tcp_header("victim", [Region(0, 4096)], bytes(32))[:20]
    if backend == "shm":
        return door.shm_hello("xpyd-kv-1-flood", 2 << 20, shm_segment.host_key(), 1 << 20)
    from xpyd.transfer.nixl_wire import Hello  # (nixl only)
    return Hello(PROTOCOL_VERSION, "flood", b"not-metadata", 1 << 20, SIZE).pack()


class Flood:
    """One thread per source address holding ``hold`` idle connections to ``address``, reopening closed ones."""

    def __init__(self, address: str, backend: str, sources: list[str], hold: int) -> None:
        self.address, self.backend, self.hold = parse_address(address), backend, hold
        self.stop = threading.Event()
        self.opened = {s: 0 for s in sources}
        self.socks: dict[str, list[tuple[socket.socket, float]]] = {s: [] for s in sources}
        self.lock = threading.Lock()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(s,), daemon=True) for s in sources]
        for t in self.threads:
            t.start()

    def _run(self, source: str) -> None:
        try:
            while not self.stop.is_set():
                self._reap(source)
                with self.lock:
                    held = len(self.socks[source])
                if held < self.hold:
                    self._open(source)
                time.sleep(PACE)
        except BaseException as e:
            self.errors.append(e)

    def _open(self, source: str) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((source, 0))
        sock.settimeout(5)
        try:
            sock.connect(self.address)
            sock.sendall(_idle_opening(self.backend, self.opened[source]))
        except OSError:  # closed by the listener at once (its readers are full): try again
            sock.close()
            return
        with self.lock:
            self.opened[source] += 1
            self.socks[source].append((sock, time.monotonic()))

    def _reap(self, source: str) -> None:
        """Close (and forget) the connections the listener closed."""
        with self.lock:
            socks = list(self.socks[source])
        for sock, _ in socks:
            if _closed_by_peer(sock):
                sock.close()
                with self.lock:
                    self.socks[source] = [(s, t) for s, t in self.socks[source] if s is not sock]

    def total_opened(self) -> int:
        with self.lock:
            return sum(self.opened.values())

    def halt(self) -> list[tuple[socket.socket, float]]:
        """Stop opening; the connections still held, with when each was opened."""
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in self.threads) and not self.errors, self.errors
        return [pair for socks in self.socks.values() for pair in socks]


class Sampler:
    """Samples a listener door's pending connections (in all, and from its busiest source) until halted."""

    def __init__(self, door_) -> None:
        self.door, self.peak_total, self.peak_per_source = door_, 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.001):
            by_source = self.door.pending_by_source()
            self.peak_total = max(self.peak_total, sum(by_source.values()))
            self.peak_per_source = max(self.peak_per_source, max(by_source.values(), default=0))

    def halt(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def _closed_by_peer(sock: socket.socket) -> bool:
    """Has the listener closed this connection (EOF or reset pending)? Reads what it sent (shm/nixl Reply)."""
    while select.select([sock], [], [], 0)[0]:
        try:
            if not sock.recv(4096):
                return True
        except OSError:
            return True
    return False


def _wait(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


class Pair:
    def __init__(self, backend: str) -> None:
        self.name = backend
        self.rx = make_backend(backend)  # default io_timeout (30 s): only the door closes idle ones sooner
        self.tx = make_backend(backend)
        allocate = getattr(self.tx, "allocate", None)
        self.src = allocate(SIZE) if allocate else memoryview(bytearray(SIZE))
        self.src[:] = random.Random(3).randbytes(SIZE)
        self.tx.register(self.src)
        self.dst = bytearray(SIZE)
        self.desc = self.rx.register(memoryview(self.dst))
        self.address = self.desc.offer(backend)

    def transfer(self, i: int) -> None:
        """One real transfer on a fresh connection (the sender forgets the last one first)."""
        self.tx.forget_peer(self.address)
        src, dst = [Region(i * 8192, 8192)], [Region(SIZE - (i + 1) * 8192, 8192)]
        secret = new_secret()
        rtok = self.rx.expect(f"t{i}", dst, secret=secret)
        stok = self.tx.send(f"t{i}", src, self.desc, dst, secret=secret)
        assert stok.wait(30) and stok.done(), stok.error
        assert rtok.wait(30) and rtok.done(), rtok.error
        assert self.dst[dst[0].offset:dst[0].end] == self.src[src[0].offset:src[0].end]

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


@pytest.mark.parametrize("backend", ["tcp", "shm", NIXL])
def test_real_transfers_land_through_a_flood_of_idle_connections(backend):
    pair = Pair(backend)
    flood = None
    try:
        pair.transfer(0)  # a connection that is in before the flood (and is never evicted by it)
        flood = Flood(pair.address, backend, FLOOD_SOURCES, HOLD)
        _wait(lambda: flood.total_opened() >= 300, 60, "the flood to open 300 connections")
        door_ = pair.rx._door
        sampler = Sampler(door_)
        for i in range(1, ROUNDS + 1):
            pair.transfer(i)
        sampler.halt()
        assert pair.rx.refused == 0
        assert sampler.peak_total <= MAX_PENDING and sampler.peak_per_source <= MAX_PENDING_PER_SOURCE
        assert sampler.peak_total > MAX_PENDING_PER_SOURCE  # (the flood did fill it from several sources)
        held = flood.halt()
        opened = flood.total_opened()
        assert opened > len(FLOOD_SOURCES) * HOLD  # the listener closed many, and the flood reopened them
        # every flood connection still open is closed by the door's deadline
        closed_at: dict[socket.socket, float] = {}

        def all_closed() -> bool:
            for sock, _ in held:
                if sock not in closed_at and _closed_by_peer(sock):
                    closed_at[sock] = time.monotonic()
            return len(closed_at) == len(held)

        _wait(all_closed, CLOSE_BOUND + OPEN_TIMEOUT, "the held flood connections to be closed")
        for sock, _ in held:
            sock.close()
        # each flood connection the listener accepted was counted as dropped (the real ones never)
        _wait(lambda: pair.rx.unproven == opened and door_.pending == 0, 30, "every flood connection counted")
        pair.transfer(ROUNDS + 1)  # and the listener still serves
    finally:
        if flood is not None:
            for sock, _ in flood.halt():
                sock.close()
        pair.close()


@pytest.mark.parametrize("backend", ["tcp", "shm", NIXL])
@pytest.mark.parametrize("opening", ["silent", "half-way"])
def test_an_idle_connection_is_closed_at_the_deadline(backend, opening):
    """Three idle connections (nobody evicts them): each is closed no sooner than ``OPEN_TIMEOUT`` after it
    was opened, and long before the 30 s ``io_timeout`` that bounded it before."""
    pair = Pair(backend)
    socks = []
    try:
        for n in range(3):
            sock = socket.create_connection(parse_address(pair.address), timeout=5)
            opened = time.monotonic()
            sock.sendall(_idle_opening(backend, 0 if opening == "silent" else 1))
            socks.append((sock, opened))
        for sock, opened in socks:
            sock.settimeout(CLOSE_BOUND)
            data = b""
            while chunk := _recv_or_empty(sock):  # (shm, nixl: the Reply to the Hello comes first)
                data += chunk
            elapsed = time.monotonic() - opened
            assert OPEN_TIMEOUT <= elapsed < CLOSE_BOUND, elapsed
        _wait(lambda: pair.rx.unproven == 3, 30, "three connections counted")
        pair.transfer(0)
    finally:
        for sock, _ in socks:
            sock.close()
        pair.close()


def _recv_or_empty(sock: socket.socket) -> bytes:
    try:
        return sock.recv(4096)
    except ConnectionResetError:
        return b""
