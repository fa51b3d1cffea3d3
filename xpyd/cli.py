"""The `xpyd` command: up | proxy | prefill | decode | colocated | bench | plan | planner | status.

The top of the import graph. Each command's package is imported only when that command runs, so
`xpyd proxy` or `xpyd bench` never import torch, and `--help` answers at once. `xpyd bench calibrate`
measures the model for the simulated engine: it is the model layer's (`xpyd.model.sim_calibrate`; the
load generator may not import the model), so it is dispatched here, before the bench parser.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _env_defaults() -> None:
    # Must happen before torch is imported: spin-waiting OpenMP threads make a
    # second process on the same cores several times slower.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # ...but between the parallel regions of one forward pass (tens of microseconds apart) a sleeping
    # OpenMP thread costs a futex wake-up each time: let it spin ~1 ms before sleeping (overrides
    # PASSIVE's zero; libgomp counts ~100,000 spins per ms). Measured on 2 cores: a decode step on two
    # threads 67 -> 30-39 ms. Workers that share cores drop to one thread when the other role is busy
    # (cpu_share), so the spinning does not take a core from it for long.
    os.environ.setdefault("GOMP_SPINCOUNT", "100000")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's BLAS: never used per step, no idle pool
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def build_parser() -> argparse.ArgumentParser:
    from xpyd.worker.config import add_worker_arguments
    from xpyd import launcher
    from xpyd.proxy import main as proxy_main

    parser = argparse.ArgumentParser(
        prog="xpyd",
        description="Disaggregated prefill/decode LLM serving with an OpenAI-compatible API.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("up", help="start a local cluster (proxy + prefill + decode workers) and wait",
                       description="Start the proxy and the workers as child processes (static 1P1D by "
                                   "default; with --prefill X --decode Y a dynamic xPyD cluster around a local "
                                   "etcd), wait until all are ready, print the URL; Ctrl-C or SIGTERM stops "
                                   "them all.")
    launcher.add_arguments(p)
    p = sub.add_parser("proxy", help="run the OpenAI-compatible proxy in front of prefill/decode workers",
                       description="Run the proxy. Static mode: give the workers' HTTP URLs.")
    proxy_main.add_arguments(p)
    p = sub.add_parser("prefill", help="run a prefill worker",
                       description="Run a prefill worker: OpenAI HTTP API (the proxy calls it with "
                                   "max_tokens=1) plus a ZMQ ROUTER signal plane for decode workers.")
    add_worker_arguments(p, "prefill")
    p = sub.add_parser("decode", help="run a decode worker",
                       description="Run a decode worker: OpenAI HTTP API; pulls KV from the prefill worker "
                                   "named in each request id and streams tokens 2..n.")
    add_worker_arguments(p, "decode")
    p = sub.add_parser("colocated", help="run a colocated worker (prefill + decode in one batch; the baseline)",
                       description="Run one worker that does prefill and decode in the same continuous batch "
                                   "(the traditional setup), for comparisons with disaggregated serving. Put "
                                   "`xpyd proxy --colocated URL` in front of it.")
    add_worker_arguments(p, "colocated")
    from xpyd.bench import main as bench_main

    p = sub.add_parser("bench", help="benchmark an OpenAI-compatible endpoint (or: xpyd bench transfer | "
                                     "calibrate)", epilog=CALIBRATE_EPILOG)
    bench_main.add_arguments(p)
    from xpyd.planner import main as plan_main

    p = sub.add_parser("plan", help="the offline SLO planner: the prefill:decode split and batch for a workload",
                       description="Model a P/D fleet on a trace with a timing profile and find the prefill:decode "
                                   "split and decode batch that meet the SLO at the least workers, with the "
                                   "predicted goodput.")
    plan_main.add_arguments(p)
    from xpyd.launcher import planner_service

    p = sub.add_parser("planner", help="the online SLO planner as a service (Kubernetes): scale the prefill and "
                                       "decode Deployments, or expose their desired replicas for an HPA or KEDA",
                       description="Every --planner-interval read the proxy's metrics, forecast the next interval and "
                                   "size the prefill and decode workers for --slo (as `xpyd up --planner`); --mode "
                                   "scale sets the Deployments' replicas through the Kubernetes API, --mode metrics "
                                   "exposes xpyd_planner_desired_replicas{role} on /metrics. Its target and "
                                   "decisions go to etcd (the proxy's /cluster shows them). docs/planner.md")
    planner_service.add_arguments(p)
    p = sub.add_parser("status", help="list the workers registered in etcd",
                       description="Print the workers registered under /workers/ in etcd.")
    p.add_argument("--etcd", required=True, metavar="HOST:PORT", help="the cluster's etcd")
    return parser


CALIBRATE_EPILOG = """\
calibrate mode (the simulated engine's timing profile):
  xpyd bench calibrate --model M --out FILE [--dtype float32|bfloat16] [--threads N] [--quick]
      measure this machine's real engine: prefill time vs new and cached tokens, decode step time vs
      batch and context; the profile for --engine sim --sim-profile FILE (xpyd bench calibrate --help)"""


def main(argv: list[str] | None = None) -> int:
    _env_defaults()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["bench", "calibrate"]:
        from xpyd.model import sim_calibrate

        return sim_calibrate.main(argv[2:])
    args = build_parser().parse_args(argv)
    label = args.command
    if args.command == "proxy":
        from xpyd.proxy.processes import process_label

        label = process_label() or label  # proxy.i: one of `xpyd proxy --workers N`
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {label:>7} %(levelname)s %(message)s",
                        stream=sys.stderr)
    if os.environ.get("XPYD_DEBUG"):  # xpyd's own debug lines (e.g. each prefill step: its chunks and time)
        logging.getLogger("xpyd").setLevel(logging.DEBUG)
    try:
        if args.command == "up":
            from xpyd import launcher

            return launcher.run(args)
        if args.command == "bench":
            from xpyd.bench import main as bench_main

            return bench_main.run(args)
        if args.command == "plan":
            from xpyd.planner import main as plan_main

            return plan_main.run(args)
        if args.command == "planner":
            from xpyd.launcher import planner_service

            return planner_service.run(args)
        if args.command == "status":
            from xpyd.discovery import status

            return status.main(args.etcd)
        if args.command == "proxy":
            from xpyd.proxy import main as proxy_main

            proxy_main.run(args, argv[argv.index("proxy") + 1:])
            return 0
        from xpyd.worker.config import config_from_args

        config = config_from_args(args, args.command)
        from xpyd.netaddr import reserve_listen

        http_socket = reserve_listen(config.host, config.port)  # before the runtime's imports (seconds): a
        if args.command == "prefill":  # taken port is an error at once, and a crash loop's restarts fail fast
            from xpyd.prefill_worker.main import run
        elif args.command == "decode":
            from xpyd.decode_worker.main import run
        else:
            from xpyd.colocated_worker.main import run
        run(config, http_socket)
        return 0
    except ValueError as e:  # configuration errors: say what is wrong, no traceback
        print(f"xpyd {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
