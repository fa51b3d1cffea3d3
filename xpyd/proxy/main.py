"""``xpyd proxy``: command-line flags and the serving loop (static discovery).

``run`` waits for every listed worker to answer ``/xpyd/info``, then serves the
OpenAI API with hypercorn until SIGINT/SIGTERM, finishing in-flight requests
for a few seconds before it exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig

from xpyd.discovery.base import RegistryError
from xpyd.discovery.static import StaticRegistry
from xpyd.proxy.app import ProxyConfig, create_app

log = logging.getLogger("xpyd.proxy")

GRACEFUL_SHUTDOWN_SECONDS = 5.0
_DEFAULTS = ProxyConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=_DEFAULTS.host,
                        help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=_DEFAULTS.port,
                        help="port to listen on (default: %(default)s)")
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="prefill worker URL, e.g. http://10.0.0.1:8100 (repeat for several)")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="decode worker URL, e.g. http://10.0.0.2:8200 (repeat for several)")
    parser.add_argument("--model-name", default=None, metavar="NAME",
                        help="model name clients use and see in responses "
                             "(default: the model the workers report)")
    parser.add_argument("--connect-timeout", type=float, default=_DEFAULTS.connect_timeout,
                        metavar="SECONDS", help="TCP connect timeout to workers (default: %(default)s)")
    parser.add_argument("--read-timeout", type=float, default=_DEFAULTS.read_timeout,
                        metavar="SECONDS",
                        help="longest wait for any read from a worker: prefill's answer or the "
                             "next stream chunk from decode (default: %(default)s)")
    parser.add_argument("--worker-wait", type=float, default=_DEFAULTS.discovery_timeout,
                        metavar="SECONDS",
                        help="at startup, wait this long for all workers to be ready "
                             "(default: %(default)s)")
    parser.add_argument("--max-body-bytes", type=int, default=_DEFAULTS.max_body_bytes,
                        metavar="BYTES", help="largest accepted request body (default: %(default)s)")


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(
        host=args.host,
        port=args.port,
        model_name=args.model_name,
        prefill_urls=tuple(args.prefill),
        decode_urls=tuple(args.decode),
        connect_timeout=args.connect_timeout,
        read_timeout=args.read_timeout,
        discovery_timeout=args.worker_wait,
        max_body_bytes=args.max_body_bytes,
    )


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve_proxy(config: ProxyConfig, stop: asyncio.Event) -> None:
    """Discover the workers, then serve until ``stop`` is set."""
    registry = StaticRegistry(
        list(config.prefill_urls), list(config.decode_urls), timeout=config.discovery_timeout
    )
    try:
        starting = asyncio.create_task(registry.start())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not starting.done():
            starting.cancel()
            return
        starting.result()  # raises RegistryError
        hc = HypercornConfig()
        hc.bind = [_bind(config.host, config.port)]
        hc.graceful_timeout = GRACEFUL_SHUTDOWN_SECONDS
        hc.errorlog = logging.getLogger("hypercorn.error")  # our log format, printed once
        app = create_app(config, registry)
        log.info("proxy on http://%s serving %s", hc.bind[0], config.model_name or "the workers' model")
        await serve(app, hc, shutdown_trigger=stop.wait)
    finally:
        await registry.close()


async def _main(config: ProxyConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await serve_proxy(config, stop)


def run(args: argparse.Namespace) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as e:
        sys.exit(f"xpyd proxy: {e}")
    try:
        asyncio.run(_main(config))
    except RegistryError as e:
        sys.exit(f"xpyd proxy: {e}")
    except OSError as e:  # e.g. the port is taken
        sys.exit(f"xpyd proxy: cannot serve on {_bind(config.host, config.port)}: {e}")


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="xpyd proxy", description=__doc__)
    add_arguments(_parser)
    run(_parser.parse_args())
