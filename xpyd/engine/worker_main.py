"""Start one worker process: load the model, start its engine, serve the HTTP API."""

from __future__ import annotations

import asyncio
import logging
import signal

from xpyd.engine.config import WorkerConfig

log = logging.getLogger("xpyd.worker")


def run_worker(config: WorkerConfig) -> None:
    import torch
    from hypercorn.asyncio import serve
    from hypercorn.config import Config as HyperConfig

    from xpyd.engine.api_server import create_worker_app
    from xpyd.engine.loader import ensure_converted
    from xpyd.engine.model_runner import ModelRunner
    from xpyd.engine.tokenizer import load_tokenizer
    from xpyd.transfer import make_backend

    torch.set_num_threads(config.threads)
    resolved = ensure_converted(config.model)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]
    log.info("%s: loading %s (%s, %d slots x %d tokens)", config.role, resolved.path, config.dtype,
             config.batch_size, config.max_model_len)
    runner = ModelRunner(resolved.path, dtype, num_slots=config.batch_size, max_seq_len=config.max_model_len)
    runner.warmup()
    tokenizer = load_tokenizer(resolved.path)
    served = config.served_model_name or resolved.served_name
    transfer = make_backend("tcp", host=config.host, port=config.kv_port, advertise_host=config.advertise_host)

    server = None
    if config.role == "prefill":
        from xpyd.prefill_worker.engine import PrefillEngine
        from xpyd.signal.server import SignalServer

        engine = PrefillEngine(runner, tokenizer, config, transfer, served)
        server = SignalServer(config.host, config.signal_port, engine)
        server.start()
        engine.start(f"{config.public_host}:{server.port}")
    else:
        from xpyd.decode_worker.engine import DecodeEngine

        engine = DecodeEngine(runner, tokenizer, config, transfer, served)
        engine.start()

    app = create_worker_app(engine, config)
    hc = HyperConfig()
    hc.bind = [f"{config.host}:{config.port}"]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")  # our log format, printed once
    hc.graceful_timeout = 2

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        log.info("%s worker ready on http://%s:%d (signal %s)", config.role, config.host, config.port,
                 engine.info.signal_addr)
        await serve(app, hc, shutdown_trigger=stop.wait)

    try:
        asyncio.run(main())
    finally:
        engine.stop()
        if server is not None:
            server.close()
        log.info("%s worker stopped", config.role)
