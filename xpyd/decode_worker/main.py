"""The decode worker process: the worker runtime with a `DecodeEngine` (its signal-plane DEALERs open
on demand, one per prefill worker it pulls from)."""

from __future__ import annotations

import socket

from xpyd.decode_worker.engine import DecodeEngine
from xpyd.worker.config import WorkerConfig
from xpyd.worker.main import EngineParts, run_worker


def start_engine(parts: EngineParts) -> tuple[DecodeEngine, None]:
    engine = DecodeEngine(parts.runner, parts.tokenizer, parts.config, parts.transfer, parts.served)
    engine.start()
    return engine, None


def run(config: WorkerConfig, http_socket: socket.socket | None = None) -> None:
    run_worker(config, start_engine, http_socket)
