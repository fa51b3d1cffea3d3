"""`xpyd up --planner`: the online planner acting on the cluster `xpyd up` runs.

Every ``interval_s`` (``tick``)::

    the proxy's /metrics (a Prometheus text) -> Scrape -> with the one before: the interval (``observe``)
    -> Controller.decide(now, interval, the fleet now) -> each Decision:
         +n: start n workers of its role (``Workers.start``: the next port pair of that role)
         -1: drain the role's newest worker (``Workers.drain``: SIGTERM; it leaves etcd, finishes what it holds,
             its streams move on through the proxy's migration, and it exits; it is never restarted)
    -> every decision logged with its reason, and written as a JSON line to ``decisions_file``

A scrape that fails (the proxy restarting, a timeout) skips the interval; the controller's hysteresis and dwell
time (``xpyd.planner.controller``) keep it from flapping.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from xpyd.model.sim.profile import SimProfile, default_profile
from xpyd.planner.controller import Controller, Decision, Fleet, PlannerConfig, Role
from xpyd.planner.fleet_model import FleetConfig
from xpyd.planner.observe import Lengths, Scrape, observe
from xpyd.planner.online_model import SimFleetModel
from xpyd.planner.slo import PlanSLO


@dataclass(frozen=True, slots=True)
class PlannerLoopConfig:
    interval_s: float = 15.0  # between two scrapes (an interval the controller judges)
    decisions_file: Path | None = None  # JSON lines, one per decision
    defaults: Lengths = Lengths()  # prompt and output lengths until the workers' metrics say

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ValueError(f"--planner-interval must be > 0 s, got {self.interval_s!r}")


class Workers(Protocol):
    """The cluster's workers as the planner moves them."""

    def fleet(self) -> Fleet: ...
    def start(self, role: Role) -> str: ...  # the started worker's name
    def drain(self, role: Role) -> str | None: ...  # the draining worker's name (None: none to drain)


class PlannerLoop:
    def __init__(self, controller: Controller, workers: Workers, scrape: Callable[[], dict[str, str]],
                 config: PlannerLoopConfig, say: Callable[[str], None]) -> None:
        """``scrape()``: source name -> Prometheus text (the proxy's under "proxy"); it may raise OSError or
        ValueError (the interval is skipped)."""
        self._controller = controller
        self._workers = workers
        self._scrape = scrape
        self.config = config
        self._say = say
        self._last: Scrape | None = None
        self._next = 0.0
        self.decisions: list[Decision] = []

    def tick(self, now: float) -> list[Decision]:
        """Judge the interval that ended now, if one is due; the decisions it acted on."""
        if now < self._next:
            return []
        self._next = now + self.config.interval_s
        try:
            scrape = Scrape.parse(now, self._scrape())
        except (OSError, ValueError) as e:
            self._say(f"planner: no metrics this interval ({type(e).__name__}: {e})")
            return []
        last, self._last = self._last, scrape
        if last is None:
            return []
        interval = observe(last, scrape, self.config.defaults)
        fleet = self._workers.fleet()
        decisions = self._controller.decide(now, interval, fleet)
        for note in self._controller.notes:
            self._say(f"planner: held: {note}")
        for d in decisions:
            self._act(d)
        return decisions

    def _act(self, d: Decision) -> None:
        if d.delta > 0:
            names = [self._workers.start(d.role) for _ in range(d.delta)]
            what = f"started {', '.join(names)}"
        else:
            names = [n for n in (self._workers.drain(d.role) for _ in range(-d.delta)) if n is not None]
            what = f"draining {', '.join(names) or 'nothing'}"
        self.decisions.append(d)
        self._say(f"planner: {d.role.value} {d.delta:+d} -> {d.target}: {what}; {d.reason}")
        if self.config.decisions_file is not None:
            with self.config.decisions_file.open("a") as f:
                f.write(json.dumps({**d.as_dict(), "workers": names}) + "\n")


class SupervisedWorkers:
    """`xpyd up`'s workers of each role, as the planner starts and drains them (``spawn(role, i)`` starts worker
    ``i`` of a role on its i-th port pair and names it)."""

    def __init__(self, cluster, spawn: Callable[[str, int], str], prefill: int, decode: int,
                 port_free: Callable[[Role, int], bool]) -> None:
        self._cluster = cluster
        self._spawn = spawn
        self._port_free = port_free
        self._names = {Role.PREFILL: [f"prefill {i}" for i in range(prefill)],
                       Role.DECODE: [f"decode {j}" for j in range(decode)]}
        self._next = {Role.PREFILL: prefill, Role.DECODE: decode}

    def fleet(self) -> Fleet:
        return Fleet(len(self._names[Role.PREFILL]), len(self._names[Role.DECODE]))

    def start(self, role: Role) -> str:
        i = self._next[role]
        while not self._port_free(role, i):  # (a drained worker's ports may still be in use: the next pair)
            i += 1
        self._next[role] = i + 1
        name = self._spawn(role.value, i)
        self._names[role].append(name)
        return name

    def drain(self, role: Role) -> str | None:
        if len(self._names[role]) <= 1:
            return None
        name = self._names[role].pop()  # the newest
        self._cluster.drain(name)
        return name


def add_planner_options(p) -> None:
    """`xpyd up`'s planner flags."""
    g = p.add_argument_group("online planner (with --prefill/--decode: through etcd)")
    g.add_argument("--planner", action="store_true",
                   help="start and drain prefill and decode workers to meet --slo at the least workers: every "
                        "--planner-interval the proxy's metrics, a forecast of the next interval, the fleet "
                        "model (xpyd plan's) timed by --sim-profile (default: the built-in profile); hysteresis "
                        "and a dwell time; each decision logged with its reason (docs/planner.md)")
    g.add_argument("--slo", default=None, metavar="ttft=2s,itl=200ms[,attainment=0.95]",
                   help="the planner's target (as `xpyd plan --slo`)")
    g.add_argument("--max-workers", type=int, default=8, metavar="N", help="prefill + decode workers at most (8)")
    g.add_argument("--planner-interval", type=float, default=15.0, metavar="S", help="seconds an interval (15)")
    g.add_argument("--planner-dwell", type=float, default=60.0, metavar="S",
                   help="no change of a role within this long of its last one (60)")
    g.add_argument("--planner-decisions", default=None, metavar="FILE", help="append each decision here (JSON lines)")


def planner_from_args(args, cluster, spawn: Callable[[str, int], str], prefill: int, decode: int,
                      scrape: Callable[[], dict[str, str]], port_free: Callable[[Role, int], bool],
                      say: Callable[[str], None]) -> PlannerLoop:
    """The planner `xpyd up --planner` runs; ValueError naming the flag that is wrong."""
    if args.slo is None:
        raise ValueError("--planner needs --slo (e.g. ttft=2s,itl=200ms)")
    slo = PlanSLO.parse(args.slo)
    profile = SimProfile.load(args.sim_profile) if args.sim_profile else default_profile()
    if args.engine == "sim" and math.isfinite(args.sim_speedup) and args.sim_speedup != 1:
        profile = profile.faster(args.sim_speedup)  # (the sim workers run that much faster than the profile)
    config = PlannerConfig(slo=slo, max_workers=args.max_workers, dwell_s=args.planner_dwell)
    model = SimFleetModel(profile, slo, FleetConfig(1, 1, decode_batch=args.batch_size))
    loop_config = PlannerLoopConfig(args.planner_interval,
                                    Path(args.planner_decisions) if args.planner_decisions else None)
    workers = SupervisedWorkers(cluster, spawn, prefill, decode, port_free)
    return PlannerLoop(Controller(config, model), workers, scrape, loop_config, say)
