"""``xpyd proxy``: command-line flags and the serving loop.

Static mode (``--prefill URL --decode URL``): ``run`` waits for every listed
worker to answer ``/xpyd/info`` first. Dynamic mode (``--etcd HOST:PORT``):
workers come and go through etcd; the proxy may start with none (``/health``
and requests answer 503 until some register). Either way it serves the OpenAI
API (aiohttp.web: ``http_server``) until SIGINT/SIGTERM, finishing in-flight requests for a few
seconds before it exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable

from xpyd.discovery.base import Registry, RegistryError
from xpyd.discovery.static import StaticRegistry
from xpyd.netaddr import host_port, reserve_tcp
from xpyd.proxy.app import create_app
from xpyd.proxy.client import worker_headers
from xpyd.proxy.http_server import serve
from xpyd.api.tool_parsers import PARSERS
from xpyd.proxy.config import ProxyConfig, default_policy
from xpyd.proxy.processes import MAX_WORKERS, NAMES_KEY_ENV, process_label, run_processes
from xpyd.proxy.routing import Policy

log = logging.getLogger("xpyd.proxy")

API_KEY_ENV = "XPYD_API_KEY"
CLUSTER_TOKEN_ENV = "XPYD_CLUSTER_TOKEN"
REGISTRY_CLOSE_SECONDS = 5.0
_DEFAULTS = ProxyConfig()
EVENT_LOOPS = ("uvloop", "asyncio")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=_DEFAULTS.host,
                        help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=_DEFAULTS.port,
                        help="port to listen on (default: %(default)s)")
    parser.add_argument("--etcd", default=None, metavar="HOST:PORT",
                        help="dynamic mode: discover workers in etcd (instead of --prefill/--decode)")
    parser.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="static mode: prefill worker URL, e.g. http://10.0.0.1:8100 "
                             "(repeat for several)")
    parser.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="static mode: decode worker URL, e.g. http://10.0.0.2:8200 "
                             "(repeat for several)")
    parser.add_argument("--colocated", default=None, metavar="URL",
                        help="baseline mode: forward every request to this one colocated worker "
                             "(`xpyd colocated`), which does prefill and decode itself")
    parser.add_argument("--policy", default=None, choices=[p.value for p in Policy],
                        help="how a worker is chosen for each request: cache_aware (where the prompt's "
                             "prefix is cached, unless that worker is a batch busier), least_loaded or "
                             "round_robin (default: cache_aware; least_loaded with one --prefill and one "
                             "--decode, where there is no choice to make)")
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
                        help="at startup, wait this long for all listed workers to be ready "
                             "(or for etcd to answer) (default: %(default)s)")
    parser.add_argument("--max-body-bytes", type=int, default=_DEFAULTS.max_body_bytes,
                        metavar="BYTES", help="largest accepted request body (default: %(default)s)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help=f"require 'Authorization: Bearer KEY' on every route but /health "
                             f"(default: ${API_KEY_ENV}; unset = open). Prefer the environment "
                             "variable: a flag is visible in the process list")
    parser.add_argument("--cluster-token", default=None, metavar="TOKEN",
                        help=f"the workers' --cluster-token: the proxy signs every request id it sends them "
                             f"and presents a credential derived from it, as workers with a token require "
                             f"(default: ${CLUSTER_TOKEN_ENV}; prefer it: a flag is visible in the process "
                             "list)")
    parser.add_argument("--max-concurrent-requests", type=int,
                        default=_DEFAULTS.max_concurrent_requests, metavar="N",
                        help="generation requests the proxy holds at once, queued ones included; "
                             "more get 429 (default: %(default)s)")
    parser.add_argument("--max-queue", type=int, default=_DEFAULTS.max_queue, metavar="N",
                        help="when every decode worker is full, this many requests wait for room; "
                             "more get 503 at once (default: %(default)s; 0 = no waiting)")
    parser.add_argument("--queue-timeout", type=float, default=_DEFAULTS.queue_timeout,
                        metavar="SECONDS",
                        help="longest wait in that queue before a 503 (default: %(default)s)")
    parser.add_argument("--log-requests", action="store_true",
                        help="log one line per dispatched request (and per retry): the client's response id, "
                             "the request id the workers know it by and both workers' URLs, to follow a "
                             "request into the workers' logs (clients never see the internal id)")
    parser.add_argument("--expose-worker-names", action="store_true",
                        help="add 'x-xpyd-workers: prefill=NAME, decode=NAME' (colocated: 'colocated=NAME') to "
                             "every completions/chat answer: opaque names (a role letter and 8 hex digits, never "
                             "an address) of the workers that served it, the same for a worker as long as the "
                             "proxy runs (with a cluster token: in every proxy holding it), so that a benchmark "
                             "can report per worker (`xpyd bench` does); /cluster shows which worker has which "
                             "name (default: off, no header)")
    parser.add_argument("--tool-call-parser", default=None, choices=PARSERS,
                        help="read tool calls out of the answers for tool_choice auto in this format (hermes: "
                             "<tool_call> JSON blocks, as Qwen and Hermes models write them; llama3_json); without "
                             "it tool_choice auto is a 400, as in vLLM (required and named work without it)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="run a request's own chat_template (sandboxed Jinja; as vLLM's flag: without it such "
                             "a request is a 400); the workers need it too")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="accepted for vLLM's command lines: tool_choice auto is on with --tool-call-parser")
    parser.add_argument("--expose-worker-timing", action="store_true",
                        help="end every streamed answer with an SSE comment ': xpyd-timing {json}' (clients skip "
                             "comments), and give every JSON answer the header X-Xpyd-Timing: {json}: the workers' "
                             "own TTFT and gaps between chunks and where the time went, each side's phases, so that "
                             "a benchmark can tell what the proxy adds (`xpyd bench` does; default: off, the "
                             "workers are not asked and the answers are unchanged)")
    parser.add_argument("--event-loop", choices=EVENT_LOOPS, default=None,
                        help="the proxy's event loop: uvloop (libuv: cheaper socket writes and loop turns) or "
                             "asyncio's own (default: uvloop where it is installed, else asyncio)")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="run N proxy processes on the one port (SO_REUSEPORT: the kernel spreads "
                             "connections over them), each with its own event loop, worker discovery, health "
                             "polls and cache index (fed by its own KV event streams); SIGTERM/SIGINT stops all "
                             "(default: %(default)s)")
    parser.add_argument("--migration-limit", type=int, default=_DEFAULTS.migration_limit, metavar="N",
                        help="a request whose decode worker dies (or whose prefill worker dies before decode has "
                             "the KV, or whose pair's path fails) after the client got tokens goes on on another "
                             "pair with the prompt and the tokens sent so far, the client's stream uninterrupted; "
                             "at most N times a request (0: such a request ends with the error; "
                             "default: %(default)s)")
    parser.add_argument("--local-prefill-max-tokens", type=int, default=_DEFAULTS.local_prefill_max_tokens,
                        metavar="N",
                        help="conditional disaggregation: a prompt with at most N tokens that its decode worker "
                             "does not cache (short, or mostly cached there: the proxy's prefix index) is "
                             "prefilled by that decode worker between its steps, with no prefill worker, KV "
                             "transfer or second call; longer ones go to a prefill worker. 0: always a prefill "
                             f"worker (default: %(default)s: on the CPU it did not pay, docs/benchmarks.md; "
                             "scripts/bench_local_prefill.py measures yours)")
    parser.add_argument("--drain-timeout", type=float, default=_DEFAULTS.drain_timeout, metavar="SECONDS",
                        help="on SIGTERM: stop accepting, then let in-flight requests (streams) finish for up "
                             "to this long before closing them (default: %(default)s; keep it under the "
                             "pod's terminationGracePeriodSeconds)")
    parser.add_argument("--pair-cooldown", type=float, default=_DEFAULTS.pair_cooldown, metavar="SECONDS",
                        help="when a request fails between its prefill and decode worker (decode cannot "
                             "reach prefill, the KV does not arrive), route around that pair this long "
                             "while other pairs exist, then try it with one request; doubled if that "
                             "fails, up to 60 s "
                             "(default: %(default)s)")


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """The proxy's config; ValueError names what is wrong with the flags."""
    if args.etcd is not None and (args.prefill or args.decode):
        raise ValueError("--etcd cannot be combined with --prefill/--decode")
    if args.colocated is not None and (args.etcd or args.prefill or args.decode):
        raise ValueError("--colocated cannot be combined with --etcd/--prefill/--decode")
    if args.colocated is None and args.etcd is None and not (args.prefill and args.decode):
        raise ValueError("give --etcd HOST:PORT, or at least one --prefill and one --decode URL")
    if not 1 <= args.workers <= MAX_WORKERS:
        raise ValueError(f"--workers must be in 1..{MAX_WORKERS}, got {args.workers}")
    names_key = os.environ.get(NAMES_KEY_ENV)  # (from the parent of `--workers N`)
    try:
        key = bytes.fromhex(names_key) if names_key else None
    except ValueError:
        raise ValueError(f"${NAMES_KEY_ENV} is not hex") from None
    return ProxyConfig(
        host=args.host,
        port=args.port,
        model_name=args.model_name,
        prefill_urls=tuple(args.prefill),
        decode_urls=tuple(args.decode),
        etcd=args.etcd,
        colocated_url=args.colocated,
        policy=Policy(args.policy) if args.policy is not None else default_policy(
            args.etcd, tuple(args.prefill), tuple(args.decode)),
        connect_timeout=args.connect_timeout,
        read_timeout=args.read_timeout,
        discovery_timeout=args.worker_wait,
        max_body_bytes=args.max_body_bytes,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        cluster_token=args.cluster_token or os.environ.get(CLUSTER_TOKEN_ENV) or None,
        max_concurrent_requests=args.max_concurrent_requests,
        max_queue=args.max_queue,
        queue_timeout=args.queue_timeout,
        pair_cooldown=args.pair_cooldown,
        drain_timeout=args.drain_timeout,
        migration_limit=args.migration_limit,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        log_requests=args.log_requests,
        expose_worker_names=args.expose_worker_names,
        names_key=key,
        expose_worker_timing=args.expose_worker_timing,
        tool_call_parser=args.tool_call_parser,
        trust_request_chat_template=args.trust_request_chat_template,
    )


def make_registry(config: ProxyConfig) -> Registry:
    if config.etcd is not None:
        try:  # only dynamic mode needs the etcd client
            from xpyd.discovery.etcd import EtcdRegistry
        except ImportError as e:
            raise RegistryError(f"dynamic discovery (--etcd) is unavailable: {e}") from e
        return EtcdRegistry(config.etcd)
    return StaticRegistry(
        list(config.prefill_urls), list(config.decode_urls), timeout=config.discovery_timeout,
        headers=worker_headers(config.cluster_token),
    )


async def _start_registry(registry: Registry, config: ProxyConfig) -> None:
    try:
        async with asyncio.timeout(config.discovery_timeout + 1):  # static has its own limit
            await registry.start()
    except TimeoutError:
        raise RegistryError(f"worker discovery did not start within {config.discovery_timeout:g}s "
                            f"(etcd {config.etcd})") from None


def _reserve_port(config: ProxyConfig, reuse_port: bool = False) -> socket.socket:
    """The proxy's port, bound before discovery starts (``netaddr.reserve_tcp``); RegistryError if taken."""
    try:
        return reserve_tcp(config.host, config.port, reuse_port)
    except OSError as e:
        raise RegistryError(f"cannot listen on {host_port(config.host, config.port)}: {e.strerror or e}") from None


async def serve_proxy(config: ProxyConfig, stop: asyncio.Event, reuse_port: bool = False) -> None:
    """Discover the workers, then serve until ``stop`` is set; ``reuse_port``: one of ``--workers N``."""
    address = host_port(config.host, config.port)
    sock = _reserve_port(config, reuse_port)
    if config.colocated_url is not None:
        from xpyd.proxy.colocated import create_colocated_app

        log.info("proxy on http://%s in front of the colocated worker %s", address, config.colocated_url)
        await serve(create_colocated_app(config, config.colocated_url), stop, sock, config.drain_timeout)
        return
    try:
        registry = make_registry(config)
    except BaseException:
        sock.close()
        raise
    planner = None
    try:
        starting = asyncio.create_task(_start_registry(registry, config))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not starting.done():
            starting.cancel()
            return
        starting.result()  # raises RegistryError
        if config.etcd is not None:  # (the online planner writes its state there: /cluster shows it)
            from xpyd.discovery.planner_etcd import PlannerWatch

            planner = PlannerWatch(config.etcd)
            planner.start()
        app = create_app(config, registry, planner)
        source = f"workers from etcd {config.etcd}" if config.etcd else "static workers"
        log.info("proxy on http://%s serving %s (%s, policy %s, API key %s, cluster token %s)", address,
                 config.model_name or "the workers' model", source, config.policy.value,
                 "required" if config.api_key else "not required", "set" if config.cluster_token else "not set")
        await serve(app, stop, sock, config.drain_timeout)
    finally:
        sock.close()  # (if it was not served: stopped or failed before serving)
        try:
            async with asyncio.timeout(REGISTRY_CLOSE_SECONDS):
                if planner is not None:
                    await planner.close()
                await registry.close()
        except TimeoutError:
            log.warning("worker discovery did not close within %gs", REGISTRY_CLOSE_SECONDS)


async def _main(config: ProxyConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await serve_proxy(config, stop, reuse_port=process_label() is not None)


def loop_factory(name: str | None) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What makes the proxy's event loop: uvloop's (``name`` "uvloop", or None where uvloop is installed) or
    asyncio's own (None). ValueError: uvloop asked for and not installed."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":
            raise ValueError("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return None
    return uvloop.new_event_loop


def run(args: argparse.Namespace, argv: list[str] | None = None) -> None:
    """``argv``: the command line's arguments after ``proxy`` (``--workers N`` starts children with them)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as e:
        sys.exit(f"xpyd proxy: {e}")
    try:
        loop_factory(args.event_loop)
    except ValueError as e:
        sys.exit(f"xpyd proxy: {e}")
    if args.workers > 1:
        try:
            sys.exit(run_processes(args.workers, sys.argv[1:] if argv is None else argv, config.host, config.port,
                                   names_key=config.cluster_token is None, drain_timeout=config.drain_timeout))
        except OSError as e:
            sys.exit(f"xpyd proxy: cannot serve on {host_port(config.host, config.port)}: {e.strerror or e}")
    try:
        with asyncio.Runner(loop_factory=loop_factory(args.event_loop)) as runner:
            runner.run(_main(config))
    except RegistryError as e:
        sys.exit(f"xpyd proxy: {e}")
    except OSError as e:  # e.g. the port is taken
        sys.exit(f"xpyd proxy: cannot serve on {host_port(config.host, config.port)}: {e}")


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="xpyd proxy", description=__doc__)
    add_arguments(_parser)
    run(_parser.parse_args())
