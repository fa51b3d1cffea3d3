"""The online planner's flags, shared by `xpyd up --planner` and `xpyd planner`, and the planner they make."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

from xpyd.discovery.planner_state import PlannerMode
from xpyd.launcher.planner_loop import PlannerLoop, PlannerLoopConfig, SupervisedWorkers
from xpyd.model.sim.profile import SimProfile, default_profile
from xpyd.planner.controller import Controller, PlannerConfig, Role
from xpyd.planner.fleet_model import FleetConfig
from xpyd.planner.online_model import SimFleetModel
from xpyd.planner.slo import PlanSLO


def add_planner_tuning(g: argparse._ActionsContainer) -> None:
    """What the planner aims at and how often it looks (both commands)."""
    g.add_argument("--slo", default=None, metavar="ttft=2s,itl=200ms[,attainment=0.95]",
                   help="the planner's target (as `xpyd plan --slo`)")
    g.add_argument("--max-workers", type=int, default=8, metavar="N", help="prefill + decode workers at most (8)")
    g.add_argument("--planner-interval", type=float, default=15.0, metavar="S", help="seconds an interval (15)")
    g.add_argument("--planner-dwell", type=float, default=60.0, metavar="S",
                   help="no change of a role within this long of its last one (60)")
    g.add_argument("--planner-decisions", default=None, metavar="FILE", help="append each decision here (JSON lines)")


def add_planner_options(p: argparse.ArgumentParser) -> None:
    """`xpyd up`'s planner flags (its --sim-profile is the workers' own, passed on to them too)."""
    g = p.add_argument_group("online planner (with --prefill/--decode: through etcd)")
    g.add_argument("--planner", action="store_true",
                   help="start and drain prefill and decode workers to meet --slo at the least workers: every "
                        "--planner-interval the proxy's metrics, a forecast of the next interval, the fleet "
                        "model (xpyd plan's) timed by --sim-profile (default: the built-in profile); hysteresis "
                        "and a dwell time; each decision logged with its reason and shown on the proxy's "
                        "/cluster (docs/planner.md)")
    add_planner_tuning(g)


def check_slo(args: argparse.Namespace, flag: str) -> PlanSLO:
    """``--slo``, parsed; ValueError naming what is missing or wrong."""
    if args.slo is None:
        raise ValueError(f"{flag} needs --slo (e.g. ttft=2s,itl=200ms)")
    return PlanSLO.parse(args.slo)


def planner_parts(args: argparse.Namespace, profile: SimProfile, decode_batch: int, mode: PlannerMode,
                  flag: str) -> tuple[Controller, PlannerLoopConfig]:
    """The controller and the loop's config the shared flags describe; ValueError naming a wrong flag."""
    slo = check_slo(args, flag)
    config = PlannerConfig(slo=slo, max_workers=args.max_workers, dwell_s=args.planner_dwell)
    model = SimFleetModel(profile, slo, FleetConfig(1, 1, decode_batch=decode_batch))
    loop_config = PlannerLoopConfig(args.planner_interval,
                                    Path(args.planner_decisions) if args.planner_decisions else None, mode=mode)
    return Controller(config, model), loop_config


def planner_from_args(args: argparse.Namespace, cluster, spawn: Callable[[str, int], str], prefill: int, decode: int,
                      scrape: Callable[[], dict[str, str]], port_free: Callable[[Role, int], bool],
                      say: Callable[[str], None]) -> PlannerLoop:
    """The planner `xpyd up --planner` runs; ValueError naming the flag that is wrong."""
    profile = SimProfile.load(args.sim_profile) if args.sim_profile else default_profile()
    if args.engine == "sim" and math.isfinite(args.sim_speedup) and args.sim_speedup != 1:
        profile = profile.faster(args.sim_speedup)  # (the sim workers run that much faster than the profile)
    controller, config = planner_parts(args, profile, args.batch_size, PlannerMode.LOCAL, "--planner")
    return PlannerLoop(controller, SupervisedWorkers(cluster, spawn, prefill, decode, port_free), scrape, config, say)
