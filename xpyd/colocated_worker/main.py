"""The colocated worker process (the single-server baseline): the worker runtime with a `ColocatedEngine`."""

from __future__ import annotations

import socket

from xpyd.colocated_worker.engine import ColocatedEngine
from xpyd.worker.config import WorkerConfig
from xpyd.worker.main import EngineParts, run_worker


def start_engine(parts: EngineParts) -> tuple[ColocatedEngine, None]:
    engine = ColocatedEngine(parts.runner, parts.tokenizer, parts.config, parts.served)
    engine.start()
    return engine, None


def run(config: WorkerConfig, http_socket: socket.socket | None = None) -> None:
    run_worker(config, start_engine, http_socket)
