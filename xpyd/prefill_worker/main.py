"""The prefill worker process: the worker runtime with a `PrefillEngine` and its signal-plane ROUTER."""

from __future__ import annotations

import socket

from typing import Callable

from xpyd.netaddr import host_port
from xpyd.prefill_worker.engine import PrefillEngine
from xpyd.signal.server import SignalServer
from xpyd.worker.config import WorkerConfig
from xpyd.worker.main import EngineParts, run_worker


def start_engine(parts: EngineParts) -> tuple[PrefillEngine, Callable[[], None]]:
    config = parts.config
    engine = PrefillEngine(parts.runner, parts.tokenizer, config, parts.transfer, parts.served)
    server = SignalServer(config.host, config.signal_port, engine.signal_plane, peer_timeout=config.peer_timeout,
                          counts=engine.metrics.signal)
    engine.notify = server.push  # "ready" goes to the decode worker that claimed the request
    server.start()
    engine.start(host_port(config.public_host, server.port))
    return engine, server.close


def run(config: WorkerConfig, http_socket: socket.socket | None = None) -> None:
    run_worker(config, start_engine, http_socket)
